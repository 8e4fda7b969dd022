"""Continuing a stream on another attempt: what every protocol shares.

A streamed answer that breaks after its first byte can be continued: the text the client has
received is a prefix the next attempt extends (`continuation_openai`,
`continuation_anthropic`). Each protocol gives a `Transcript` of what the client received and
a `Rewriter` that turns the next attempt's events into the rest of the same stream.

Happy-path cost: the relay hands each forwarded chunk to `Transcript.keep`. The first
`KEEP_RAW` bytes of a stream are kept by reference (most streams are short); past them, the
stream's bytes go through a small zlib compressor `PACK_BATCH` bytes at a time (level 1, a 4 KiB
window: under a microsecond a chunk, and SSE events shrink 10 to 30 times, their JSON repeating
itself). The events are parsed only when a resume needs them (`fold`). A stream whose kept
bytes pass `max_bytes` (compressed; checked at each batch) is simply not resumable any more,
and keeps nothing.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Final, Literal

from gateway.core.sse import split_events

EchoMode = Literal["auto", "never", "always"]
# Bytes of a stream kept as they are before the rest is kept compressed.
KEEP_RAW: Final = 16 * 1024
# Past it, raw bytes gathered before each call of the compressor.
PACK_BATCH: Final = 4 * 1024
# The compressor's window (2^12 bytes) and memory level: about 20 KiB of state per stream
# past KEEP_RAW, where the default (32 KiB window, level 8) takes 256 KiB.
_WBITS: Final = 12
_MEM_LEVEL: Final = 3


class UnreadableEvent(ValueError):
    """A continuation's event that is not the protocol's: the attempt is broken."""


class NotResumable(Exception):
    """Why a stream cannot be continued (its message is the reason, a short label)."""


class Transcript:
    """What the client received of one stream, enough to continue it elsewhere.

    Subclasses parse events (`absorb`) and build the next attempt's request."""

    def __init__(self, request: dict[str, Any], max_bytes: int, echo: EchoMode) -> None:
        self.request = request
        self.max_bytes = max_bytes
        self.echo: EchoMode = echo
        self._kept: list[bytes] = []  # raw chunks, then compressed pieces
        self._kept_bytes = 0
        self._packer: Any = None  # the stream's compressor, once past KEEP_RAW
        self._batch: list[bytes] = []  # raw chunks past KEEP_RAW not compressed yet
        self._batch_bytes = 0
        self._text_bytes = 0
        self.text: list[str] = []
        self.text_events = 0  # events that carried text: the tokens delivered, one per event
        self.overflow = False  # past max_bytes: not resumable any more
        self.unreadable = False  # an event could not be parsed: not resumable

    def keep(self, chunk: bytes) -> None:
        """A chunk of complete events sent to the client (the happy path)."""
        if self._packer is None:
            if self.overflow:
                return
            self._kept.append(chunk)
            self._kept_bytes += len(chunk)
            if self._kept_bytes > KEEP_RAW:
                self._pack()
            return
        # Compressed a batch at a time: a model's event is a few hundred bytes, and one call
        # of the compressor per event cost as much as the rest of the relay's work on it.
        self._batch.append(chunk)
        self._batch_bytes += len(chunk)
        if self._batch_bytes >= PACK_BATCH:
            self._pack_batch()

    def _pack(self) -> None:
        """From here on the stream's bytes are kept compressed."""
        raw, self._kept = self._kept, []
        self._packer = packer = zlib.compressobj(1, zlib.DEFLATED, -_WBITS, _MEM_LEVEL)
        packed = packer.compress(b"".join(raw))
        self._kept_bytes = len(packed)
        if packed:
            self._kept.append(packed)

    def _pack_batch(self) -> None:
        batch, self._batch = self._batch, []
        self._batch_bytes = 0
        packed = self._packer.compress(b"".join(batch))
        if packed:
            self._kept.append(packed)
            self._kept_bytes += len(packed)
            if self._kept_bytes > self.max_bytes:
                self._drop()

    def _drop(self) -> None:
        """Past `max_bytes`: not resumable, nothing kept."""
        self.overflow = True
        self._kept = []
        self._packer = None
        self._batch = []
        self._batch_bytes = 0
        self.text = []

    def fold(self) -> None:
        """Parse the kept events into the state and let them go."""
        if self._batch:
            self._pack_batch()  # the last batch, held to `max_bytes` like the others
        kept, self._kept = self._kept, []
        self._kept_bytes = 0
        packer, self._packer = self._packer, None
        if self.overflow:
            return
        if packer is not None:
            kept.append(packer.flush(zlib.Z_SYNC_FLUSH))
            data = zlib.decompressobj(-_WBITS).decompress(b"".join(kept))
        else:
            data = b"".join(kept)
        for event in split_events(data):
            try:
                self.absorb(event)
            except (ValueError, TypeError, KeyError, AttributeError):
                self.unreadable = True
        if self._text_bytes > self.max_bytes:
            self._drop()

    def add_text(self, text: str) -> None:
        self.text.append(text)
        self.text_events += 1
        self._text_bytes += len(text)

    def snapshot(self) -> dict[str, Any]:
        """The state as it is, for `restore` when a chunk turns out unreadable half-way."""
        saved = dict(vars(self))
        saved["text"] = list(self.text)
        return saved

    def restore(self, saved: dict[str, Any]) -> None:
        vars(self).update(saved)

    @property
    def delivered_text(self) -> str:
        return "".join(self.text)

    def absorb(self, event: bytes) -> None:
        """Take one client-visible event into the state."""
        raise NotImplementedError

    def why_not(self) -> str | None:
        """After `fold`: why this stream cannot be continued, None when it can."""
        if self.overflow:
            return "too_long"
        if self.unreadable:
            return "unreadable"
        return None

    def finishing(self) -> bytes | None:
        """After `fold`: when the generation already ended (only the stream's last events were
        lost), the bytes that end the stream properly; None when there is more to generate."""
        raise NotImplementedError

    def continuation(self) -> tuple[bytes, Rewriter]:
        """After `fold`: the next attempt's request body and the rewriter of its events.
        Raises NotResumable."""
        raise NotImplementedError


class Splice:
    """Joins a continuation's text to what the client already has.

    `echo`: the prefix the request sent, when the engine may stream it again before the
    continuation (llama.cpp's Anthropic-format prefill does): it is then dropped. In `auto`
    mode the text is held while it could still be that echo, and released as soon as it is
    not (a continuation that truly starts by repeating the whole prefix would lose that
    repetition: rare past a few words, and why `auto` applies to the Messages route only).
    `owed`: whitespace the client received but the request could not carry (Anthropic
    rejects a prefill ending in whitespace); the continuation's own leading whitespace is
    matched against it so it is not delivered twice."""

    __slots__ = ("_echo", "_held", "_owed")

    def __init__(self, echo: str, mode: EchoMode, owed: str = "") -> None:
        self._echo = echo if echo and mode != "never" else ""
        self._held = ""
        self._owed = owed

    def feed(self, text: str) -> str:
        """The part of `text` to deliver now."""
        if self._echo:
            self._held += text
            echo = self._echo
            held = self._held
            if len(held) < len(echo) and echo.startswith(held):
                return ""  # could still be the echo
            self._echo = ""
            self._held = ""
            # Not the prefix after all (even where the engine is said to echo): delivered
            # unchanged rather than cut text the client never had.
            text = held[len(echo) :] if held.startswith(echo) else held
        if self._owed and text:
            owed = self._owed
            matched = 0
            while matched < len(owed) and matched < len(text) and text[matched] == owed[matched]:
                matched += 1
            if matched == len(text) and matched < len(owed):
                self._owed = owed[matched:]  # all of it was owed; more may follow
                return ""
            self._owed = ""
            text = text[matched:]
        return text

    def flush(self) -> str:
        """At the end of the text (a finish, another block): whatever is still held."""
        held, self._held, self._echo = self._held, "", ""
        return self.feed(held) if held else ""


class Rewriter:
    """Turns a continuation's events into the rest of the client's stream."""

    def rewrite(self, events: bytes) -> bytes:
        """Complete events of the continuation in, the client's events out (maybe none)."""
        raise NotImplementedError


def read_object(data: str) -> dict[str, Any]:
    """An event's JSON object; UnreadableEvent for anything else."""
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise UnreadableEvent(str(exc)) from exc
    if not isinstance(value, dict):
        raise UnreadableEvent("an event's data is not a JSON object")
    return value


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
