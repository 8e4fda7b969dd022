"""Incremental reading of a server-sent-event stream, as its bytes arrive in arbitrary chunks.

Only what the ledger needs is kept: the number of `data:` events, whether the last one was
`[DONE]`, and whether one carried an error object (and mentioned running out of memory).

`AnthropicSseScanner` reads a Messages API stream (`event: NAME` + `data: JSON`): there `done`
means the last event so far was `message_stop`, and an error is an `event: error`.
"""

from __future__ import annotations

DONE = b"[DONE]"


class SseScanner:
    __slots__ = ("_tail", "done", "error_event", "events", "oom")

    def __init__(self) -> None:
        self._tail = b""
        self.events = 0  # events with at least one `data:` line
        self.done = False  # the last data event so far was `[DONE]`
        self.error_event = False  # some event's data was an `{"error": ...}` object
        self.oom = False  # ... that mentioned "out of memory"

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk if self._tail else chunk
        if b"\r" in data:
            if data.endswith(b"\r"):  # a CRLF may be split across chunks: wait for the rest
                self._tail = data
                return
            data = data.replace(b"\r\n", b"\n")
        if b"\n\n" not in data:
            self._tail = data
            return
        parts = data.split(b"\n\n")
        self._tail = parts.pop()
        for event in parts:
            self._event(event)

    def finish(self) -> None:
        """The stream ended: an unterminated last event still counts."""
        tail, self._tail = self._tail.replace(b"\r\n", b"\n").strip(), b""
        if tail:
            self._event(tail)

    def _event(self, event: bytes) -> None:
        if event.startswith(b"data:") and b"\n" not in event:
            payload = event[5:]  # the common case: one data line
        else:
            lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                return  # a comment, or an event without data
            payload = b"\n".join(lines)
        payload = payload.strip()
        self.events += 1
        self.done = payload == DONE
        if payload[:1] == b"{" and payload[1:].lstrip().startswith(b'"error"'):
            self.error_event = True
            if b"out of memory" in payload.lower():
                self.oom = True


MESSAGE_STOP = b"message_stop"
ERROR = b"error"


class AnthropicSseScanner(SseScanner):
    """The same counts for an Anthropic Messages stream: `events` counts every event with data
    (message_start, ping, deltas, ..., as `events` counts every `data:` event of an OpenAI
    stream), `done` is "the last one was `message_stop`", `error_event` "an `event: error`
    came" (by its name, or a `"type":"error"` payload without one)."""

    __slots__ = ()

    def _event(self, event: bytes) -> None:
        name = b""
        lines = []
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                lines.append(line[5:])
            elif line.startswith(b"event:"):
                name = line[6:].strip()
        if not lines:
            return  # a comment, or an event without data
        payload = b"\n".join(lines).strip()
        self.events += 1
        self.done = name == MESSAGE_STOP
        if name == ERROR or (not name and b'"type":"error"' in payload):
            self.error_event = True
            if b"out of memory" in payload.lower():
                self.oom = True
