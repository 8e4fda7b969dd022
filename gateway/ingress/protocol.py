"""The HTTP/1.1 connection handler: uvicorn's httptools protocol with the limits it lacks.

uvicorn waits forever for a request's headers and body, and httptools buffers a header of any
size. `HardenedProtocol` adds, per connection (`limits` in the policy):

- a deadline for the request line and headers, `header_timeout`: from the connection's
  accept for its first request, from the first byte of each next one (the wait *between*
  requests stays uvicorn's keep-alive timeout); a connection that never sent a byte is just
  closed, one stuck in the middle of its headers gets 408 (slowloris);
- a deadline for the whole body, `body_timeout`, from the end of the headers: 408 while no
  response has started, else the connection is closed (slow bodies). Time during which
  uvicorn itself holds the body back (a pipelined request waiting its turn, the app not
  reading yet) does not count;
- caps on the URI (`max_uri_bytes`, 414), on the headers' names + values (`max_header_bytes`)
  and their count (`max_headers`), 431; the raw bytes of an unfinished head are capped too, so
  a header that never ends cannot grow the parser's buffer;
- a connection cap, `max_connections`: a connection accepted above it gets a 503 (JSON,
  `retry-after: 1`) as soon as its headers are in, unless others closed meanwhile, without
  running the app.

Every refusal is the gateway's JSON error with `connection: close`, written only when no
response is under way on the connection (else the connection is just closed), and ends the
connection; it is counted by reason (`gateway.ingress.refusals`, only on that path). One
lazily re-armed timer per connection keeps the hot path to a clock read per request: arming
sets a deadline, the timer re-arms itself when it fires early.

The limits are one `ConnectionLimits` object per listener, read by every connection (never
copied per connection): a policy reload updates it in place. A new connection gets the new
limits; one already open follows them from its next check (its next request's deadline and
caps; a deadline already running keeps its time).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, ClassVar, cast

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.config.models import LimitsPolicy
from gateway.ingress.refusals import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    HEADERS_TOO_LARGE,
    OVER_CAPACITY,
    TOO_MANY_HEADERS,
    URI_TOO_LONG,
    IngressRefusals,
)
from gateway.ingress.writer import CLIENT_TRANSPORT, ChunkedWriter

# What is being read on the connection.
_NEW = 0  # nothing yet: the connection's first request
_HEAD = 1  # a request line and headers
_HEADERS_DONE = 2  # headers complete in the current chunk, body pending: arm its deadline
_BODY = 3  # the body, under its deadline
_DONE = 4  # nothing: the request was read (its response runs, or uvicorn's keep-alive waits)


def _refusal(status: int, type_: str, code: str, message: str, extra: bytes = b"") -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": type_, "code": code}}, separators=(",", ":")
    ).encode()
    return b"".join(
        [
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
            b"x-gateway-error: %b\r\n" % code.encode(),
            extra,
            b"\r\n",
            body,
        ]
    )


class _Refused(Exception):
    """Raised from a parser callback after a refusal, to stop parsing the rest."""


def _limit_values(limits: LimitsPolicy) -> dict[str, Any]:
    """What `ConnectionLimits` holds for a policy's `limits`."""
    invalid = "invalid_request_error"
    return {
        "header_timeout": limits.header_timeout,
        "body_timeout": limits.body_timeout,
        "max_header_bytes": limits.max_header_bytes,
        "max_headers": limits.max_headers,
        "max_uri_bytes": limits.max_uri_bytes,
        "max_connections": limits.max_connections,
        # The unfinished head's raw bytes: request line, names, values and separators.
        "max_head_bytes": limits.max_uri_bytes + 2 * limits.max_header_bytes + 1024,
        # A head that came in fewer raw bytes than this is within both caps: not counted.
        "quick_head_bytes": min(limits.max_uri_bytes, limits.max_header_bytes),
        "header_timeout_response": _refusal(
            408,
            invalid,
            "request_timeout",
            f"the request headers did not arrive within {limits.header_timeout:g}s",
        ),
        "body_timeout_response": _refusal(
            408,
            invalid,
            "request_timeout",
            f"the request body did not arrive within {limits.body_timeout:g}s",
        ),
        "uri_too_long_response": _refusal(
            414, invalid, "uri_too_long", f"the URI exceeds {limits.max_uri_bytes} bytes"
        ),
        "headers_too_large_response": _refusal(
            431,
            invalid,
            "headers_too_large",
            f"the request headers exceed {limits.max_headers} headers "
            f"or {limits.max_header_bytes} bytes",
        ),
        "over_capacity_response": _refusal(
            503,
            "service_unavailable",
            "too_many_connections",
            "the gateway is at its connection limit",
            b"retry-after: 1\r\n",
        ),
    }


class ConnectionLimits:
    """The limits every connection of one listener reads, on each check: one object the data
    plane owns, changed in place by a policy reload (`update`), so a new connection gets the
    new limits and one already open follows them from its next check."""

    __slots__ = (
        "body_timeout",
        "body_timeout_response",
        "header_timeout",
        "header_timeout_response",
        "headers_too_large_response",
        "max_connections",
        "max_head_bytes",
        "max_header_bytes",
        "max_headers",
        "max_uri_bytes",
        "over_capacity_response",
        "quick_head_bytes",
        "uri_too_long_response",
    )

    header_timeout: float
    body_timeout: float
    max_header_bytes: int
    max_headers: int
    max_uri_bytes: int
    max_connections: int
    max_head_bytes: int
    quick_head_bytes: int
    header_timeout_response: bytes
    body_timeout_response: bytes
    uri_too_long_response: bytes
    headers_too_large_response: bytes
    over_capacity_response: bytes

    def __init__(self, limits: LimitsPolicy) -> None:
        self.update(limits)

    def update(self, limits: LimitsPolicy) -> None:
        """A reload's limits, in one synchronous step."""
        for name, value in _limit_values(limits).items():
            setattr(self, name, value)


class HardenedProtocol(HttpToolsProtocol):
    # Set once per listener by `configured`: uvicorn builds a protocol per connection, these
    # outlive them (a reload changes the limits object's content, never these attributes).
    limits: ClassVar[ConnectionLimits]
    refusals: ClassVar[IngressRefusals]

    @classmethod
    def configured(
        cls, limits: ConnectionLimits, refusals: IngressRefusals
    ) -> type[HardenedProtocol]:
        """A subclass reading these limits and counting into these counters, for
        `uvicorn.Config(http=...)`."""
        return type(cls.__name__, (cls,), {"limits": limits, "refusals": refusals})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _NEW
        self._expires = math.inf  # the current deadline (loop time); inf: none
        self._timer: asyncio.TimerHandle | None = None
        self._head_received = 0  # raw bytes of the unfinished head
        self._chunk = 0  # bytes of the chunk being parsed
        # The chunk that ended the previous request, where a pipelined head may have begun.
        self._carry = 0
        self._over_capacity = False

    # --- connection -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's signature (uvicorn narrows it, against the protocol's own): a stream
        # server hands a stream transport.
        super().connection_made(cast(asyncio.Transport, transport))
        # Its writer, for the relay's writes from the upstream's callback (ingress.writer):
        # made once, handed to each of its requests.
        self._writer_entry: dict[object, object] = {
            "writer": ChunkedWriter(cast(asyncio.Transport, transport), self.loop)
        }
        # uvicorn added this connection to the set: above the cap, refuse its request.
        self._over_capacity = len(self.connections) > self.limits.max_connections
        self._arm(self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._expires = math.inf
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == _DONE:  # the first byte of a next request
            self._phase = _HEAD
            self._head_received = 0
            self._arm(self.limits.header_timeout)
        self._unset_keepalive_if_required()
        self._chunk = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():  # pragma: no cover - the data plane has no websockets
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self.transport.is_closing():
                return  # a callback refused the request (or the client is gone)
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        phase = self._phase
        if phase == _HEADERS_DONE:
            self._phase = _BODY
            self._arm(self.limits.body_timeout)
        elif phase <= _HEAD:
            self._head_received += len(data)
            if self._head_received > self.limits.max_head_bytes and not self.transport.is_closing():
                if len(self.url) > self.limits.max_uri_bytes:
                    self._close(self.limits.uri_too_long_response, URI_TOO_LONG, head=True)
                else:
                    self._close(
                        self.limits.headers_too_large_response, HEADERS_TOO_LARGE, head=True
                    )

    # --- parser callbacks -------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        # The URI and headers are measured once complete (a head still arriving is bounded by
        # its raw bytes, in data_received), and only when its raw size could exceed a cap.
        headers = self.headers
        if self._head_received + self._chunk + self._carry > self.limits.quick_head_bytes:
            if len(self.url) > self.limits.max_uri_bytes:
                self._refuse(self.limits.uri_too_long_response, URI_TOO_LONG)
            if (
                sum(len(name) + len(value) for name, value in headers)
                > self.limits.max_header_bytes
            ):
                self._refuse(self.limits.headers_too_large_response, HEADERS_TOO_LARGE)
        if len(headers) > self.limits.max_headers:
            self._refuse(self.limits.headers_too_large_response, TOO_MANY_HEADERS)
        if self._over_capacity:
            if len(self.connections) > self.limits.max_connections:
                self._refuse(self.limits.over_capacity_response, OVER_CAPACITY)
            self._over_capacity = False  # others closed meanwhile: serve it
        self.scope.setdefault("extensions", {})[CLIENT_TRANSPORT] = self._writer_entry
        HttpToolsProtocol.on_headers_complete(self)  # (cheaper than super() per request)
        self._phase = _HEADERS_DONE
        self._carry = 0

    def on_message_complete(self) -> None:
        HttpToolsProtocol.on_message_complete(self)
        self._phase = _DONE
        self._carry = self._chunk
        self._expires = math.inf

    # --- deadlines --------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        loop = self.loop
        expires = loop.time() + seconds
        self._expires = expires
        timer = self._timer
        if timer is None:
            self._timer = loop.call_at(expires, self._on_timer)
        elif timer.when() > expires:
            timer.cancel()
            self._timer = loop.call_at(expires, self._on_timer)
        # else: the pending timer fires first and re-arms itself for the rest

    def _on_timer(self) -> None:
        self._timer = None
        expires = self._expires
        if expires == math.inf or self.transport.is_closing():
            return
        if self.loop.time() < expires:
            self._timer = self.loop.call_at(expires, self._on_timer)
            return
        cycle = self.cycle
        if self._phase >= _HEADERS_DONE:  # the body is late
            if self.pipeline or self.flow.read_paused:
                # uvicorn holds it back (a pipelined request waits, the app has not read
                # what came): not the client's slowness.
                self._arm(self.limits.body_timeout)
                return
            self._close(self.limits.body_timeout_response, BODY_TIMEOUT, head=False)
            return
        if cycle is not None and not cycle.response_complete:
            # Bytes of a next request behind a response still running: its turn comes later.
            self._arm(self.limits.header_timeout)
            return
        if self._phase == _NEW and self._head_received == 0:
            # Never said a word: nobody to answer, and not counted (TCP probes do this).
            self.transport.close()
            return
        self._close(self.limits.header_timeout_response, HEADER_TIMEOUT, head=True)

    # --- refusals ---------------------------------------------------------------------------

    def _refuse(self, response: bytes, reason: str) -> None:
        """From a parser callback, while reading a head: answer, close, stop the parser."""
        self._close(response, reason, head=True)
        raise _Refused

    def _close(self, response: bytes, reason: str, *, head: bool) -> None:
        """Count the refusal; answer with `response` when the connection's response slot is
        free, and close.

        Reading a head, the slot is free when the previous request's response is complete;
        reading a body, when this request's response has not started.
        """
        self.refusals.count(reason, self._peer())
        cycle = self.cycle
        free = (cycle is None or cycle.response_complete) if head else not cycle.response_started
        if cycle is not None and not cycle.response_complete:
            # The app must not write after us: it sees a disconnect from now on.
            cycle.disconnected = True
            cycle.message_event.set()
        if free:
            self.transport.write(response)
        self.transport.close()
        self._expires = math.inf

    def _peer(self) -> str | None:
        return self.client[0] if self.client else None
