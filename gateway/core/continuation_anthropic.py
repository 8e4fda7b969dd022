"""Continuing an Anthropic Messages stream.

The text so far becomes a prefill: a final `assistant` message the model continues (appended to
the client's own prefill when it sent one). The API rejects a prefill that ends in whitespace,
so trailing whitespace is held back from the request; the continuation usually starts with it
again, and what the client already has is not delivered twice (`Splice`). `max_tokens` shrinks
by the tokens delivered. Some engines stream the prefill again before continuing it (llama.cpp's
server does); that echo is dropped (`resume.echo`).

The client sees one message: a single `message_start` (the continuation's is dropped), its text
block continued under its own index (the continuation's blocks are renumbered after it), one
`message_delta` whose `stop_reason` is the last attempt's and whose `output_tokens` counts
every attempt's tokens, then `message_stop`. Pings of the continuation are dropped.

Tokens delivered: the `content_block_delta` events that carried text (one token each at the
engine's default stream interval).
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

MESSAGE_STOP: Final = format_event('{"type":"message_stop"}', "message_stop")


def refusal(request: dict[str, Any]) -> str | None:
    """Why a Messages stream could not be continued, decided before it is sent. Extended
    thinking is not continued (a prefill cannot carry a thinking block), nor structured
    output."""
    thinking = request.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        return "reasoning"
    # Structured output: a continuation would begin a second document (as on OpenAI routes).
    config = request.get("output_config")
    if request.get("output_format") or (isinstance(config, dict) and config.get("format")):
        return "structured"
    if not isinstance(request.get("messages"), list) or not request["messages"]:
        return "unreadable"
    return None


class AnthropicTranscript(Transcript):
    def __init__(self, request: dict[str, Any], max_bytes: int, echo: EchoMode) -> None:
        super().__init__(request, max_bytes, echo)
        self.message_started = False
        self.input_tokens: int | None = None
        self.blocks = 0  # content blocks started
        self.open_block: int | None = None  # the index of the text block being streamed
        self.in_progress: str | None = None
        self.stop_reason: str | None = None
        self.output_tokens: int | None = None
        self.done = False

    def absorb(self, event: bytes) -> None:
        _, data = parse_event(event)
        if data:
            self.absorb_event(read_object(data))

    def absorb_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start":
            self.message_started = True
            usage = (event.get("message") or {}).get("usage") or {}
            if isinstance(usage.get("input_tokens"), int):
                self.input_tokens = usage["input_tokens"]
        elif kind == "content_block_start":
            self.blocks += 1
            block = event.get("content_block") or {}
            if block.get("type") == "text":
                self.open_block = event.get("index", self.blocks - 1)
                if block.get("text"):
                    self.add_text(block["text"])
            else:
                self.in_progress = "tool_call" if block.get("type") == "tool_use" else "reasoning"
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta":
                if delta.get("text"):
                    self.add_text(delta["text"])
            elif delta.get("type") != "citations_delta":
                self.in_progress = "tool_call" if "json" in str(delta.get("type")) else "reasoning"
        elif kind == "content_block_stop":
            self.open_block = None
        elif kind == "message_delta":
            reason = (event.get("delta") or {}).get("stop_reason")
            if reason:
                self.stop_reason = reason
            usage = event.get("usage") or {}
            if isinstance(usage.get("output_tokens"), int):
                self.output_tokens = usage["output_tokens"]
        elif kind == "message_stop":
            self.done = True

    def why_not(self) -> str | None:
        return super().why_not() or self.in_progress

    def finishing(self) -> bytes | None:
        if self.done:
            return b""
        if self.stop_reason is not None:
            return MESSAGE_STOP
        limit = self.request.get("max_tokens")
        if not isinstance(limit, int) or self.text_events < limit or not self.message_started:
            return None
        ending = b""
        if self.open_block is not None:
            stop = {"type": "content_block_stop", "index": self.open_block}
            ending += format_event(dumps(stop), "content_block_stop")
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"output_tokens": self.text_events},
        }
        return ending + format_event(dumps(delta), "message_delta") + MESSAGE_STOP

    def continuation(self) -> tuple[bytes, Rewriter]:
        reason = self.why_not()
        if reason is not None:
            raise NotResumable(reason)
        request = dict(self.request)
        messages = list(request["messages"])
        text = self.delivered_text
        last = messages[-1]
        own = isinstance(last, dict) and last.get("role") == "assistant"
        if own:
            content = last.get("content")
            combined = _text_of(content) + text
        else:
            content = None
            combined = text
        prefill = combined.rstrip()
        owed = combined[len(prefill) :]
        if own:
            messages[-1] = {**last, "content": _with_text(content, prefill)}
        elif prefill:
            messages.append({"role": "assistant", "content": prefill})
        request["messages"] = messages
        delivered = self.text_events
        limit = request.get("max_tokens")
        if isinstance(limit, int) and not isinstance(limit, bool):
            request["max_tokens"] = max(1, limit - delivered)
        request["stream"] = True
        splice = Splice(prefill if self.echo != "never" else "", self.echo, owed)
        return dumps(request).encode(), AnthropicRewriter(self, splice, delivered)


class AnthropicRewriter(Rewriter):
    def __init__(self, transcript: AnthropicTranscript, splice: Splice, base_tokens: int) -> None:
        self._t = transcript
        self._splice = splice
        self._base = base_tokens
        self._first: int | None = None  # the continuation's first block index...
        self._target = 0  # ...and the client's index it maps to

    def rewrite(self, events: bytes) -> bytes:
        t = self._t
        saved = t.snapshot()
        written: list[tuple[str, dict[str, Any]]] = []
        try:
            for raw in split_events(events):
                name, data = parse_event(raw)
                if not data:
                    continue
                for rewritten in self._event(name, read_object(data)):
                    written.append(rewritten)
                    # The rewriting of later events reads the state these leave.
                    t.absorb_event(rewritten[1])
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            t.restore(saved)  # nothing of this chunk reaches the client
            raise UnreadableEvent(str(exc)) from exc
        return b"".join(format_event(dumps(event), name) for name, event in written)

    def _index(self, index: int) -> int:
        assert self._first is not None
        return index - self._first + self._target

    def _held_delta(self) -> list[tuple[str, dict[str, Any]]]:
        held = self._splice.flush()
        if not held or self._t.open_block is None:
            return []
        delta = {
            "type": "content_block_delta",
            "index": self._t.open_block,
            "delta": {"type": "text_delta", "text": held},
        }
        return [("content_block_delta", delta)]

    def _event(self, name: str | None, event: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        t = self._t
        kind = event.get("type")
        name = name or str(kind)
        if kind == "message_start":
            return [] if t.message_started else [(name, event)]
        if kind == "ping":
            return []
        if kind == "content_block_start":
            index = int(event.get("index", 0))
            block = event.get("content_block") or {}
            if self._first is None:
                self._first = index
                if t.open_block is not None and block.get("type") == "text":
                    self._target = t.open_block
                    text = self._splice.feed(str(block.get("text") or ""))
                    return [self._delta(t.open_block, text)] if text else []
                self._target = t.blocks
                if t.open_block is not None:
                    # The client's text block ends where the continuation starts another kind
                    # of block (a tool call): closed first, as one stream would.
                    closing = [
                        *self._held_delta(),
                        (
                            "content_block_stop",
                            {"type": "content_block_stop", "index": t.open_block},
                        ),
                    ]
                    return [*closing, (name, {**event, "index": self._index(index)})]
            return [(name, {**event, "index": self._index(index)})]
        if kind == "content_block_delta":
            if self._first is None:
                self._first = int(event.get("index", 0))
                self._target = t.open_block if t.open_block is not None else t.blocks
            delta = event.get("delta") or {}
            index = self._index(int(event.get("index", 0)))
            if delta.get("type") == "text_delta":
                text = self._splice.feed(str(delta.get("text") or ""))
                return [self._delta(index, text)] if text else []
            return [(name, {**event, "index": index})]
        if kind == "content_block_stop":
            out = self._held_delta()
            index = self._index(int(event.get("index", 0))) if self._first is not None else 0
            return [*out, (name, {**event, "index": index})]
        if kind == "message_delta":
            out = self._held_delta()
            usage = dict(event.get("usage") or {})
            if isinstance(usage.get("output_tokens"), int):
                usage["output_tokens"] = self._base + usage["output_tokens"]
            if "input_tokens" in usage and t.input_tokens is not None:
                usage["input_tokens"] = t.input_tokens
            return [*out, (name, {**event, "usage": usage})]
        return [(name, event)]

    def _delta(self, index: int, text: str) -> tuple[str, dict[str, Any]]:
        return (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "text_delta", "text": text},
            },
        )


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(
            str(block.get("text", ""))
            for block in content
            if isinstance(block, dict) and block.get("type") == "text"
        )
    return str(content or "")


def _with_text(content: Any, prefill: str) -> Any:
    """The client's prefill `content` carrying `prefill` as its whole text."""
    if isinstance(content, list):
        others = [b for b in content if not (isinstance(b, dict) and b.get("type") == "text")]
        return [*others, {"type": "text", "text": prefill}]
    return prefill
