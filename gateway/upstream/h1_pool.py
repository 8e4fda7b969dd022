"""The per-origin connection pool of the data plane's HTTP/1.1 client (`upstream.h1`): idle
connections kept for reuse, requests queued while all `max_connections` are busy, new ones
opened (DNS, TCP, TLS) within `connect_s`; and the counters kept per address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
from collections import deque
from typing import Any, Final, NamedTuple

from gateway.core.outcome import Phase
from gateway.errors import (
    UpstreamConnectError,
    UpstreamConnectionLimit,
    UpstreamReset,
    UpstreamTimeout,
)
from gateway.upstream.h1_connection import H1Connection

# A pooled connection leaves the pool this long before the backend's announced keep-alive
# timeout ends, so that a request is not written into it as the backend closes it.
_HINT_MARGIN_S: Final = 1.0

# How long a host's resolved addresses are reused for new connections (aiohttp's default).
_DNS_TTL_S: Final = 10.0
# The Retry-After of a request refused for want of a connection: one frees as soon as a
# request in flight there ends, so the client is told to come back soon.
CONNECTION_LIMIT_RETRY_AFTER_S: Final = 1.0

# scheme, host, port, id of the TLS context (0: none), max connections, max idle
Origin = tuple[str, str, int, int, int | None, int | None]
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


class OriginPool:
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
        self._idle: deque[H1Connection] = deque()
        self._all: set[H1Connection] = set()
        self._connecting = 0  # opening now: they count against `max_connections` already
        # Requests waiting: each is handed a connection, or None for room to open one.
        self._waiters: deque[asyncio.Future[H1Connection | None]] = deque()
        # The host's addresses, resolved at most every `_DNS_TTL_S` (a literal IP never is).
        self._addresses: list[tuple[int, tuple[Any, ...]]] = []
        self._resolved_until = 0.0
        self._literal = _is_ip(self.host)

    def take(self) -> H1Connection | None:
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

    async def acquire(self, connect_s: float, fresh: bool = False) -> tuple[H1Connection, bool]:
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

    async def _wait(self, deadline: float) -> H1Connection | None:
        """Queue for a connection (or room to open one) until `deadline`."""
        waiter: asyncio.Future[H1Connection | None] = self.loop.create_future()
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

    def _pass_on(self, conn: H1Connection | None) -> bool:
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

    async def connect(self, connect_s: float) -> H1Connection:
        server_hostname = self.host if self.context is not None else None
        self._connecting += 1
        try:
            async with asyncio.timeout(connect_s):
                if self._literal:
                    _, conn = await self.loop.create_connection(
                        lambda: H1Connection(self),
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

    async def _connect_resolved(self, server_hostname: str | None) -> H1Connection:
        """Connect to the first of the host's cached addresses that takes the connection;
        when none does, the cache is dropped (the next connect resolves again)."""
        error: OSError | None = None
        for family, address in await self._resolve():
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await self.loop.sock_connect(sock, address)
                _, conn = await self.loop.create_connection(
                    lambda: H1Connection(self),
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

    def put(self, conn: H1Connection) -> None:
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

    def _keep_idle(self, conn: H1Connection) -> None:
        max_idle = self.max_idle
        conn.idle = True
        if max_idle is not None and len(self._idle) >= max_idle:
            conn.close()
            return
        self._idle.append(conn)

    def forget(self, conn: H1Connection) -> None:
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


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
