"""A streamed body's pieces written to the client from the upstream connection's callback.

An SSE stream is relayed a piece at a time, and most pieces are one whole event. Through ASGI,
each took a wake-up of the request's task (a future resolved, the task scheduled, five frames
resumed) and a `send` call building a message dict, for one `write` on the client's socket;
that was most of the Python time a relayed piece cost. `relay` now hands the pieces that need no
more than a write (`ingress.relay._Tap`) straight to a `BodyWriter` from the upstream
connection's callback (`upstream.h1_connection.H1Connection.pump`), and the rest go the ASGI way
as before.

`HardenedProtocol` makes one writer per client connection and puts it in each request's scope
under `CLIENT_TRANSPORT` (an ASGI server extension), where `client_writer` finds it: a
connection's responses follow one another, and a response's pieces are flushed before
anything else is sent on it. The writer
frames each piece as uvicorn frames a body sent with no Content-Length (HTTP/1.1 chunked, what
an SSE stream's headers lead it to: `tests/test_library_internals.py` checks it), so the pieces
written here and the ones uvicorn writes (the head, the first piece, the last) make one body.
It writes only while the client takes everything at once: with bytes waiting in the
transport's buffer (a client slow to read), or the connection closing, a piece goes the ASGI
way, where uvicorn waits for the buffer to drain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Final, Protocol, cast

# The scope's `extensions` entry HardenedProtocol sets (ASGI's form: a dict per extension):
# `{"writer": the client connection's ChunkedWriter}`.
CLIENT_TRANSPORT: Final = "gateway.client_transport"


class BodyWriter(Protocol):
    """Where `relay` may write a response's pieces without an ASGI `send`. What it was given
    must be `flush`ed before anything goes through `send` again."""

    def writable(self) -> bool:
        """Whether a piece written now goes out at once (else it goes through `send`)."""
        ...

    def write(self, body: bytes) -> None: ...

    def flush(self) -> None: ...


class ChunkedWriter:
    """A response's pieces, framed as HTTP/1.1 chunks, written to the client's transport.

    The pieces written during one turn of the event loop go out in one write at its end (a
    callback queued at the first): a socket write costs more than the rest of a piece's way,
    and an engine sends the events of a batch step together, which the reads of one turn
    hold. The relay's task, when it used to write each piece, coalesced them the same way."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def writable(self) -> bool:
        transport = self._transport
        return not transport.is_closing() and transport.get_write_buffer_size() == 0

    def write(self, body: bytes) -> None:
        pending = self._pending
        if not pending:
            self._loop.call_soon(self.flush)
        pending.append(body)

    def flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        body = pending[0] if len(pending) == 1 else b"".join(pending)
        self._pending = []  # a new list rather than a `clear()` call: one call less per piece
        transport = self._transport
        if not transport.is_closing():  # else the client is gone, and these with it
            transport.write(b"%x\r\n%b\r\n" % (len(body), body))


def client_writer(scope: Mapping[str, Any]) -> ChunkedWriter | None:
    """The writer of this request's response, when its server put its connection's in its
    scope (None: an ASGI server of another kind, or a HEAD request, which has no body)."""
    extensions = scope.get("extensions")
    if not extensions or scope.get("method") == "HEAD":
        return None
    entry = extensions.get(CLIENT_TRANSPORT)
    return None if entry is None else cast(ChunkedWriter, entry["writer"])
