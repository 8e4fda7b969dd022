"""A connection of the data plane's HTTP/1.1 client (`upstream.h1`) as a request uses it: the
request written, its response's head awaited, the body read (or pumped), then the connection
back to its pool or closed; and `UpstreamResponseHead`, what the client hands over.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Final, cast, overload

from gateway.core.outcome import Phase
from gateway.errors import UpstreamReset
from gateway.upstream.h1_protocol import ResponseProtocol

_RESET: Final = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST


class Headers:
    """A response's headers: the raw pairs in order, and a case-insensitive `get`."""

    __slots__ = ("_by_name", "raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        by_name: dict[str, str] = {}
        for name, value in raw:
            # Values without the whitespace around them (RFC 9110 5.5): `Content-Length: 5 `.
            by_name.setdefault(name.decode("latin-1").lower(), value.decode("latin-1").strip())
        self._by_name = by_name

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...
    def get(self, name: str, default: str | None = None) -> str | None:
        return self._by_name.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._by_name


class H1Connection(ResponseProtocol):
    """One connection to an origin; at most one request in flight on it. How its bytes are
    read is `ResponseProtocol`'s."""

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # One poll set per connection: asked before each reuse (`pending`).
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def usable(self, now: float) -> bool:
        """Open, not closing, not past its idle time, and nothing waiting unread."""
        transport = self.transport
        return (
            transport is not None
            and not transport.is_closing()
            and now < self.idle_until
            and not self.pending()
        )

    def pending(self) -> bool:
        """Whether bytes (or the end) wait unread in the kernel for this idle connection: the
        rest of an answer longer than it said, a backend closing it. The event loop would
        hand them over on its next turn, too late if a request went out on it first."""
        poll = self._poll
        return poll is not None and bool(poll.poll(0))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._pool.forget(self)
        try:
            if self.complete or self._head is None:
                return  # idle, or its response was whole: nothing lost
            if self._until_close and self._head.done() and exc is None and self._eof:
                self.on_message_complete()
                return
            phase = Phase.BODY if self._head.done() else Phase.FIRST_BYTE
            error = UpstreamReset(f"the upstream closed the connection ({phase})")
            self._fail(error, close=False)
        finally:
            self._parser = None

    def eof_received(self) -> None:
        """The stream ended: over TCP a FIN, over TLS either a close_notify or a cut without
        one. asyncio and uvloop report both TLS ends here alike, yet only the first is an
        orderly end: an attacker (or a crash) can cut a body framed by the connection's end
        with a bare FIN, and that body is then not whole (RFC 8446 6.1)."""
        self._eof = self._ended_in_order()

    def _ended_in_order(self) -> bool:
        transport = self.transport
        tls = transport.get_extra_info("ssl_object") if transport is not None else None
        if not isinstance(tls, ssl.SSLObject):
            return True  # plain TCP: the FIN is the end
        # The TLS layer has read all it had by now. Once the peer's close_notify is in, OpenSSL
        # answers a read with b"" (the end, recorded); after a bare FIN it has nothing yet and
        # asks for more bytes (SSLWantReadError).
        try:
            return tls.read(1) == b""
        except ssl.SSLError:
            return False

    def pause_writing(self) -> None:
        """The request body is written in one call; a full send buffer only delays it."""

    def resume_writing(self) -> None:
        pass

    # -- the request --------------------------------------------------------------------------

    async def exchange(self, request: bytes) -> UpstreamResponseHead:
        """Write the request; wait for the response's status and headers."""
        transport = self.transport
        if transport is None or transport.is_closing():  # closed while it was handed over
            raise UpstreamReset("the upstream closed the connection (first_byte)")
        self._head = self._loop.create_future()
        transport.write(request)
        await self._head
        if self.error is not None and not self.complete:
            raise self.error
        return UpstreamResponseHead(self)

    @property
    def status(self) -> int:
        return self._status

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return self._raw_headers

    async def read_chunk(self) -> bytes:
        """What arrived of the body since the last call (waiting for something), b"" at its
        end; raises the error that broke the connection."""
        while not self._chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()
        return self._take()

    async def pump(self, tap: Callable[[bytes], bool]) -> bytes | None:
        """`read_chunk`, while `tap` is handed each piece of the body as it arrives, from the
        connection's callback: what it takes (True) is gone; the first piece it declines, and
        what follows, is what this returns, as `read_chunk` would (so are pieces that arrived
        before the call, b"" at the end, and the connection's error, raised). After `tap`
        called `stop_pump`: None, or what arrived after that before the reader woke. A piece
        relayed from the callback costs no wake-up of the reader's task, which cost more than
        the rest of its way to the client."""
        self._tap = tap  # handed nothing while pieces wait unread (`on_body`)
        try:
            while not self._chunks:
                if self.complete:
                    return b""
                if self.error is not None:
                    raise self.error
                if self._tapped_out:
                    return None
                await self._wait()
        finally:
            self._tap = None
            self._tapped_out = False
        return self._take()

    def stop_pump(self) -> None:
        """From a `pump`'s tap: take nothing more, and hand the reader back its task."""
        self._tap = None
        self._tapped_out = True
        self._wake_reader()

    async def _wait(self) -> None:
        self._wake = self._loop.create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    # -- after the response -------------------------------------------------------------------

    def reusable(self) -> bool:
        """The response arrived whole, the upstream keeps the connection, and all of our
        request left (an upstream answering early must not find the rest of a body at the
        start of the next request)."""
        transport = self.transport
        return (
            self.complete
            and self.keep_alive
            and self.error is None
            and transport is not None
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0
        )

    def reset_for_reuse(self) -> None:
        self.received = False
        self.keepalive_hint = None
        self._raw_headers = []
        self._status = 0
        self._head_done = False
        self._head_bytes = 0
        self._framing = 0
        self._head = None
        self._chunks.clear()
        self._buffered = 0
        if self._paused:  # the body ended unread (the client left): read, to see it close
            self._paused = False
            if self.transport is not None:
                self.transport.resume_reading()
        self.complete = False
        self.keep_alive = False
        self._until_close = False

    def close(self) -> None:
        """Done with it: a FIN after an answer that ended whole with nothing left to send, else
        an abort (an RST: no unsent bytes linger, no half-open socket stays behind)."""
        self._pool.forget(self)  # at once: its pool no longer counts it
        # Its error was raised to a reader, whose frames (holding this connection) its
        # traceback keeps: a cycle only the collector would free.
        self.error = None
        transport = self.transport
        if transport is None:
            return
        if (self.idle or self.complete) and transport.get_write_buffer_size() == 0:
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                # Linger on with a timeout of 0: what the kernel still holds is dropped too.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        transport.abort()


class UpstreamResponseHead:
    """A response whose status and headers arrived; its body is read through it. `release()`
    must be called once: the connection goes back to its pool when the response was whole
    and the connection may be kept, else it is closed."""

    __slots__ = ("_conn", "content_length", "headers", "raw_headers", "status")

    def __init__(self, conn: H1Connection) -> None:
        self._conn: H1Connection | None = conn
        self.status = conn.status
        self.raw_headers = conn.raw_headers
        self.headers = Headers(conn.raw_headers)
        length = self.headers.get("content-length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        # Copied: the connection's list is its own, and reset when it is reused.
        self.raw_headers = list(conn.raw_headers)

    @property
    def connection(self) -> object | None:
        """The connection while the body has not been read to its end; else None."""
        conn = self._conn
        return None if conn is None or conn.complete else conn

    async def readany(self) -> bytes:
        conn = self._conn
        if conn is None:
            return b""
        return await conn.read_chunk()

    async def pump(self, tap: Callable[[bytes], bool]) -> bytes | None:
        """`readany`, with the pieces that arrive meanwhile handed to `tap`
        (`H1Connection.pump`)."""
        conn = self._conn
        if conn is None:
            return b""
        return await conn.pump(tap)

    def stop_pump(self) -> None:
        conn = self._conn
        if conn is not None:
            conn.stop_pump()

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with the response: reuse the connection if it can be, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable():
            conn._pool.put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Give up on the response: the connection is closed (unless it was whole)."""
        conn = self._conn
        if conn is not None and not conn.complete:
            self._conn = None
            conn.close()
        else:
            self.release()
