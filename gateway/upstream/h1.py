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
  is read (codings before it stay on the body, and are added to its Content-Encoding); a head
  beyond `MAX_HEAD_BYTES` or `MAX_HEAD_FIELDS`, a status outside 100-599, a header name with
  whitespace before its colon, or a body on a 1xx answer is a protocol error;
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

One module per layer, each importing (at run time) only the ones below it: this one, the
client the rest of the gateway imports, with the request's bytes; `h1_pool`, the connections to
one origin (reuse, queueing, opening them, DNS); `h1_connection`, what a request does with a
connection, and the `UpstreamResponseHead` it hands over; `h1_protocol`, the bytes in, through
httptools' callbacks.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Final

from yarl import URL

from gateway.errors import UpstreamReset
from gateway.upstream.h1_connection import Headers, UpstreamResponseHead
from gateway.upstream.h1_pool import (
    CONNECTION_LIMIT_RETRY_AFTER_S,
    Address,
    ConnectionCounts,
    ConnectionUse,
    Origin,
    OriginPool,
)
from gateway.upstream.h1_protocol import MAX_HEAD_BYTES, MAX_HEAD_FIELDS

__all__ = [
    "CONNECTION_LIMIT_RETRY_AFTER_S",
    "MAX_HEAD_BYTES",
    "MAX_HEAD_FIELDS",
    "Address",
    "ConnectionCounts",
    "ConnectionUse",
    "H1Client",
    "Headers",
    "Origin",
    "UpstreamResponseHead",
]

# Distinct instance URLs remembered with their request-line parts; past it, forgotten at once.
_MAX_TARGETS: Final = 4096

# A reused connection that ends before any byte of an answer this soon after the request was
# written is taken for one the backend was closing as the request arrived (see the module's
# docstring); later, the backend may have been working on it, and sending it again is not ours
# to decide (the retry policy decides, with its budget).
_STALE_WINDOW_S: Final = 0.1

# URL, id of the TLS setting, max connections, max idle
_TargetKey = tuple[URL, int, int | None, int | None]


class H1Client:
    """Connection pools by origin, and the request a proxy needs: POST a body, get the head."""

    def __init__(self, keepalive_s: float) -> None:
        self._keepalive_s = keepalive_s
        self._pools: dict[Origin, OriginPool] = {}
        # By URL, TLS setting and limits: its pool and request-line parts, worked out once.
        self._targets: dict[_TargetKey, tuple[OriginPool, str, str]] = {}
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
    ) -> tuple[OriginPool, str, str]:
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
    ) -> OriginPool:
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
            pool = OriginPool(origin, context, self._keepalive_s, max_connections, max_idle, counts)
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
