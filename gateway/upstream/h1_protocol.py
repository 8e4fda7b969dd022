"""The reading side of one connection of the data plane's HTTP/1.1 client (`upstream.h1`): the
bytes that arrive, parsed by httptools as one response at a time, its body held until the reader
takes it (or handed to the relay's tap as it arrives).

What a request does with the connection, and the connection's life (opened, reused, lost), are
`h1_connection`'s `H1Connection`, a subclass of the class here: the state is one object's, so a
body's piece goes from the socket to its reader through no call the callbacks did not make
already.
"""

from __future__ import annotations

import asyncio
import select
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import httptools

from gateway.errors import UpstreamProtocolError

if TYPE_CHECKING:
    from gateway.upstream.h1_pool import OriginPool

# Above this many bytes received but not yet taken by the relay, stop reading the socket (until
# the relay takes them): a slow client must not make the gateway buffer a fast backend's whole
# answer.
_HIGH_WATER: Final = 256 * 1024

# A response head larger than this, or with more fields, is refused (nginx's default for a
# proxied head is 4-8 KiB; Envoy's 60 KiB and 100 headers). Bounded, the parser's cost for a
# header value arriving in pieces (quadratic in its size) stays small.
MAX_HEAD_BYTES: Final = 64 * 1024
MAX_HEAD_FIELDS: Final = 100


_WHITESPACE: Final = b" \t"


class _Extra(Exception):
    """Raised from the parser's callbacks: bytes after the response's end."""


class ResponseProtocol(asyncio.Protocol):
    """The bytes of one connection to an origin, read as one response at a time."""

    def __init__(self, pool: OriginPool) -> None:
        # The connection's whole state, read and written by both halves: `H1Connection` adds
        # methods, no fields.
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

    # -- the bytes in -------------------------------------------------------------------------

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
        if codings:
            coded = codings[:-1]  # what the body is still in once the chunks are joined
            if codings[-1] != b"chunked" or b"chunked" in coded:
                # RFC 9112 6.1: chunked must come last, once; anything else cannot be framed.
                raise UpstreamProtocolError("the upstream sent a transfer coding it cannot frame")
            if coded:
                # `gzip, chunked`: only the chunks are undone; the body goes on gzipped. The
                # Transfer-Encoding that says so is hop-by-hop, dropped on the way to the client
                # (`ingress.headers.response_headers`), who would get gzip bytes nothing names.
                # Added to the Content-Encoding, the codings travel with the body they are on.
                self._raw_headers = _with_content_codings(self._raw_headers, coded)
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

    # -- what the callbacks tell the reader ---------------------------------------------------

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


def _with_content_codings(
    raw: list[tuple[bytes, bytes]], codings: list[bytes]
) -> list[tuple[bytes, bytes]]:
    """`raw` with `codings` appended to its Content-Encoding (RFC 9110 8.4: the codings in the
    order they were applied, the upstream's own first), as one field; `identity` is no coding
    and is left out."""
    fields: list[tuple[bytes, bytes]] = []
    declared: list[bytes] = []
    for name, value in raw:
        if name.lower() == b"content-encoding":
            declared.extend(c.strip() for c in value.split(b",") if c.strip())
        else:
            fields.append((name, value))
    named = [c for c in declared if c.lower() != b"identity"] + codings
    fields.append((b"content-encoding", b", ".join(named)))
    return fields


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
