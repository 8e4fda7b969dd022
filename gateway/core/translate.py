"""Translation between OpenAI Chat Completions and Anthropic Messages, for a pool of one API
family that answers a client of the other (a fallback across families).

Pure: JSON objects and bytes in, JSON objects and bytes out; nothing here does I/O or reads a
clock (an OpenAI answer's `created` is the caller's to give). The request given is never
modified; the result may share parts of it (a tool's schema, an image's data).

This module translates requests, and exports the rest: whole answers and errors
(`translate_answer`), streams (`translate_stream`).

Requests, OpenAI -> Anthropic (`chat_to_messages`):

- `system` and `developer` messages, wherever they are, become the top-level `system`, in order
  (a string when there is one message with string content, else text blocks); `name` is dropped.
- user content: a string stays one; text parts become text blocks (empty ones dropped: the API
  refuses them); `image_url` parts become `image` blocks, a `data:` URL as a `base64` source (of
  the media types Anthropic takes: JPEG, PNG, GIF, WebP; others are refused, "image"), an
  http(s) URL as a `url` source (`detail` dropped).
- assistant messages: their text (`content`, text and refusal parts, `refusal`) then one
  `tool_use` block per tool call, its JSON `arguments` parsed into `input` ("" is `{}`;
  arguments that are not a JSON object are refused, "tool_arguments"). A last assistant message
  is one Anthropic continues (a prefill), as vLLM's `continue_final_message` does.
- `tool` messages become `tool_result` blocks of one user message: consecutive ones merge, and a
  user message right after them joins it, after the results (the API wants results first).
- `tools` (functions) -> `tools` with `input_schema`; `tool_choice` auto/none/required/named ->
  auto/none/any/tool; `parallel_tool_calls: false` -> `disable_parallel_tool_use`. Without
  tools, `tool_choice` is dropped (both APIs refuse it alone).
- `max_completion_tokens`, else `max_tokens`, else `DEFAULT_MAX_TOKENS` -> `max_tokens` (which
  Anthropic requires); `stop` -> `stop_sequences`; `temperature` (clamped to Anthropic's 0..1),
  `top_p`, vLLM's `top_k`; `stream`; `user` (or `safety_identifier`) -> `metadata.user_id`.
  `stream_options` goes: an Anthropic stream always has its usage, and the stream translator is
  told whether the client asked for it.

Requests, Anthropic -> OpenAI (`messages_to_chat`): the same mapping the other way. `system`
becomes the first message; a user message's `tool_result` blocks become `tool` messages before
what else it holds; an image's `base64` source becomes a `data:` URL; an assistant message's
text is one string when it calls tools, text parts otherwise, and its thinking blocks (from
earlier turns) are dropped; a tool result's `is_error` is dropped; `cache_control` everywhere
is dropped; `max_tokens` -> `max_tokens` (the one every OpenAI-compatible server reads); `top_k`
stays (vLLM's extension); a stream asks for `stream_options.include_usage` (an Anthropic
stream ends with its usage).

What cannot be translated raises `Untranslatable`, whose `reason` is a short fixed label (safe
in a metric label and to a client). The rule for fields:

- a field that changes what the answer is (its number, its shape, its format, what it holds
  beside text and tool calls) is refused unless set to its neutral value: OpenAI's `n` > 1 and
  `best_of`/`use_beam_search` ("n>1"), `logprobs`/`top_logprobs`/`prompt_logprobs`
  ("logprobs"), `audio` and `modalities` other than text ("audio"), `response_format` other
  than `{"type": "text"}` ("response_format"), `prediction`, legacy `functions`
  ("functions"), `web_search_options` ("web_search"), vLLM's guided decoding
  ("guided_decoding"), `logit_bias`/`allowed_token_ids`/`bad_words` ("logit_bias"), `echo`,
  `documents`; content parts of audio, files or video; tools that are not functions
  ("tool_type"). Anthropic's `thinking` (unless disabled), `output_format`/`output_config.format`
  ("output_format"), `container`, `mcp_servers` ("mcp"), `context_management`; document, search
  result, server-tool and file-sourced blocks; images inside tool results
  ("tool_result_image"); tools that are not custom ("server_tools").
- a field that only tunes sampling or bookkeeping and has no counterpart is dropped: `seed`,
  `frequency_penalty`, `presence_penalty`, `reasoning_effort`, `verbosity`, `store`,
  `metadata` (OpenAI's), `service_tier`, `prompt_cache_key`, vLLM's `repetition_penalty`,
  `min_p`, `min_tokens`, `length_penalty`, `ignore_eos`, `stop_token_ids`, special-token and
  template options, `priority`, `request_id`...; Anthropic's `service_tier`, `speed`,
  `inference_geo`, `diagnostics`, `cache_control`, and `output_config`'s settings other than
  `format` (`effort`).
- any other field is refused ("unknown_field"): what it asks cannot be known to be harmless.
- a request that is not of its API's shape is refused ("malformed").
"""

from __future__ import annotations

import base64
import json
import urllib.parse
from typing import Any, Final

from gateway.core.translate_answer import (
    as_dict,
    as_list,
    as_str,
    chat_answer_to_messages,
    error_to_chat,
    error_to_messages,
    messages_answer_to_chat,
    tool_call_of,
    tool_id,
)
from gateway.core.translate_stream import ChatToMessagesStream, MessagesToChatStream

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "ChatToMessagesStream",
    "MessagesToChatStream",
    "Untranslatable",
    "chat_answer_to_messages",
    "chat_to_messages",
    "error_to_chat",
    "error_to_messages",
    "messages_answer_to_chat",
    "messages_to_chat",
]

# Anthropic requires `max_tokens`; an OpenAI request may leave it to the server.
DEFAULT_MAX_TOKENS: Final = 4096
# Anthropic's temperature range is 0..1 (OpenAI's 0..2).
_MAX_TEMPERATURE: Final = 1.0


class Untranslatable(ValueError):
    """A request that cannot be expressed in the other family; `reason` is short and safe to show
    to clients and put in a metric label, e.g. "n>1", "logprobs", "audio", "response_format"..."""

    def __init__(self, reason: str, detail: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --- OpenAI -> Anthropic ---------------------------------------------------------------------

# Fields read by the translation itself.
_CHAT_MAPPED: Final = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "stop", "temperature",
        "top_p", "top_k", "stream", "stream_options", "user", "safety_identifier", "tools",
        "tool_choice", "parallel_tool_calls",
    }
)  # fmt: skip
# Sampling and bookkeeping without a counterpart: dropped.
_CHAT_DROPPED: Final = frozenset(
    {
        "seed", "frequency_penalty", "presence_penalty", "reasoning_effort", "verbosity",
        "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
        # vLLM's extensions
        "repetition_penalty", "min_p", "min_tokens", "length_penalty", "ignore_eos",
        "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "truncate_prompt_tokens", "add_special_tokens",
        "add_generation_prompt", "continue_final_message", "chat_template",
        "chat_template_kwargs", "mm_processor_kwargs", "priority", "request_id", "cache_salt",
        "kv_transfer_params", "vllm_xargs", "return_token_ids", "thinking_token_budget",
    }
)  # fmt: skip
# Fields that change what the answer is: refused unless neutral (`_neutral`).
_CHAT_REFUSED: Final = {
    "n": "n>1",
    "best_of": "n>1",
    "use_beam_search": "n>1",
    "logprobs": "logprobs",
    "top_logprobs": "logprobs",
    "prompt_logprobs": "logprobs",
    "return_tokens_as_token_ids": "logprobs",
    "audio": "audio",
    "modalities": "audio",
    "response_format": "response_format",
    "prediction": "prediction",
    "functions": "functions",
    "function_call": "functions",
    "web_search_options": "web_search",
    "guided_json": "guided_decoding",
    "guided_regex": "guided_decoding",
    "guided_choice": "guided_decoding",
    "guided_grammar": "guided_decoding",
    "guided_decoding_backend": "guided_decoding",
    "guided_whitespace_pattern": "guided_decoding",
    "structured_outputs": "guided_decoding",
    "structural_tag": "guided_decoding",
    "logit_bias": "logit_bias",
    "allowed_token_ids": "logit_bias",
    "bad_words": "logit_bias",
    "echo": "echo",
    "documents": "documents",
}


def _neutral(key: str, value: Any) -> bool:
    """Whether a refused field's value asks for nothing (its default)."""
    if key == "web_search_options":
        return value is None  # `{}` turns the search on
    if value is None or value is False or value == [] or value == {}:
        return True
    if key in ("n", "best_of"):
        return value == 1 and value is not True
    if key == "top_logprobs":
        return value == 0 and value is not False
    if key == "modalities":
        return bool(value == ["text"])
    if key == "response_format":
        return bool(value == {"type": "text"})
    return False


def _check_fields(
    request: dict[str, Any],
    mapped: frozenset[str],
    dropped: frozenset[str],
    refused: dict[str, str],
) -> None:
    for key, value in request.items():
        if key in mapped or key in dropped:
            continue
        reason = refused.get(key)
        if reason is None:
            raise Untranslatable("unknown_field", key)
        if not _neutral(key, value):
            raise Untranslatable(reason, key)


def chat_to_messages(request: dict[str, Any], model: str) -> dict[str, Any]:
    """An OpenAI chat request as an Anthropic Messages request for `model`."""
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        raise Untranslatable("malformed", "messages")
    _check_fields(request, _CHAT_MAPPED, _CHAT_DROPPED, _CHAT_REFUSED)
    system, messages = _chat_messages(request["messages"])
    limit = request.get("max_completion_tokens")
    if limit is None:
        limit = request.get("max_tokens")
    out: dict[str, Any] = {
        "model": model,
        "max_tokens": DEFAULT_MAX_TOKENS if limit is None else limit,
        "messages": messages,
    }
    if system is not None:
        out["system"] = system
    stop = request.get("stop")
    if isinstance(stop, str):
        out["stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop:
        out["stop_sequences"] = stop
    temperature = request.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        out["temperature"] = min(temperature, _MAX_TEMPERATURE)
    for key in ("top_p", "top_k"):
        if request.get(key) is not None:
            out[key] = request[key]
    if request.get("stream") is not None:
        out["stream"] = request["stream"]
    user = request.get("user") or request.get("safety_identifier")
    if isinstance(user, str) and user:
        out["metadata"] = {"user_id": user}
    tools = _chat_tools(request.get("tools"))
    if tools:
        out["tools"] = tools
        choice = _chat_tool_choice(request.get("tool_choice"))
        if request.get("parallel_tool_calls") is False:
            choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
        if choice is not None:
            out["tool_choice"] = choice
    return out


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for tool in as_list(tools):
        tool = as_dict(tool)
        if tool.get("type", "function") != "function":
            raise Untranslatable("tool_type", str(tool.get("type"))[:40])
        function = as_dict(tool.get("function"))
        if not isinstance(function.get("name"), str):
            raise Untranslatable("malformed", "tools[].function.name")
        schema = function.get("parameters")
        translated: dict[str, Any] = {"name": function["name"]}
        if isinstance(function.get("description"), str):
            translated["description"] = function["description"]
        translated["input_schema"] = (
            schema if isinstance(schema, dict) else {"type": "object", "properties": {}}
        )
        out.append(translated)
    return out


def _chat_tool_choice(choice: Any) -> dict[str, Any] | None:
    if choice is None:
        return None
    if choice in ("auto", "none"):
        return {"type": choice}
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = as_dict(choice.get("function")).get("name")
        if isinstance(name, str):
            return {"type": "tool", "name": name}
    raise Untranslatable("malformed", "tool_choice")


def _chat_messages(messages: list[Any]) -> tuple[Any, list[dict[str, Any]]]:
    """The top-level `system` (None: none) and the Anthropic messages."""
    systems: list[Any] = []  # the system messages' contents
    out: list[dict[str, Any]] = []
    results: list[dict[str, Any]] | None = None  # the content of a user message of tool results
    for message in messages:
        if not isinstance(message, dict):
            raise Untranslatable("malformed", "messages[]")
        role = message.get("role")
        content = message.get("content")
        if role in ("system", "developer"):
            systems.append(content)
            continue
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": tool_id(message.get("tool_call_id")),
                "content": content if isinstance(content, str) else _user_blocks(content),
            }
            if results is None:
                results = [block]
                out.append({"role": "user", "content": results})
            else:
                results.append(block)
            continue
        if role == "user":
            if results is not None:
                results.extend(_user_blocks(content))  # after the results, in the same turn
            else:
                out.append({"role": "user", "content": _user_content(content)})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_content(message)})
        elif role == "function":
            raise Untranslatable("functions", "function message")
        else:
            raise Untranslatable("malformed", "role")
        results = None
    if len(systems) == 1 and isinstance(systems[0], str):
        return systems[0] or None, out
    system = [block for content in systems for block in _text_blocks(content, "system")]
    return system or None, out


def _text_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    blocks = []
    for part in _parts(content, where):
        if part.get("type") != "text":
            raise Untranslatable("content_type", where)
        if as_str(part.get("text")):
            blocks.append({"type": "text", "text": part["text"]})
    return blocks


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise Untranslatable("malformed", f"{where} content")
    return content


def _user_content(content: Any) -> Any:
    return content if isinstance(content, str) else _user_blocks(content)


# Content parts OpenAI-compatible servers take that Anthropic has no block for.
_PART_REASONS: Final = {
    "input_audio": "audio",
    "audio_url": "audio",
    "file": "file",
    "video_url": "video",
}


def _user_blocks(content: Any) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for part in _parts(content, "user"):
        kind = part.get("type")
        if kind == "text":
            if as_str(part.get("text")):
                blocks.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = as_dict(part.get("image_url")).get("url", part.get("image_url"))
            blocks.append({"type": "image", "source": _image_source(as_str(url))})
        else:
            raise Untranslatable(_PART_REASONS.get(str(kind), "content_type"), "content part")
    return blocks


# The media types of Anthropic's base64 images.
_IMAGE_TYPES: Final = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


def _image_source(url: str) -> dict[str, Any]:
    if url.startswith("data:"):
        header, comma, payload = url[len("data:") :].partition(",")
        if not comma:
            raise Untranslatable("image", "data URL")
        params = header.split(";")
        media_type = params[0].lower()
        if media_type not in _IMAGE_TYPES:
            raise Untranslatable("image", "media type")
        if "base64" in params[1:]:
            data = "".join(payload.split())
        else:
            data = base64.b64encode(urllib.parse.unquote_to_bytes(payload)).decode()
        return {"type": "base64", "media_type": media_type, "data": data}
    if url.startswith(("http://", "https://")):
        return {"type": "url", "url": url}
    raise Untranslatable("image", "image URL scheme")


def _assistant_content(message: dict[str, Any]) -> Any:
    if message.get("function_call") is not None:
        raise Untranslatable("functions", "function_call")
    if message.get("audio") is not None:
        raise Untranslatable("audio", "assistant audio")
    content = message.get("content")
    calls = as_list(message.get("tool_calls"))
    refusal = as_str(message.get("refusal"))
    if isinstance(content, str) and not calls and not refusal:
        return content
    blocks: list[dict[str, Any]] = []
    for part in _parts(content, "assistant"):
        kind = part.get("type")
        text = part.get("text") if kind == "text" else part.get("refusal")
        if kind not in ("text", "refusal"):
            raise Untranslatable("content_type", "assistant content part")
        if as_str(text):
            blocks.append({"type": "text", "text": text})
    if refusal:
        blocks.append({"type": "text", "text": refusal})
    for call in calls:
        call = as_dict(call)
        if call.get("type", "function") != "function":
            raise Untranslatable("tool_type", "tool call")
        function = as_dict(call.get("function"))
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_id(call.get("id")),
                "name": as_str(function.get("name")),
                "input": _tool_input(function.get("arguments")),
            }
        )
    return blocks


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's `arguments` as an `input` object ("" is `{}`)."""
    if isinstance(arguments, dict):
        return arguments
    text = as_str(arguments)
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        raise Untranslatable("tool_arguments", "not JSON") from None
    if not isinstance(value, dict):
        raise Untranslatable("tool_arguments", "not a JSON object")
    return value


# --- Anthropic -> OpenAI ---------------------------------------------------------------------

_MESSAGES_MAPPED: Final = frozenset(
    {
        "model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
        "top_k", "stream", "metadata", "tools", "tool_choice", "thinking", "output_config",
    }
)  # fmt: skip
_MESSAGES_DROPPED: Final = frozenset(
    {"service_tier", "speed", "inference_geo", "diagnostics", "cache_control"}
)
_MESSAGES_REFUSED: Final = {
    "output_format": "output_format",
    "container": "container",
    "mcp_servers": "mcp",
    "context_management": "context_management",
}
# Blocks Anthropic takes that OpenAI has no part for, by type.
_BLOCK_REASONS: Final = {
    "document": "document",
    "search_result": "search_result",
    "container_upload": "container",
    "server_tool_use": "server_tools",
    "mcp_tool_use": "server_tools",
    "mcp_tool_result": "server_tools",
}


def messages_to_chat(request: dict[str, Any], model: str) -> dict[str, Any]:
    """An Anthropic Messages request as an OpenAI chat request for `model`."""
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        raise Untranslatable("malformed", "messages")
    _check_fields(request, _MESSAGES_MAPPED, _MESSAGES_DROPPED, _MESSAGES_REFUSED)
    thinking = request.get("thinking")
    if thinking is not None and as_dict(thinking).get("type") != "disabled":
        raise Untranslatable("thinking")
    if as_dict(request.get("output_config")).get("format") is not None:
        raise Untranslatable("output_format")
    messages: list[dict[str, Any]] = []
    system = request.get("system")
    if isinstance(system, str):
        if system:
            messages.append({"role": "system", "content": system})
    elif system is not None:
        parts = [{"type": "text", "text": b["text"]} for b in _anthropic_texts(system, "system")]
        if parts:
            messages.append({"role": "system", "content": parts})
    for message in request["messages"]:
        messages.extend(_anthropic_message(message))
    out: dict[str, Any] = {"model": model, "messages": messages}
    if request.get("max_tokens") is not None:
        out["max_tokens"] = request["max_tokens"]
    if as_list(request.get("stop_sequences")):
        out["stop"] = request["stop_sequences"]
    for key in ("temperature", "top_p", "top_k"):
        if request.get(key) is not None:
            out[key] = request[key]
    if request.get("stream") is not None:
        out["stream"] = request["stream"]
        if request["stream"] is True:
            out["stream_options"] = {"include_usage": True}
    user = as_dict(request.get("metadata")).get("user_id")
    if isinstance(user, str) and user:
        out["user"] = user
    tools = [_anthropic_tool(tool) for tool in as_list(request.get("tools"))]
    if tools:
        out["tools"] = tools
        choice = as_dict(request.get("tool_choice"))
        kind = choice.get("type")
        if kind in ("auto", "none"):
            out["tool_choice"] = kind
        elif kind == "any":
            out["tool_choice"] = "required"
        elif kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif request.get("tool_choice") is not None:
            raise Untranslatable("malformed", "tool_choice")
        if choice.get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False
    return out


def _anthropic_tool(tool: Any) -> dict[str, Any]:
    tool = as_dict(tool)
    if tool.get("type") not in (None, "custom"):
        raise Untranslatable("server_tools", "tool type")
    if not isinstance(tool.get("name"), str):
        raise Untranslatable("malformed", "tools[].name")
    function: dict[str, Any] = {"name": tool["name"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    function["parameters"] = tool.get("input_schema", {"type": "object", "properties": {}})
    return {"type": "function", "function": function}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise Untranslatable("malformed", f"{where} content")
    return content


def _anthropic_texts(content: Any, where: str) -> list[dict[str, Any]]:
    blocks = _blocks(content, where)
    for block in blocks:
        if block.get("type") != "text":
            raise Untranslatable(_BLOCK_REASONS.get(str(block.get("type")), "content_type"), where)
    return blocks


def _refuse_block(kind: Any) -> Untranslatable:
    kind = str(kind)
    if kind.endswith("_tool_result"):
        return Untranslatable("server_tools", "block")
    return Untranslatable(_BLOCK_REASONS.get(kind, "content_type"), "block")


def _anthropic_message(message: Any) -> list[dict[str, Any]]:
    message = as_dict(message)
    role = message.get("role")
    content = message.get("content")
    if role == "user":
        if isinstance(content, str):
            return [{"role": "user", "content": content}]
        tools: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []
        for block in _blocks(content, "user"):
            kind = block.get("type")
            if kind == "tool_result":
                tools.append(_tool_message(block))
            elif kind == "text":
                parts.append({"type": "text", "text": as_str(block.get("text"))})
            elif kind == "image":
                parts.append(_image_part(block))
            else:
                raise _refuse_block(kind)
        return [*tools, {"role": "user", "content": parts}] if parts or not tools else tools
    if role == "assistant":
        if isinstance(content, str):
            return [{"role": "assistant", "content": content}]
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in _blocks(content, "assistant"):
            kind = block.get("type")
            if kind == "text":
                texts.append(as_str(block.get("text")))
            elif kind == "tool_use":
                calls.append(tool_call_of(block))
            elif kind not in ("thinking", "redacted_thinking"):
                raise _refuse_block(kind)
        if not calls:
            return [{"role": "assistant", "content": [{"type": "text", "text": t} for t in texts]}]
        return [{"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls}]
    raise Untranslatable("malformed", "role")


def _tool_message(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    if content is None:
        content = ""
    elif not isinstance(content, str):
        parts = []
        for item in _blocks(content, "tool_result"):
            if item.get("type") == "image":
                raise Untranslatable("tool_result_image")
            if item.get("type") != "text":
                raise _refuse_block(item.get("type"))
            parts.append({"type": "text", "text": as_str(item.get("text"))})
        content = parts
    return {"role": "tool", "tool_call_id": as_str(block.get("tool_use_id")), "content": content}


def _image_part(block: dict[str, Any]) -> dict[str, Any]:
    source = as_dict(block.get("source"))
    kind = source.get("type")
    if kind == "base64":
        url = f"data:{as_str(source.get('media_type'))};base64,{as_str(source.get('data'))}"
    elif kind == "url":
        url = as_str(source.get("url"))
    elif kind == "file":
        raise Untranslatable("file", "image source")
    else:
        raise Untranslatable("malformed", "image source")
    return {"type": "image_url", "image_url": {"url": url}}
