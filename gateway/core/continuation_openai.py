"""Continuing an OpenAI-format stream (chat completions and completions), as vLLM does it.

- Chat: the text so far goes in a final `assistant` message with `continue_final_message:
  true` and `add_generation_prompt: false` (vLLM answers 400 if both are true): the engine
  continues that message instead of starting a new turn. A request that already continued
  its own final assistant message gets the text appended to it.
- Completions: the prompt followed by the text so far.
- `max_tokens` (and `max_completion_tokens`, vLLM's `min_tokens`) shrink by the tokens
  delivered; the next attempt always asks for `stream_options.include_usage`, so its own
  count is exact.

The client sees one stream: the continuation's chunks take the first chunk's `id`, `created`,
`model`, `system_fingerprint` and `object`; its `role` delta is dropped; its usage is given
only when the client asked for usage, counting every attempt's tokens.

Tokens delivered: the last `usage.completion_tokens` the client received (with vLLM's
`continuous_usage_stats`, on every chunk), else the number of chunks that carried text (vLLM
sends one token per chunk unless its stream interval is raised). Prompt tokens in the usage:
the original request's, when a chunk gave them, else the continuation's prompt minus the
tokens delivered.
"""

from __future__ import annotations

from typing import Any, Final

from gateway.core.continuation import (
    EchoMode,
    NotResumable,
    Rewriter,
    Splice,
    Transcript,
    UnreadableEvent,
    dumps,
    read_object,
)
from gateway.core.sse import format_event, parse_event, split_events

DONE: Final = b"data: [DONE]\n\n"
# The fields every chunk of one stream shares.
_SHARED: Final = ("id", "object", "created", "model", "system_fingerprint")
# What a client may ask for that a continuation cannot give as one answer.
_REFUSED: Final = (
    ("n", "n"),
    ("best_of", "n"),
    ("logprobs", "logprobs"),
    ("top_logprobs", "logprobs"),
    ("prompt_logprobs", "logprobs"),
    ("echo", "echo"),
    # vLLM's token ids of each chunk: a continuation tokenizes the text so far anew, so its
    # ids would not be the ones one generation gives.
    ("return_token_ids", "token_ids"),
)


# Structured output (vLLM's `response_format`, guided decoding, llama.cpp's grammars): the
# constraint applies to each attempt's output from its start, so a continuation would begin a
# new document after the half-written one.
_STRUCTURED: Final = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "grammar",
    "json_schema",
)


# Every field `refusal` looks at: most requests name none of them, which one set operation
# tells (this runs for every request fetched as a stream).
_WATCHED: Final = frozenset({"response_format", *_STRUCTURED, *(key for key, _ in _REFUSED)})


def refusal(request: dict[str, Any], chat: bool) -> str | None:
    """Why a request's stream could not be continued, decided before it is sent (None: it
    could be). More than one choice, and logprobs (a continuation's token boundaries and
    offsets are its own), an echo of the prompt, and structured output are not continued."""
    if not _WATCHED.isdisjoint(request):
        refused = _refused_option(request)
        if refused is not None:
            return refused
    if chat:
        if not isinstance(request.get("messages"), list):
            return "unreadable"
    elif not isinstance(request.get("prompt"), str):
        return "prompt_not_text"  # token ids or several prompts
    return None


def _refused_option(request: dict[str, Any]) -> str | None:
    response_format = request.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "structured"
    if any(request.get(key) not in (None, False) for key in _STRUCTURED):
        return "structured"
    for key, reason in _REFUSED:
        value = request.get(key)
        if value is None or value is False:
            continue
        if key in ("n", "best_of") and value == 1:
            continue
        if key == "top_logprobs" and value == 0:
            continue
        return reason
    return None


def wants_usage(request: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as the client asked."""
    options = request.get("stream_options")
    if not isinstance(options, dict):
        return False, False
    return options.get("include_usage") is True, options.get("continuous_usage_stats") is True


class OpenAITranscript(Transcript):
    def __init__(self, request: dict[str, Any], chat: bool, max_bytes: int, echo: EchoMode) -> None:
        super().__init__(request, max_bytes, echo)
        self.chat = chat
        self.shared: dict[str, Any] | None = None  # the first chunk's shared fields
        self.finish_reason: str | None = None
        self.in_progress: str | None = None  # a tool call or reasoning: not continued
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None  # the last usage the client received
        self.done = False
        self.usage_sent = False  # the stream's own usage chunk (no choices) reached the client
        self.include_usage, self.continuous = wants_usage(request)

    def absorb(self, event: bytes) -> None:
        _, data = parse_event(event)
        if not data:
            return
        if data == "[DONE]":
            self.done = True
            return
        self.absorb_chunk(read_object(data))

    def absorb_chunk(self, chunk: dict[str, Any]) -> None:
        if self.shared is None:
            self.shared = {key: chunk[key] for key in _SHARED if key in chunk}
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if not chunk.get("choices"):
                self.usage_sent = True
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            if isinstance(usage.get("completion_tokens"), int):
                self.completion_tokens = usage["completion_tokens"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                self.in_progress = "n"
            if self.chat:
                delta = choice.get("delta") or {}
                text = delta.get("content")
                if delta.get("tool_calls") or delta.get("function_call"):
                    self.in_progress = "tool_call"
                elif delta.get("reasoning_content") or delta.get("reasoning"):
                    self.in_progress = "reasoning"
            else:
                text = choice.get("text")
            if text:
                self.add_text(text)
            reason = choice.get("finish_reason")
            if reason:
                self.finish_reason = reason

    @property
    def delivered_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.text_events

    def why_not(self) -> str | None:
        return super().why_not() or self.in_progress

    def finishing(self) -> bytes | None:
        if self.done:
            return b""
        ending = b""
        if self.finish_reason is None:
            limit = _max_tokens(self.request)
            if limit is None or self.delivered_tokens < limit or self.shared is None:
                return None
            # Every token it could have went out: its finish chunk is what was lost.
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            ending = format_event(dumps({**self.shared, "choices": [choice]}))
        # The last token went out; what was lost is the usage (when asked) and [DONE].
        wanted = self.include_usage and not self.usage_sent
        if wanted and self.shared is not None and self.prompt_tokens is not None:
            usage = _usage(self.prompt_tokens, self.delivered_tokens)
            ending += format_event(dumps({**self.shared, "choices": [], "usage": usage}))
        return ending + DONE

    def continuation(self) -> tuple[bytes, Rewriter]:
        reason = self.why_not()
        if reason is not None:
            raise NotResumable(reason)
        request = dict(self.request)
        text = self.delivered_text
        echo = text
        if self.chat:
            messages = list(request["messages"])
            last = messages[-1] if messages else None
            own_prefill = (
                request.get("continue_final_message") is True
                and isinstance(last, dict)
                and last.get("role") == "assistant"
            )
            if own_prefill:
                assert isinstance(last, dict)
                messages[-1] = {**last, "content": _extended(last.get("content"), text)}
                echo = _text_of(messages[-1]["content"])
            else:
                messages.append({"role": "assistant", "content": text})
            request["messages"] = messages
            request["continue_final_message"] = True
            request["add_generation_prompt"] = False
        else:
            request["prompt"] = request["prompt"] + text
            echo = request["prompt"]
        delivered = self.delivered_tokens
        for key in ("max_tokens", "max_completion_tokens"):
            value = request.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                request[key] = max(1, value - delivered)
        min_tokens = request.get("min_tokens")
        if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
            request["min_tokens"] = max(0, min_tokens - delivered)
        options = dict(request.get("stream_options") or {})
        options["include_usage"] = True
        request["stream_options"] = options
        request["stream"] = True
        # vLLM and llama.cpp's server stream only the continuation on these routes: a
        # continued text is taken for an echo only when the policy says the engine echoes.
        splice = Splice(echo if self.echo == "always" else "", self.echo)
        return dumps(request).encode(), OpenAIRewriter(self, splice, delivered)


class OpenAIRewriter(Rewriter):
    """The continuation's chunks as chunks of the client's stream."""

    def __init__(self, transcript: OpenAITranscript, splice: Splice, base_tokens: int) -> None:
        self._t = transcript
        self._splice = splice
        self._base = base_tokens  # tokens the client had before this attempt
        self._chat = transcript.chat

    def rewrite(self, events: bytes) -> bytes:
        t = self._t
        shared = t.shared
        written: list[dict[str, Any] | None] = []  # None: [DONE]
        try:
            for event in split_events(events):
                _, data = parse_event(event)
                if not data:
                    continue
                if data == "[DONE]":
                    held = self._splice.flush()
                    if held:
                        written.append(self._text_chunk(held))
                    written.append(None)
                    continue
                rewritten = self._chunk(read_object(data))
                if rewritten is not None:
                    written.append(rewritten)
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            # Nothing of this chunk reaches the client, so nothing of it is in the transcript.
            t.shared = shared
            raise UnreadableEvent(str(exc)) from exc
        out: list[bytes] = []
        for chunk in written:
            if chunk is None:
                t.done = True
                out.append(DONE)
            else:
                t.absorb_chunk(chunk)
                out.append(format_event(dumps(chunk)))
        return b"".join(out)

    def _chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        t = self._t
        if t.shared is None:  # nothing had reached the client: this chunk opens the stream
            t.shared = {key: chunk[key] for key in _SHARED if key in chunk}
            first = True
        else:
            first = False
        choices: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            choice = dict(choice)
            if self._chat:
                delta = dict(choice.get("delta") or {})
                if not first:
                    delta.pop("role", None)
                text = delta.get("content")
            else:
                delta = {}
                text = choice.get("text")
            finished = bool(choice.get("finish_reason"))
            if isinstance(text, str):
                text = self._splice.feed(text)
                if finished:
                    text += self._splice.flush()
            elif finished:
                held = self._splice.flush()
                text = held or None
            if self._chat:
                if text is None:
                    delta.pop("content", None)
                else:
                    delta["content"] = text
                choice["delta"] = delta
                carries = bool(text) or any(
                    value for key, value in delta.items() if key not in ("role", "content")
                )
                carries = carries or (first and "role" in delta)
            else:
                choice["text"] = text or ""
                carries = bool(text)
            if carries or finished:
                choices.append(choice)
        usage = chunk.get("usage")
        client_usage = None
        if isinstance(usage, dict) and (t.include_usage or t.continuous):
            client_usage = self._client_usage(usage)
        if not choices and (chunk.get("choices") or client_usage is None):
            return None  # nothing left for the client (a role delta, an unasked usage)
        rewritten = {**chunk, **t.shared, "choices": choices}
        if client_usage is not None:
            rewritten["usage"] = client_usage
        else:
            rewritten.pop("usage", None)
        return rewritten

    def _client_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        t = self._t
        completion = self._base + int(usage.get("completion_tokens") or 0)
        prompt = t.prompt_tokens
        if prompt is None:
            prompt = max(0, int(usage.get("prompt_tokens") or 0) - self._base)
            t.prompt_tokens = prompt
        return _usage(prompt, completion)

    def _text_chunk(self, text: str) -> dict[str, Any]:
        t = self._t
        assert t.shared is not None
        if self._chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None}
        return {**t.shared, "choices": [choice]}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def _max_tokens(request: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _extended(content: Any, text: str) -> Any:
    """A message's content with `text` appended (a string, or a list of parts)."""
    if isinstance(content, list):
        parts = list(content)
        if parts and isinstance(parts[-1], dict) and parts[-1].get("type") == "text":
            parts[-1] = {**parts[-1], "text": str(parts[-1].get("text", "")) + text}
        else:
            parts.append({"type": "text", "text": text})
        return parts
    return (content or "") + text


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")
