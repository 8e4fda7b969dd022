"""Whole answers and errors across API families, and the mappings the streams share.

- `messages_answer_to_chat`: an Anthropic `message` as a `chat.completion`; its text blocks
  joined as the message's `content` (null when it only calls tools, "" when it has nothing), its
  `tool_use` blocks as `tool_calls` (the `input` object as JSON text); thinking and server-tool
  blocks are left out (the request never asks for them).
- `chat_answer_to_messages`: a `chat.completion`'s first choice as an Anthropic `message`: one
  text block (the `content`, then any `refusal`, when not empty), then one `tool_use` block per
  tool call (its arguments parsed; arguments that are not a JSON object give `{}`); vLLM's
  `reasoning_content` is left out.
- ids: an OpenAI answer's is `chatcmpl-` + the Anthropic message's; an Anthropic answer's is
  `msg_` + the OpenAI one's (kept as it is when it has the prefix already). The `model` is the
  one the answering engine wrote. A tool call's id goes to Anthropic with every character
  outside `[A-Za-z0-9_-]` made `_` (the API refuses others; requests map them the same way, so
  results still match their calls).
- stop and finish reasons: end_turn <-> stop, max_tokens (and model_context_window_exceeded)
  <-> length, tool_use <-> tool_calls, refusal <-> content_filter, stop_sequence <-> stop with
  the sequence in the choice's `stop_reason` (vLLM's field for the stop string that matched);
  pause_turn (server tools only) -> stop.
- usage: OpenAI's `prompt_tokens` counts cached tokens, Anthropic's `input_tokens` does not:
  prompt_tokens = input_tokens + cache_read_input_tokens + cache_creation_input_tokens, and
  `prompt_tokens_details.cached_tokens` = cache_read_input_tokens; the other way,
  input_tokens = prompt_tokens - cached_tokens and cache_read_input_tokens = cached_tokens.
- errors keep their status; the body is rewritten (`error_to_chat`, `error_to_messages`). An
  OpenAI error's `code` is the Anthropic error type, so a round trip keeps it. An Anthropic
  error's type comes from that code when it is one of Anthropic's types, else from the status
  (as Anthropic's own table: 400 invalid_request_error, 401 authentication_error, 402
  billing_error, 403 permission_error, 404 not_found_error, 408/504 timeout_error, 413
  request_too_large, 429 rate_limit_error, 503/529 overloaded_error, other 4xx
  invalid_request_error, other 5xx api_error), else (an in-stream error, whose status is not
  known) from the OpenAI or vLLM type's name.

Pure: JSON in, JSON out. The answer's `created` (a clock reading) is the caller's to give.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any, Final

# --- small readers ---------------------------------------------------------------------------


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def as_int(value: Any) -> int:
    """A token count as given, 0 for anything that is not a plain integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def as_str(value: Any) -> str:
    return value if isinstance(value, str) else ""


# --- ids -------------------------------------------------------------------------------------

_NOT_IN_TOOL_ID: Final = re.compile(r"[^A-Za-z0-9_-]")


def chat_id(message_id: str) -> str:
    return "chatcmpl-" + message_id


def message_id(completion_id: str) -> str:
    return completion_id if completion_id.startswith("msg_") else "msg_" + completion_id


def tool_id(value: Any) -> str:
    """A tool call's id as Anthropic accepts it (`^[a-zA-Z0-9_-]+$`)."""
    return _NOT_IN_TOOL_ID.sub("_", as_str(value))


# --- stop and finish reasons -----------------------------------------------------------------

_FINISH_REASONS: Final = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_STOP_REASONS: Final = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


def finish_reason(stop_reason: Any) -> str:
    """An Anthropic `stop_reason` as OpenAI's `finish_reason` ("stop" when unknown or absent)."""
    return _FINISH_REASONS.get(as_str(stop_reason), "stop")


def stop_reason(finish: Any, matched: Any = None) -> tuple[str, str | None]:
    """An OpenAI `finish_reason` (and vLLM's `stop_reason`: the stop string that matched) as
    Anthropic's `stop_reason` and `stop_sequence`."""
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return _STOP_REASONS.get(as_str(finish), "end_turn"), None


# --- usage -----------------------------------------------------------------------------------


def chat_usage(usage: Any) -> dict[str, Any]:
    """Anthropic's usage as OpenAI's."""
    usage = as_dict(usage)
    read = as_int(usage.get("cache_read_input_tokens"))
    prompt = (
        as_int(usage.get("input_tokens")) + read + as_int(usage.get("cache_creation_input_tokens"))
    )
    completion = as_int(usage.get("output_tokens"))
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if read:
        out["prompt_tokens_details"] = {"cached_tokens": read}
    return out


def messages_usage(usage: Any) -> dict[str, Any]:
    """OpenAI's usage as Anthropic's."""
    usage = as_dict(usage)
    prompt = as_int(usage.get("prompt_tokens"))
    cached = min(prompt, as_int(as_dict(usage.get("prompt_tokens_details")).get("cached_tokens")))
    out: dict[str, Any] = {
        "input_tokens": prompt - cached,
        "output_tokens": as_int(usage.get("completion_tokens")),
    }
    if cached:
        out["cache_read_input_tokens"] = cached
    return out


# --- tool calls ------------------------------------------------------------------------------


def arguments_of(tool_input: Any) -> str:
    """A `tool_use` block's `input` as a tool call's `arguments`."""
    return dumps(tool_input if isinstance(tool_input, dict) else {})


def input_of(arguments: Any) -> dict[str, Any]:
    """A tool call's `arguments` (JSON text) as a `tool_use` block's `input`: `{}` when they
    are empty or not a JSON object (Anthropic's input is always an object)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(as_str(arguments))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# --- whole answers ---------------------------------------------------------------------------


def tool_call_of(block: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic `tool_use` block as an OpenAI tool call (its input as JSON text)."""
    return {
        "id": as_str(block.get("id")),
        "type": "function",
        "function": {
            "name": as_str(block.get("name")),
            "arguments": arguments_of(block.get("input")),
        },
    }


def messages_answer_to_chat(answer: dict[str, Any], *, created: int = 0) -> dict[str, Any]:
    """An Anthropic `message` as a `chat.completion` (`created`: the caller's clock, seconds)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in as_list(answer.get("content")):
        block = as_dict(block)
        kind = block.get("type")
        if kind == "text":
            texts.append(as_str(block.get("text")))
        elif kind == "tool_use":
            calls.append(tool_call_of(block))
    text = "".join(texts)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text if text else (None if calls else ""),
    }
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason(answer.get("stop_reason")),
    }
    sequence = answer.get("stop_sequence")
    if answer.get("stop_reason") == "stop_sequence" and isinstance(sequence, str):
        choice["stop_reason"] = sequence
    return {
        "id": chat_id(as_str(answer.get("id"))),
        "object": "chat.completion",
        "created": created,
        "model": as_str(answer.get("model")),
        "choices": [choice],
        "usage": chat_usage(answer.get("usage")),
    }


def text_of_message(message: dict[str, Any]) -> str:
    """A chat answer's text: its `content` (a string or text parts), then its `refusal`."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(
            as_str(part.get("text") or part.get("refusal"))
            for part in content
            if isinstance(part, dict)
        )
    else:
        text = as_str(content)
    return text + as_str(message.get("refusal"))


def chat_answer_to_messages(answer: dict[str, Any]) -> dict[str, Any]:
    """A `chat.completion` (its first choice) as an Anthropic `message`."""
    choices = [c for c in as_list(answer.get("choices")) if isinstance(c, dict)]
    choice = next((c for c in choices if c.get("index", 0) == 0), choices[0] if choices else {})
    message = as_dict(choice.get("message"))
    mid = message_id(as_str(answer.get("id")))
    blocks: list[dict[str, Any]] = []
    text = text_of_message(message)
    if text:
        blocks.append({"type": "text", "text": text})
    for number, call in enumerate(as_list(message.get("tool_calls"))):
        call = as_dict(call)
        function = as_dict(call.get("function"))
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_id(call.get("id")) or tool_id(f"toolu_{mid}_{number}"),
                "name": as_str(function.get("name")),
                "input": input_of(function.get("arguments")),
            }
        )
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"))
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": as_str(answer.get("model")),
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": messages_usage(answer.get("usage")),
    }


# --- errors ----------------------------------------------------------------------------------

# Anthropic's error types, and the OpenAI type each becomes.
_OPENAI_ERROR_TYPES: Final = {
    "invalid_request_error": "invalid_request_error",
    "request_too_large": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "billing_error": "insufficient_quota",
    "timeout_error": "timeout_error",
    "api_error": "server_error",
    "overloaded_error": "service_unavailable_error",
}
_ANTHROPIC_BY_STATUS: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# OpenAI's, vLLM's (exception names) and other servers' error types, lowercased, for an error
# whose status is not known (one inside a stream).
_ANTHROPIC_BY_HINT: Final = {
    "badrequesterror": "invalid_request_error",
    "authenticationerror": "authentication_error",
    "permissiondeniederror": "permission_error",
    "notfounderror": "not_found_error",
    "ratelimiterror": "rate_limit_error",
    "rate_limit_exceeded": "rate_limit_error",
    "requests": "rate_limit_error",
    "tokens": "rate_limit_error",
    "insufficient_quota": "billing_error",
    "server_error": "api_error",
    "internalservererror": "api_error",
    "internal_error": "api_error",
    "service_unavailable": "overloaded_error",
    "service_unavailable_error": "overloaded_error",
    "serviceunavailableerror": "overloaded_error",
    "engine_overloaded": "overloaded_error",
    "timeout": "timeout_error",
    "gatewaytimeouterror": "timeout_error",
    **{kind: kind for kind in _OPENAI_ERROR_TYPES},
}
# How much of a body that is not an error object becomes the message.
_RAW_MESSAGE_CHARS: Final = 1000


def anthropic_type_of_status(status: int) -> str:
    known = _ANTHROPIC_BY_STATUS.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def read_error(status: int | None, body: bytes | str) -> tuple[str | None, str | None, str]:
    """An error body of any family: its type, code (when a string) and message. Reads
    Anthropic's `{"type": "error", "error": {type, message}}`, OpenAI's `{"error": {message,
    type, code}}`, vLLM's older `{"object": "error", message, type, code}` and a bare
    `{"detail": ...}`; anything else is its own message (trimmed)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        value = json.loads(text) if text.strip() else None
    except ValueError:
        value = None
    if isinstance(value, dict):
        detail = value.get("error")
        if isinstance(detail, dict):
            value = detail
        elif isinstance(detail, str):
            value = {"message": detail}
        kind, code = value.get("type"), value.get("code")
        message = value.get("message", value.get("detail"))
        if not isinstance(message, str):
            message = dumps(message) if message is not None else None
        if message:
            return (
                kind if isinstance(kind, str) else None,
                code if isinstance(code, str) else None,
                message,
            )
    message = text.strip()[:_RAW_MESSAGE_CHARS]
    if not message:
        try:
            message = HTTPStatus(status or 500).phrase
        except ValueError:
            message = f"upstream error {status}"
    return None, None, message


def openai_error(status: int | None, kind: str | None, message: str) -> dict[str, Any]:
    """`{"error": ...}` in OpenAI's shape for an Anthropic error of type `kind`."""
    if kind not in _OPENAI_ERROR_TYPES:
        kind = anthropic_type_of_status(status) if status else "api_error"
    return {"error": {"message": message, "type": _OPENAI_ERROR_TYPES[kind], "code": kind}}


def anthropic_error(
    status: int | None, kind: str | None, code: str | None, message: str
) -> dict[str, Any]:
    """`{"type": "error", "error": ...}` in Anthropic's shape for an OpenAI (or vLLM) error."""
    if code in _OPENAI_ERROR_TYPES:
        chosen = code
    elif status is not None and 400 <= status <= 599:
        chosen = anthropic_type_of_status(status)
    else:
        chosen = _ANTHROPIC_BY_HINT.get((kind or "").lower(), "api_error")
    return {"type": "error", "error": {"type": chosen, "message": message}}


def error_to_chat(status: int, body: bytes) -> bytes:
    """An Anthropic error body (status kept by the caller) as an OpenAI error body."""
    kind, _, message = read_error(status, body)
    return dumps(openai_error(status, kind, message)).encode()


def error_to_messages(status: int, body: bytes) -> bytes:
    """An OpenAI or vLLM error body (status kept by the caller) as an Anthropic error body."""
    kind, code, message = read_error(status, body)
    return dumps(anthropic_error(status, kind, code, message)).encode()
