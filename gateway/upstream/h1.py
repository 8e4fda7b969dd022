"""The data plane's HTTP/1.1 client: one request at a time per connection, kept-alive
connections pooled per origin, responses parsed by httptools.

Written for this one job rather than taken from a general client: measured here, a bare
ASGI proxy did ~7,000 req/s per core through aiohttp's client and ~23,000 through a client
this small (the backend was then the limit), while streams cost the same per chunk. What it
does, and no more:

- `POST` with a body held in memory, head and body written in one call;
- responses framed by Content-Length, chunked, or the connection's end; read whole or chunk
  by chunk as they arrive (reading pauses above `_HIGH_WATER` bytes not yet taken);
- exactly one response per request: the status and headers are taken when the head is
  complete; bytes after the response's end (a second message, a body longer than its
  Content-Length, a stray byte) are never parsed into it and taint the connection, which is
  then closed, never pooled; trailers are dropped; only `chunked` as the final transfer coding
  is read; a head beyond `MAX_HEAD_BYTES` or `MAX_HEAD_FIELDS`, a status outside 100-599, a
  header name with whitespace before its colon, or a body on a 1xx answer is a protocol error;
- connections reused only after a complete response that allows it, and dropped after
  `keepalive_s` idle (or a second less than the backend's `Keep-Alive: timeout=`), before the
  backend drops them. An idle connection the backend closes leaves the pool by itself. When a
  backend closes an idle connection just as a request is written into it, the request fails
  before any byte of an answer: sent again once on a fresh connection (as nginx, aiohttp and
  Envoy do), it never reached the backend's application, which saw a connection close and no
  request;
- at most `max_connections` open connections per origin (a request beyond waits for one to
  come free, within `connect_s`, then fails as `UpstreamConnectionLimit`), and at most
  `max_idle` of them kept idle;
- a connection given up on (cancelled, broken, an answer cut short) is aborted, not closed:
  no unsent request bytes linger in a half-open socket, and the backend sees it go at once;
- TLS with a per-pool context, SNI from the URL's host, ALPN `http/1.1`;
- one bound of its own: `connect_s` for DNS, TCP and the TLS handshake of a new connection.
  Every later phase is bounded by the caller (the gateway's watchdog cancels the task).

Errors are the gateway's own `UpstreamError`s: a connection that cannot be made is
`UpstreamConnectError`, a connection that ends before the response does is `UpstreamReset`,
bytes that are not HTTP are `UpstreamProtocolError`, and the connect bound `UpstreamTimeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import select
import socket
import ssl
import struct
from collections import deque
from collections.abc import Callable
from typing import Any, Final, NamedTuple, cast, overload

import httptools
from yarl import URL

from gateway.core.outcome import Phase
from gateway.errors import (
    UpstreamConnectError,
    UpstreamConnectionLimit,
    UpstreamProtocolError,
    UpstreamReset,
    UpstreamTimeout,
)

# Above this many bytes received but not yet taken by the relay, stop reading the socket (until
# the relay takes them): a slow client must not make the gateway buffer a fast backend's whole
# answer.
_HIGH_WATER: Final = 256 * 1024

# Distinct instance URLs remembered with their request-line parts; past it, forgotten at once.
_MAX_TARGETS: Final = 4096

# A response head larger than this, or with more fields, is refused (nginx's default for a
# proxied head is 4-8 KiB; Envoy's 60 KiB and 100 headers). Bounded, the parser's cost for a
# header value arriving in pieces (quadratic in its size) stays small.
MAX_HEAD_BYTES: Final = 64 * 1024
MAX_HEAD_FIELDS: Final = 100


_WHITESPACE: Final = b" \t"

# A pooled connection leaves the pool this long before the backend's announced keep-alive
# timeout ends, so that a request is not written into it as the backend closes it.
_HINT_MARGIN_S: Final = 1.0

# A reused connection that ends before any byte of an answer this soon after the request was
# written is taken for one the backend was closing as the request arrived (see the module's
# docstring); later, the backend may have been working on it, and sending it again is not ours
# to decide (the retry policy decides, with its budget).
_STALE_WINDOW_S: Final = 0.1

_RESET: Final = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST

# How long a host's resolved addresses are reused for new connections (aiohttp's default).
_DNS_TTL_S: Final = 10.0
# The Retry-After of a request refused for want of a connection: one frees as soon as a
# request in flight there ends, so the client is told to come back soon.
CONNECTION_LIMIT_RETRY_AFTER_S: Final = 1.0


class _Extra(Exception):
    """Raised from the parser's callbacks: bytes after the response's end."""


# scheme, host, port, id of the TLS context (0: none), max connections, max idle
Origin = tuple[str, str, int, int, int | None, int | None]
# URL, id of the TLS setting, max connections, max idle
_TargetKey = tuple[URL, int, int | None, int | None]
# scheme, host, port: what the connection counters are kept by
Address = tuple[str, str, int]


class ConnectionCounts:
    """What happened to the connections to one address since the client started, over every
    pool it had there (a reload's new TLS context or limits gets new pools, not new counts)."""

    __slots__ = ("opened", "refused", "resent", "reused", "waited")

    def __init__(self) -> None:
        self.opened = 0  # connections established (TCP, and TLS when it is https)
        self.reused = 0  # requests written into a connection kept from an earlier one
        self.resent = 0  # requests sent again afresh after the stale keep-alive race
        self.waited = 0  # requests that queued because `max_connections` were busy
        self.refused = 0  # of those, the ones no connection came free for in time (503)


class ConnectionUse(NamedTuple):
    """The connections to one address now: serving a request, idle, being opened."""

    busy: int
    idle: int
    opening: int


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


class _Connection(asyncio.Protocol):
    """One connection to an origin; at most one request in flight on it."""

    def __init__(self, pool: _OriginPool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        # It holds this connection's callbacks, and so this connection: dropped when the
        # connection is lost, or the two would be a cycle only the collector frees.
        parser = httptools.HttpResponseParser(self)
        # A header value with a control character is dropped on the way to the client
        # (`response_headers`), not a reason to fail the whole answer.
        parser.set_dangerous_leniencies(lenient_headers=True)
        self._parser: httptools.HttpResponseParser | None = parser
        # The response being read.
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._status = 0  # of the head being read, or read
        self._head_done = False  # the final (not 1xx) head is complete: headers are fixed
        self._head_bytes = 0  # received while the head was incomplete
        self._read_size = 0  # of the read being parsed (one read may hold a whole large head)
        # Bytes after the head that are not body since the last chunk began: a chunk's size
        # line and, after the last one, the trailers (bounded like a head).
        self._framing = 0
        self._head: asyncio.Future[None] | None = None  # resolved once its headers are in
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._wake: asyncio.Future[None] | None = None  # a reader waiting for body bytes
        # While a reader pumps (`pump`): takes the body's pieces as they arrive, in place of
        # the reader, until it declines one; `_tapped_out` once it asked the reader back.
        self._tap: Callable[[bytes], bool] | None = None
        self._tapped_out = False
        self.complete = False  # the whole response arrived
        self.keep_alive = False  # and the connection may carry another request
        self._until_close = False  # no Content-Length, not chunked: it ends with the connection
        self._eof = False  # the upstream ended the connection in order (see eof_received)
        self.error: Exception | None = None  # the connection broke (or the bytes made no sense)
        self.received = False  # any byte of an answer to the request out
        self.idle_until = 0.0  # pooled: reusable until then (event-loop time)
        self.idle = False  # in its pool, between requests
        self.keepalive_hint: float | None = None  # the backend's `Keep-Alive: timeout=`
        self._poll: select.poll | None = None

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

    def data_received(self, data: bytes) -> None:
        if self._head is None:  # bytes while no request is out: nothing can be trusted here
            self._fail(UpstreamProtocolError("the upstream sent bytes nobody asked for"))
            return
        if self.complete:  # after the response's end: not part of it, and not for the next
            self._taint()
            return
        self.received = True
        self._read_size = len(data)
        head_done = self._head_done
        if head_done:
            self._framing += len(data)
        else:
            self._head_bytes += len(data)
        parser = self._parser
        if parser is None:  # lost: nothing more is read
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("the upstream switched protocols"))
            return
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Extra):
                self._taint()
            elif isinstance(cause, UpstreamProtocolError):
                self._fail(cause)
            else:
                self._fail(UpstreamProtocolError("the upstream's response could not be read"))
            return
        except httptools.HttpParserError:
            if self.complete:  # garbage after a whole answer: the answer stands
                self._taint()
                return
            # Not the parser's message: it can quote raw upstream bytes back to the client.
            self._fail(UpstreamProtocolError("the upstream sent an invalid HTTP response"))
            return
        if not head_done and not self._head_done and self._head_bytes > MAX_HEAD_BYTES:
            self._fail(UpstreamProtocolError("the upstream's response head is too large"))
        elif self._framing > MAX_HEAD_BYTES:
            self._fail(UpstreamProtocolError("the upstream's chunk framing is too large"))

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

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise _Extra  # a second message in the same read: the parser stops here

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_done:
            return  # a trailer: dropped (the client's headers were sent long ago)
        if not name or name[-1] in _WHITESPACE:
            # RFC 9112 5.1: never guess which field `Content-Length :` meant to be.
            raise UpstreamProtocolError("the upstream sent a header name with whitespace")
        self._raw_headers.append((name, value))  # how many: counted once the head is in

    def on_headers_complete(self) -> None:
        assert self._parser is not None  # called back from its `feed_data`
        status = self._parser.get_status_code()
        if not 100 <= status <= 599:
            raise UpstreamProtocolError("the upstream sent an invalid status code")
        if len(self._raw_headers) > MAX_HEAD_FIELDS:
            raise UpstreamProtocolError("the upstream's response head has too many fields")
        # A head that grew past the cap over several reads failed in `data_received`; one
        # that came whole in a large read is measured here (only then: the common head is
        # far smaller than the cap).
        if self._head_bytes + self._read_size > MAX_HEAD_BYTES:
            size = sum(len(name) + len(value) + 4 for name, value in self._raw_headers)
            if size > MAX_HEAD_BYTES:  # 4: ": " and CRLF
                raise UpstreamProtocolError("the upstream's response head is too large")
        self._status = status
        if status < 200:
            self._raw_headers = []  # an interim answer (100 Continue): the real one follows
            return
        length = False
        codings: list[bytes] = []
        for name, value in self._raw_headers:
            lower = name.lower()
            if lower == b"content-length":
                length = True
            elif lower == b"transfer-encoding":
                codings.extend(c.strip() for c in value.lower().split(b",") if c.strip())
            elif lower == b"keep-alive":
                self.keepalive_hint = _keepalive_timeout(value)
        if codings and (codings[-1] != b"chunked" or b"chunked" in codings[:-1]):
            # RFC 9112 6.1: chunked must come last, once; anything else cannot be framed.
            raise UpstreamProtocolError("the upstream sent a transfer coding it cannot frame")
        self._until_close = not (length or codings) and status not in (204, 304)
        self._head_done = True
        head = self._head
        if head is not None and not head.done():
            head.set_result(None)

    def on_chunk_header(self) -> None:
        self._framing = 0

    def on_body(self, body: bytes) -> None:
        if not self._head_done:
            raise UpstreamProtocolError("the upstream sent a body with an interim answer")
        self._framing -= len(body)
        tap = self._tap
        if tap is not None and not self._chunks:
            if tap(body):
                return
            self._tap = None  # declined: this piece and the rest go to the reader
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def on_message_complete(self) -> None:
        if not self._head_done:
            # An interim answer ended: the final head is yet to come.
            self._head_bytes = 0
            return
        # Asked now: once the message is complete the parser readies for the next one.
        parser = self._parser
        self.keep_alive = (
            parser is not None and parser.should_keep_alive() and not self._until_close
        )
        self.complete = True
        head = self._head
        if head is not None and not head.done():  # a response with no body: headers done too
            head.set_result(None)
        self._wake_reader()

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

    def _wake_reader(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _taint(self) -> None:
        """Bytes after the response's end: the response stays as it was (whole, its bytes
        already taken in); the connection can be trusted with nothing more and is closed."""
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, error: Exception, close: bool = True) -> None:
        if self.error is None:
            self.error = error
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_exception(error)
        if close and self.transport is not None:
            self.transport.close()

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

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
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
        """`readany`, with the pieces that arrive meanwhile handed to `tap` (`_Connection.pump`)."""
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


class _OriginPool:
    """Connections to one origin: the idle ones (the most recently used first), the requests
    waiting for one while all `max_connections` are busy (served in order: a connection that
    comes back goes straight to the first of them), and how many are being opened."""

    def __init__(
        self,
        origin: Origin,
        context: ssl.SSLContext | None,
        keepalive_s: float,
        max_connections: int | None = None,
        max_idle: int | None = None,
        counts: ConnectionCounts | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        _, self.host, self.port, *_ = origin
        self.counts = counts if counts is not None else ConnectionCounts()
        self.context = context
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self.max_idle = max_idle
        self._idle: deque[_Connection] = deque()
        self._all: set[_Connection] = set()
        self._connecting = 0  # opening now: they count against `max_connections` already
        # Requests waiting: each is handed a connection, or None for room to open one.
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        # The host's addresses, resolved at most every `_DNS_TTL_S` (a literal IP never is).
        self._addresses: list[tuple[int, tuple[Any, ...]]] = []
        self._resolved_until = 0.0
        self._literal = _is_ip(self.host)

    def take(self) -> _Connection | None:
        """An idle connection still fresh enough to write a request into, or None."""
        now = self.loop.time()
        idle = self._idle
        while idle:
            conn = idle.pop()  # the most recent: the least likely to be closing
            if conn.usable(now):
                conn.idle = False
                self.drop_stale(now)
                return conn
            conn.close()
        return None

    def drop_stale(self, now: float) -> None:
        """Close the idle connections past their time (`put`)."""
        idle = self._idle
        while idle and now >= idle[0].idle_until:
            idle.popleft().close()

    @property
    def waiting(self) -> bool:
        """Whether requests are queued for a connection (they come first)."""
        return bool(self._waiters)

    @property
    def _full(self) -> bool:
        limit = self.max_connections
        return limit is not None and len(self._all) + self._connecting >= limit

    async def acquire(self, connect_s: float, fresh: bool = False) -> tuple[_Connection, bool]:
        """A connection for a request, and whether it was reused: an idle one (unless
        `fresh`), else a new one while under `max_connections`, else the first to come free
        within `connect_s` (after those already waiting)."""
        if not self._waiters:
            if not fresh:
                conn = self.take()
                if conn is not None:
                    return conn, True
            if not self._full:
                return await self.connect(connect_s), False
        deadline = self.loop.time() + connect_s
        self.counts.waited += 1
        while True:
            handed = await self._wait(deadline)
            if handed is not None:
                if handed.usable(self.loop.time()):
                    return handed, True
                handed.close()  # gone bad since it was handed over: room to open one
            if not self._full:
                return await self.connect(connect_s), False

    async def _wait(self, deadline: float) -> _Connection | None:
        """Queue for a connection (or room to open one) until `deadline`."""
        waiter: asyncio.Future[_Connection | None] = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._pass_on(waiter.result())  # handed over just as it gave up
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                self.counts.refused += 1
                raise UpstreamConnectionLimit(
                    f"all {self.max_connections} connections to the upstream are busy",
                    retry_after_s=CONNECTION_LIMIT_RETRY_AFTER_S,
                ) from None
            raise

    def _pass_on(self, conn: _Connection | None) -> bool:
        """Hand `conn` (None: room to open one) to the first request still waiting; whether
        one was."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        if conn is not None:
            self._keep_idle(conn)
        return False

    async def _resolve(self) -> list[tuple[int, tuple[Any, ...]]]:
        """The host's addresses (family, sockaddr), cached for `_DNS_TTL_S`."""
        now = self.loop.time()
        if self._addresses and now < self._resolved_until:
            return self._addresses
        infos = await self.loop.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
        self._addresses = [(family, address) for family, _, _, _, address in infos]
        self._resolved_until = now + _DNS_TTL_S
        return self._addresses

    async def connect(self, connect_s: float) -> _Connection:
        server_hostname = self.host if self.context is not None else None
        self._connecting += 1
        try:
            async with asyncio.timeout(connect_s):
                if self._literal:
                    _, conn = await self.loop.create_connection(
                        lambda: _Connection(self),
                        self.host,
                        self.port,
                        ssl=self.context,
                        server_hostname=server_hostname,
                    )
                else:
                    conn = await self._connect_resolved(server_hostname)
        except TimeoutError:
            raise UpstreamTimeout(
                "connecting to the upstream timed out", phase=Phase.CONNECT
            ) from None
        except OSError as exc:  # refused, unreachable, DNS, TLS (ssl.SSLError is an OSError)
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise UpstreamConnectError(
                f"cannot connect to the upstream: {reason}",
                refused=isinstance(exc, ConnectionRefusedError),
            ) from None
        finally:
            self._connecting -= 1
        if conn.transport is None:  # closed before it could be used
            self._pass_on(None)
            raise UpstreamReset("the upstream closed the connection (first_byte)")
        self._all.add(conn)
        self.counts.opened += 1
        return conn

    async def _connect_resolved(self, server_hostname: str | None) -> _Connection:
        """Connect to the first of the host's cached addresses that takes the connection;
        when none does, the cache is dropped (the next connect resolves again)."""
        error: OSError | None = None
        for family, address in await self._resolve():
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await self.loop.sock_connect(sock, address)
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self),
                    sock=sock,
                    ssl=self.context,
                    server_hostname=server_hostname,
                )
                return conn
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        self._resolved_until = 0.0
        raise error or OSError("the host resolved to no address")

    def put(self, conn: _Connection) -> None:
        """A connection whose answer ended whole: to the first request waiting, else idle."""
        if conn.transport is None:
            return
        keep_s = self.keepalive_s
        hint = conn.keepalive_hint
        if hint is not None:
            keep_s = min(keep_s, hint - _HINT_MARGIN_S)
        conn.reset_for_reuse()  # any byte it receives from here on closes it
        conn.idle_until = self.loop.time() + keep_s
        # (Bytes waiting unread are looked for when it is taken, not twice.)
        if keep_s <= 0 or conn.transport.is_closing():
            conn.idle = True  # nothing lost: a FIN, not a reset
            conn.close()
            return
        self._pass_on(conn)

    def _keep_idle(self, conn: _Connection) -> None:
        max_idle = self.max_idle
        conn.idle = True
        if max_idle is not None and len(self._idle) >= max_idle:
            conn.close()
            return
        self._idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        if conn not in self._all:
            return
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)
        if self._waiters:
            self._pass_on(None)  # room to open one

    @property
    def connections(self) -> int:
        """Open connections, idle or busy, and those being opened."""
        return len(self._all) + self._connecting

    def use(self) -> ConnectionUse:
        idle = len(self._idle)
        return ConnectionUse(len(self._all) - idle, idle, self._connecting)

    @property
    def unused(self) -> bool:
        """Nothing open, opening or waiting: the pool may be dropped."""
        return not self._all and not self._connecting and not self._waiters

    def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()


class H1Client:
    """Connection pools by origin, and the request a proxy needs: POST a body, get the head."""

    def __init__(self, keepalive_s: float) -> None:
        self._keepalive_s = keepalive_s
        self._pools: dict[Origin, _OriginPool] = {}
        # By URL, TLS setting and limits: its pool and request-line parts, worked out once.
        self._targets: dict[_TargetKey, tuple[_OriginPool, str, str]] = {}
        self._default_tls: ssl.SSLContext | None = None
        self._counts: dict[Address, ConnectionCounts] = {}

    async def post(
        self,
        url: URL,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        query: str = "",
        connect_s: float,
        tls: ssl.SSLContext | bool,
        max_connections: int | None = None,
        max_idle: int | None = None,
        on_sent: Callable[[], None] | None = None,
        resend: bool = True,
        remember: bool = True,
    ) -> UpstreamResponseHead:
        """Send one request to `url` (its path; `query` as the client sent it) and wait for
        its status and headers. On any failure (or when cancelled) the connection it used is
        closed. `max_connections`, `max_idle`: the origin's limits (None: none); `on_sent`:
        called as the request is written, once a connection is had (waiting for one, and
        opening it, are bounded by `connect_s` each). `resend`: whether a request that a kept-alive
        connection dropped at once may be sent again on a fresh one (the stale keep-alive
        race: off for a request that must not run twice); `remember`: whether the URL's
        request-line parts are kept for the next request (off for paths clients choose)."""
        key = (url, id(tls), max_connections, max_idle)
        target = self._targets.get(key)
        if target is None:
            target = self._target(key, url, tls, remember)
        pool, path, rest = target
        request = _request(f"{path}?{query}" if query else path, rest, headers, body)
        # The common case without a coroutine: an idle connection and nobody waiting for one.
        conn = pool.take() if not pool.waiting else None
        reused = conn is not None
        if conn is None:
            conn, reused = await pool.acquire(connect_s)
        if reused:
            pool.counts.reused += 1
            if on_sent is not None:
                on_sent()
            sent_at = pool.loop.time()
            try:
                return await conn.exchange(request)
            except UpstreamReset:
                conn.close()
                if not resend or conn.received or pool.loop.time() - sent_at > _STALE_WINDOW_S:
                    raise
                # The stale keep-alive race (see the module's docstring): once more, afresh.
            except BaseException:
                conn.close()
                raise
            pool.counts.resent += 1
            conn, _ = await pool.acquire(connect_s, fresh=True)
        if on_sent is not None:
            on_sent()
        try:
            return await conn.exchange(request)
        except BaseException:
            conn.close()
            raise

    def _target(
        self, key: _TargetKey, url: URL, tls: ssl.SSLContext | bool, remember: bool = True
    ) -> tuple[_OriginPool, str, str]:
        _, _, max_connections, max_idle = key
        target = (self._pool(url, tls, max_connections, max_idle), *_request_line_parts(url))
        if remember:
            if len(self._targets) > _MAX_TARGETS:  # URLs of instances long gone: start afresh
                self._targets.clear()
            self._targets[key] = target
        return target

    def _pool(
        self,
        url: URL,
        tls: ssl.SSLContext | bool,
        max_connections: int | None,
        max_idle: int | None,
    ) -> _OriginPool:
        context: ssl.SSLContext | None = None
        if url.scheme == "https":
            if isinstance(tls, ssl.SSLContext):
                context = tls
            else:
                if self._default_tls is None:
                    self._default_tls = ssl.create_default_context()
                context = self._default_tls
        if context is not None:
            # Say which protocol it will speak: a TLS front that also offers h2 must not
            # assume it, and one that requires ALPN gets an answer.
            context.set_alpn_protocols(["http/1.1"])
        host, port = _host_port(url)
        # Limits are part of the key: two pools of the policy listing the same instance with
        # different limits each keep their own.
        origin: Origin = (
            url.scheme,
            host,
            port,
            id(context) if context is not None else 0,
            max_connections,
            max_idle,
        )
        pool = self._pools.get(origin)
        if pool is None:
            # A new origin (or a reload's new TLS context or limits): forget the pools left
            # unused, so reloads do not accumulate them.
            now = asyncio.get_running_loop().time()
            for old_key, old in list(self._pools.items()):
                old.drop_stale(now)
                if old.unused:
                    del self._pools[old_key]
            live = set(self._pools.values())
            self._targets = {k: t for k, t in self._targets.items() if t[0] in live}
            address = (url.scheme, host, port)
            counts = self._counts.get(address)
            if counts is None:
                if len(self._counts) > _MAX_TARGETS:  # addresses long gone: start afresh
                    self._counts.clear()
                counts = self._counts[address] = ConnectionCounts()
            pool = _OriginPool(
                origin, context, self._keepalive_s, max_connections, max_idle, counts
            )
            self._pools[origin] = pool
        return pool

    def connection_counts(self, url: URL) -> ConnectionCounts | None:
        """The counters of `url`'s address (scheme, host, port); None before any request."""
        host, port = _host_port(url)
        return self._counts.get((url.scheme, host, port))

    def connection_use(self, url: URL) -> ConnectionUse:
        """The connections open to `url`'s address now, over all its pools."""
        host, port = _host_port(url)
        busy = idle = opening = 0
        for (scheme, pool_host, pool_port, *_), pool in self._pools.items():
            if (scheme, pool_host, pool_port) == (url.scheme, host, port):
                use = pool.use()
                busy += use.busy
                idle += use.idle
                opening += use.opening
        return ConnectionUse(busy, idle, opening)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _host_port(url: URL) -> tuple[str, int]:
    return url.raw_host or "", url.port or (443 if url.scheme == "https" else 80)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _keepalive_timeout(value: bytes) -> float | None:
    """`timeout=N` of a Keep-Alive header (RFC 2068 19.7.1.1), or None; `max=0` (no request
    after this one) reads as a timeout of 0."""
    timeout: float | None = None
    for part in value.split(b","):
        key, _, number = part.strip().partition(b"=")
        key = key.strip().lower()
        try:
            parsed = float(number.strip())
        except ValueError:
            continue
        if key == b"timeout" and parsed >= 0:
            timeout = parsed if timeout is None else min(timeout, parsed)
        elif key == b"max" and parsed < 1:
            timeout = 0.0
    return timeout


def _request_line_parts(url: URL) -> tuple[str, str]:
    """The request target's path, and what follows it up to the headers: version and Host."""
    host = url.raw_host or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    if url.explicit_port:
        host = f"{host}:{url.port}"
    return url.raw_path or "/", f" HTTP/1.1\r\nhost: {host}\r\n"


def _request(target: str, rest: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """The request's bytes: line and Host, the headers given, Content-Length, then the body."""
    lines = [f"POST {target}{rest}"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers)
    lines.append(f"content-length: {len(body)}\r\n\r\n")
    return "".join(lines).encode("latin-1") + body
