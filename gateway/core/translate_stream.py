"""Streams across API families: Anthropic's named events <-> OpenAI's `chat.completion.chunk`s.

Both translators take the upstream's bytes in any chunking (`feed`: an event may be split
anywhere across calls) and give back the client's bytes; only the unfinished tail of the last
event is held between calls, and the search for an event's end looks only at the bytes that
came since, so a stream costs time and memory linear in its size. At the upstream's EOF,
`finish` gives what must still go out. `ended` tells that the translated stream has written its
proper last event (`data: [DONE]`, `message_stop`); `failed`, that it ended with an error event
instead (nothing follows one: not even `[DONE]`).

Anthropic -> OpenAI (`MessagesToChatStream`): `message_start` gives the first chunk (the role,
`content` null), its id (`chatcmpl-` + the message's) and model; a text block's text and its
`text_delta`s become `content` deltas; a `tool_use` block becomes a tool call with its own
`index` (0, 1, ... in the order the calls start), its id, name and empty arguments, and each
`input_json_delta` an `arguments` fragment of it; thinking, signatures, citations and blocks of
other types go; `message_delta` gives the chunk with the `finish_reason` (and the matched stop
sequence as vLLM's `stop_reason`); `message_stop` gives the usage-only chunk (when the client
asked for `stream_options.include_usage`) and `data: [DONE]`; `ping` goes; `error` becomes
`data: {"error": {...}}` in OpenAI's shape. A stream with neither text nor tool calls sends
`content: ""` in its last chunk, as its whole answer has.

OpenAI -> Anthropic (`ChatToMessagesStream`): the first chunk gives `message_start` (id `msg_` +
the chunk's, its model, else the one given; usage 0 until the end); `content` (and `refusal`)
deltas go into a text block, opened when the first text comes; each tool call's first delta
opens a `tool_use` block (id, name, `input: {}`), its `arguments` fragments become
`input_json_delta`s; a block is closed (`content_block_stop`) when another opens or the choice
finishes, so indices grow by one per block. The `finish_reason` is held until `[DONE]`, since
the usage comes after it in its own chunk: then `message_delta` (stop reason, stop sequence,
usage) and `message_stop`. `reasoning_content` goes, and so do choices other than the first (a
translated request asks for one). vLLM's in-stream `data: {"error": ...}` becomes `event: error`
(and its `[DONE]` after it goes). Tool calls must come one after another, as OpenAI and vLLM send
them: a fragment of a call whose block was closed cannot be placed, and ends the stream with an
error event.

At EOF without the protocol's end (`finish`): an upstream that had finished its answer (a stop
reason given) gets the proper end written; one cut short ends with an error event, so the
client's SDK reports it. An event that is not JSON ends the stream with an error event too. An
unterminated last event (no blank line after it) is read as if it had one when it is whole (its
JSON complete), and left out when it was cut.
"""

from __future__ import annotations

import json
from typing import Any, Final

from gateway.core.sse import event_boundary, format_event, parse_event, split_events
from gateway.core.translate_answer import (
    anthropic_error,
    as_dict,
    as_int,
    as_str,
    chat_id,
    chat_usage,
    dumps,
    finish_reason,
    message_id,
    messages_usage,
    openai_error,
    read_error,
    stop_reason,
    tool_id,
)

DONE: Final = b"data: [DONE]\n\n"
_CUT: Final = "the upstream's stream ended before its end"
_UNREADABLE: Final = "the upstream sent an event that is not JSON"
_INTERLEAVED: Final = "the upstream interleaved its tool calls"


class _Events:
    """Complete SSE events out of bytes in any chunking, holding only the unfinished tail."""

    def __init__(self) -> None:
        self._tail = bytearray()

    def split(self, data: bytes) -> list[bytes]:
        # A blank line that ends in `data` starts at most 3 bytes before it (`\r\n\r\n`).
        start = max(0, len(self._tail) - 3)
        self._tail += data
        end = event_boundary(self._tail, start)
        if not end:
            return []
        complete = bytes(self._tail[:end])
        del self._tail[:end]
        return split_events(complete)

    def rest(self) -> bytes:
        """The unterminated last event, as a complete one (b"": none)."""
        rest = bytes(self._tail)
        self._tail.clear()
        return rest + b"\n\n" if rest.strip() else b""


def _object(data: str) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class _Translator:
    """What both directions share: the event loop, the end and the failure."""

    def __init__(self) -> None:
        self.ended = False  # the proper last event went out
        self.failed = False  # an error event went out: the stream is over
        self._events = _Events()

    def feed(self, data: bytes) -> bytes:
        """Upstream bytes in; the client's bytes out (maybe b"")."""
        if self.ended or self.failed:
            return b""  # nothing goes after the end, and nothing of it is kept
        out: list[bytes] = []
        for event in self._events.split(data):
            if self.ended or self.failed:
                break  # nothing goes after the end
            self._event(event, out)
        return b"".join(out)

    def finish(self) -> bytes:
        """At the upstream's EOF: what must still go out (b"" after a proper end)."""
        out: list[bytes] = []
        rest = self._events.rest()
        if rest and not (self.ended or self.failed):
            name, data = parse_event(rest)
            # An event whose end was cut off is not one: only a whole one counts.
            if data.strip() == "[DONE]" or _object(data) is not None:
                self._take(name, data, out)
        if not (self.ended or self.failed):
            self._eof(out)
        return b"".join(out)

    def _event(self, event: bytes, out: list[bytes]) -> None:
        name, data = parse_event(event)
        if data:
            self._take(name, data, out)

    def _take(self, name: str | None, data: str, out: list[bytes]) -> None:
        raise NotImplementedError

    def _eof(self, out: list[bytes]) -> None:
        raise NotImplementedError


class MessagesToChatStream(_Translator):
    """Anthropic SSE stream -> OpenAI chat.completion.chunk SSE stream."""

    def __init__(self, include_usage: bool, *, created: int = 0) -> None:
        """`include_usage`: the client asked for `stream_options.include_usage`; `created`: the
        chunks' time (the caller's clock, seconds)."""
        super().__init__()
        self.include_usage = include_usage
        self.created = created
        self._id = chat_id("")
        self._model = ""
        self._started = False  # the role's chunk went out
        self._blocks: dict[int, int | None] = {}  # block index -> its tool call's (None: text)
        self._calls = 0  # tool calls started
        self._content = False  # text or a tool call went out
        self._finish: str | None = None  # the finish reason sent
        self._usage: dict[str, Any] = {}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
        return self._data({"choices": [choice]})

    def _data(self, fields: dict[str, Any]) -> bytes:
        chunk = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self._model,
            **fields,
        }
        return b"data: " + dumps(chunk).encode() + b"\n\n"

    def _start(self, out: list[bytes]) -> None:
        if not self._started:
            self._started = True
            out.append(self._chunk({"role": "assistant", "content": None}))

    def _add_usage(self, usage: Any) -> None:
        # Cumulative counts: the last given wins (a null is no count).
        self._usage.update({k: v for k, v in as_dict(usage).items() if v is not None})

    def _take(self, name: str | None, data: str, out: list[bytes]) -> None:
        event = _object(data)
        if event is None:
            self._fail(None, _UNREADABLE, out)
            return
        kind = event.get("type", name)
        if name == "error" or kind == "error":
            detail = as_dict(event.get("error"))
            self._fail(as_str(detail.get("type")) or None, read_error(None, data)[2], out)
        elif kind == "message_start":
            message = as_dict(event.get("message"))
            self._id = chat_id(as_str(message.get("id")))
            self._model = as_str(message.get("model"))
            self._add_usage(message.get("usage"))
            self._start(out)
        elif kind == "content_block_start":
            self._block(as_int(event.get("index")), as_dict(event.get("content_block")), out)
        elif kind == "content_block_delta":
            self._delta(as_int(event.get("index")), as_dict(event.get("delta")), out)
        elif kind == "message_delta":
            self._add_usage(event.get("usage"))
            delta = as_dict(event.get("delta"))
            if delta.get("stop_reason") is not None:
                self._finished(delta, out)
        elif kind == "message_stop":
            self._end(out)
        # ping, content_block_stop and events of later versions: nothing to say

    def _block(self, index: int, block: dict[str, Any], out: list[bytes]) -> None:
        kind = block.get("type")
        if kind == "text":
            self._blocks[index] = None
            self._text(as_str(block.get("text")), out)
        elif kind == "tool_use":
            call = self._calls
            self._calls += 1
            self._blocks[index] = call
            tool_input = block.get("input")
            self._start(out)
            self._content = True
            entry = {
                "index": call,
                "id": as_str(block.get("id")),
                "type": "function",
                "function": {
                    "name": as_str(block.get("name")),
                    # A start that carries the whole input (no deltas follow then).
                    "arguments": dumps(tool_input) if tool_input else "",
                },
            }
            out.append(self._chunk({"tool_calls": [entry]}))

    def _text(self, text: str, out: list[bytes]) -> None:
        if text:
            self._start(out)
            self._content = True
            out.append(self._chunk({"content": text}))

    def _delta(self, index: int, delta: dict[str, Any], out: list[bytes]) -> None:
        kind = delta.get("type")
        if kind == "text_delta":
            if self._blocks.get(index, None) is None:
                self._text(as_str(delta.get("text")), out)
        elif kind == "input_json_delta":
            call = self._blocks.get(index)
            fragment = as_str(delta.get("partial_json"))
            if call is not None and fragment:
                entry = {"index": call, "function": {"arguments": fragment}}
                out.append(self._chunk({"tool_calls": [entry]}))
        # thinking, signature and citations deltas: dropped

    def _finished(self, delta: dict[str, Any], out: list[bytes]) -> None:
        if self._finish is not None:
            return
        self._start(out)
        reason = delta.get("stop_reason")
        self._finish = finish_reason(reason)
        extra = {}
        sequence = delta.get("stop_sequence")
        if reason == "stop_sequence" and isinstance(sequence, str):
            extra["stop_reason"] = sequence
        # An answer with nothing in it has "" as its content, as the whole answer has.
        last = {} if self._content else {"content": ""}
        out.append(self._chunk(last, self._finish, **extra))

    def _end(self, out: list[bytes]) -> None:
        self._finished({"stop_reason": "end_turn"}, out)
        if self.include_usage:
            out.append(self._data({"choices": [], "usage": chat_usage(self._usage)}))
        out.append(DONE)
        self.ended = True

    def _fail(self, kind: str | None, message: str, out: list[bytes]) -> None:
        out.append(b"data: " + dumps(openai_error(None, kind, message)).encode() + b"\n\n")
        self.failed = True

    def _eof(self, out: list[bytes]) -> None:
        if self._finish is not None:
            self._end(out)
        else:
            self._fail("api_error", _CUT, out)


class ChatToMessagesStream(_Translator):
    """OpenAI chunk SSE stream -> Anthropic SSE events."""

    def __init__(self, model: str) -> None:
        """`model`: the message's model when the upstream's chunks do not name one."""
        super().__init__()
        self.model = model
        self._id = ""
        self._started = False  # message_start went out
        self._next = 0  # the next block's index
        self._open: int | None = None  # the open block's index
        self._open_call: int | None = None  # ...the tool call it is (None: text)
        self._calls: dict[int, int] = {}  # a tool call's index -> its block's
        self._stop: tuple[str, str | None] | None = None
        self._usage: Any = None

    @staticmethod
    def _send(out: list[bytes], event: dict[str, Any]) -> None:
        out.append(format_event(dumps(event), event["type"]))

    def _start(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        if self._started:
            return
        self._started = True
        self._id = message_id(as_str(chunk.get("id")))
        model = chunk.get("model")
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": model if isinstance(model, str) and model else self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # What OpenAI says only at the end: the counts come with message_delta.
            "usage": messages_usage(chunk.get("usage")),
        }
        self._send(out, {"type": "message_start", "message": message})

    def _take(self, name: str | None, data: str, out: list[bytes]) -> None:
        if data.strip() == "[DONE]":
            self._end(out)
            return
        chunk = _object(data)
        if chunk is None:
            self._fail(None, None, None, _UNREADABLE, out)
            return
        if chunk.get("error") is not None:
            detail = as_dict(chunk["error"])
            code = as_int(detail.get("code"))  # vLLM's: the status
            status = code if 400 <= code <= 599 else None
            kind, text_code, message = read_error(None, data)
            self._fail(status, kind, text_code, message, out)
            return
        self._start(chunk, out)
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = as_dict(choice.get("delta"))
            for key in ("content", "refusal"):
                text = delta.get(key)
                if isinstance(text, str) and text:
                    self._text(text, out)
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                self._tool(as_dict(call), out)
                if self.failed:
                    return
            if choice.get("finish_reason") is not None:
                self._close(out)
                self._stop = stop_reason(choice["finish_reason"], choice.get("stop_reason"))

    def _open_block(self, block: dict[str, Any], call: int | None, out: list[bytes]) -> int:
        self._close(out)
        index = self._open = self._next
        self._open_call = call
        self._next += 1
        self._send(out, {"type": "content_block_start", "index": index, "content_block": block})
        return index

    def _close(self, out: list[bytes]) -> None:
        if self._open is not None:
            self._send(out, {"type": "content_block_stop", "index": self._open})
            self._open = None

    def _text(self, text: str, out: list[bytes]) -> None:
        if self._open is None or self._open_call is not None:
            self._open_block({"type": "text", "text": ""}, None, out)
        delta = {"type": "text_delta", "text": text}
        self._send(out, {"type": "content_block_delta", "index": self._open, "delta": delta})

    def _tool(self, call: dict[str, Any], out: list[bytes]) -> None:
        number = call.get("index", 0)
        if not isinstance(number, int):
            number = 0
        function = as_dict(call.get("function"))
        block = self._calls.get(number)
        if block is None:
            ident = tool_id(call.get("id")) or tool_id(f"toolu_{self._id}_{number}")
            start = {"type": "tool_use", "id": ident, "name": as_str(function.get("name"))}
            block = self._calls[number] = self._open_block({**start, "input": {}}, number, out)
        elif block != self._open:
            self._fail(None, "api_error", None, _INTERLEAVED, out)
            return
        fragment = function.get("arguments")
        if isinstance(fragment, str) and fragment:
            delta = {"type": "input_json_delta", "partial_json": fragment}
            self._send(out, {"type": "content_block_delta", "index": block, "delta": delta})

    def _end(self, out: list[bytes]) -> None:
        self._start({}, out)
        self._close(out)
        reason, sequence = self._stop or ("end_turn", None)
        self._send(
            out,
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": messages_usage(self._usage),
            },
        )
        self._send(out, {"type": "message_stop"})
        self.ended = True

    def _fail(
        self, status: int | None, kind: str | None, code: str | None, message: str, out: list[bytes]
    ) -> None:
        out.append(format_event(dumps(anthropic_error(status, kind, code, message)), "error"))
        self.failed = True

    def _eof(self, out: list[bytes]) -> None:
        if self._stop is not None:
            self._end(out)
        else:
            self._fail(None, "api_error", None, _CUT, out)
