"""A fault-injecting TCP proxy for chaos tests: one loopback port in front of one backend.

    python -m loadtests.chaos.tcpproxy --listen-port 0 --upstream 127.0.0.1:8001 \
        [--control-port 0] [--seed 0] [--latency S] [--jitter S] [--bandwidth B] \
        [--mode pass|refuse|reset|blackhole] [--reset-after-bytes N]

binds 127.0.0.1 only and prints `tcpproxy READY port=<proxy port> control=<control port>` once
serving. SIGTERM or SIGINT closes every connection and exits with status 0.

Faults (the JSON keys of the control endpoint; `FaultProxy.set_faults` takes the same names):

    latency            seconds added to every chunk, each direction, order kept per connection
    jitter             extra uniform 0..jitter seconds per chunk, from random.Random(--seed)
    bandwidth          bytes/s per direction per connection; 0 = unlimited
    mode               pass | refuse | reset | blackhole
    reset_after_bytes  reset a connection (RST) once it forwarded that many bytes to the client,
                       counted from when the setting took effect; 0 = off

Modes: `refuse` stops listening, so new connections get ECONNREFUSED (the port stays reserved);
accepted connections carry on. `reset` resets new and existing connections with an RST.
`blackhole` accepts and reads but forwards and answers nothing, existing connections included;
what it read is held (as a partitioned network holds retransmissions) and delivered when the
mode changes; a connection accepted meanwhile whose client gives up never reaches the upstream.

Control endpoint (HTTP/1.1, `Connection: close`, JSON bodies):

    GET  /faults     current faults (the keys above)
    POST /faults     a partial object merged into them; unknown key or bad value: 400, no change
    POST /reset      every fault back to its default
    GET  /stats      counters: accepted, active, bytes_to_upstream, bytes_to_client, resets,
                     upstream_failures
    GET  /upstream   {"host": ..., "port": ...}
    POST /upstream   {"host": ..., "port": ...}: where new connections go
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import signal
import socket
import struct
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, TypeVar, cast

LISTEN_HOST: Final = "127.0.0.1"
MODES: Final = ("pass", "refuse", "reset", "blackhole")
MAX_SECONDS: Final = 3600.0

# Bytes held per direction (delayed, throttled or blackholed) before the source stops being
# read: the proxy pushes back like a full TCP window instead of growing without bound.
_HOLD_LIMIT: Final = 1 << 20
# A bandwidth cap is applied in slices this many seconds' worth of bytes, so it is smooth.
_PACE_S: Final = 0.02
# Before a reset_after_bytes RST, wait this long at most for the last bytes to leave the proxy:
# an RST throws away whatever is still unsent.
_FLUSH_BEFORE_RESET_S: Final = 1.0
_UPSTREAM_CONNECT_TIMEOUT_S: Final = 10.0
_CLOSE_GRACE_S: Final = 1.0
_BACKLOG: Final = 1024
_LINGER_RESET: Final = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST

# Markers in a direction's queue, kept in order with the data before them.
_EOF: Final = b""
_RESET: Final = None

T = TypeVar("T")


class FaultError(ValueError):
    """An invalid fault or upstream setting; nothing was changed."""


def _seconds(key: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 <= value <= MAX_SECONDS
    ):
        raise FaultError(f"{key} must be a number of seconds between 0 and {MAX_SECONDS:g}")
    return float(value)


def _byte_count(key: str, value: object) -> int:
    if value is None:
        return 0  # null reads as "off", like 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON writers may send 1e5
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FaultError(f"{key} must be a non-negative integer (0 = off)")
    return value


def _mode(key: str, value: object) -> str:
    if not isinstance(value, str) or value not in MODES:
        raise FaultError(f"{key} must be one of {', '.join(MODES)}")
    return value


_PARSERS: Final[Mapping[str, Callable[[str, object], object]]] = {
    "latency": _seconds,
    "jitter": _seconds,
    "bandwidth": _byte_count,
    "mode": _mode,
    "reset_after_bytes": _byte_count,
}


@dataclass(frozen=True)
class Faults:
    """The link's current faults; field names are the control endpoint's JSON keys."""

    latency: float = 0.0
    jitter: float = 0.0
    bandwidth: int = 0
    mode: str = "pass"
    reset_after_bytes: int = 0

    @property
    def shaped(self) -> bool:
        """Whether chunks need timing: only then does data go through the per-direction queue."""
        return self.latency > 0 or self.jitter > 0 or self.bandwidth > 0

    def merged(self, changes: Mapping[str, object]) -> Faults:
        """A copy with `changes` applied; FaultError on any unknown key or bad value."""
        values: dict[str, Any] = asdict(self)
        for key, value in changes.items():
            parse = _PARSERS.get(key)
            if parse is None:
                raise FaultError(f"unknown fault {key!r}; known: {', '.join(_PARSERS)}")
            values[key] = parse(key, value)
        return Faults(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Stats:
    accepted: int = 0
    active: int = 0
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0
    resets: int = 0  # connections the proxy reset on purpose (mode reset, reset_after_bytes)
    upstream_failures: int = 0  # upstream connects that failed; the client got an RST


def parse_upstream(host: object, port: object) -> tuple[str, int]:
    if not isinstance(host, str) or not host:
        raise FaultError("host must be a non-empty string")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise FaultError("port must be an integer between 1 and 65535")
    return host, port


def _reset_transport(transport: asyncio.BaseTransport | None) -> None:
    """Close with an RST rather than a FIN: the peer sees ECONNRESET."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    cast(asyncio.WriteTransport, transport).abort()


class _Direction:
    """One way of a connection: chunks from `source` to `sink`, in order, shaped by the faults.

    Without faults a chunk is written straight through from `data_received`; otherwise it is
    queued with its release time and a pump task sends it when due and the bandwidth allows.
    """

    def __init__(self, conn: _Connection, to_client: bool) -> None:
        self.conn = conn
        self.proxy = conn.proxy
        self.to_client = to_client
        self.source: asyncio.Transport | None = None
        self.sink: asyncio.Transport | None = None
        self.sink_paused = False
        self.done = False  # the end of the stream was passed on, or there is nobody to pass to
        self._ended = False  # the source's end is queued
        self._queue: deque[tuple[float, bytes | None]] = deque()
        self._head_offset = 0  # bytes of the queue's first chunk already sent
        self._held = 0
        self._holds = 0  # reasons the source is paused: bit 1 sink full, bit 2 too much held
        self._next_send = 0.0
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None

    # --- input from the source -------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self.done or self.conn.doomed:
            return
        if self.proxy.plain and not self._queue and self.sink is not None and not self.sink_paused:
            self._send(data)
        else:
            self._enqueue(data)

    def feed_end(self, reset: bool) -> None:
        """The source finished (EOF) or broke (reset): pass that on after the data before it."""
        if self.done or self._ended or self.conn.doomed:
            return
        self._ended = True
        self._enqueue(_RESET if reset else _EOF)

    def _enqueue(self, item: bytes | None) -> None:
        self._queue.append((self.proxy.release_time(), item))
        if item:
            self._held += len(item)
            if self._held > _HOLD_LIMIT:
                self._hold_source(2, True)
        if self._task is None:
            self._task = self.proxy.loop.create_task(self._pump())

    # --- state changes -----------------------------------------------------------------------

    def attach_source(self, transport: asyncio.Transport) -> None:
        self.source = transport
        if self._holds:
            transport.pause_reading()

    def attach_sink(self, transport: asyncio.Transport) -> None:
        self.sink = transport
        self.poke()

    def set_sink_paused(self, paused: bool) -> None:
        self.sink_paused = paused
        self._hold_source(1, paused)
        if not paused:
            self.poke()

    def poke(self) -> None:
        """Wake a pump parked for a sink, for writability, or for the blackhole to end."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def drop(self) -> None:
        """Nobody to deliver to any more: forget what is queued."""
        self.done = True
        self._queue.clear()
        self._held = 0
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None

    def _hold_source(self, reason: int, on: bool) -> None:
        before = self._holds
        self._holds = (self._holds | reason) if on else (self._holds & ~reason)
        source = self.source
        if source is None or source.is_closing() or bool(before) == bool(self._holds):
            return
        if self._holds:
            source.pause_reading()
        else:
            source.resume_reading()

    # --- output to the sink ------------------------------------------------------------------

    async def _pump(self) -> None:
        loop = self.proxy.loop
        try:
            while self._queue and not self.done and not self.conn.doomed:
                faults = self.proxy.faults
                if faults.mode == "blackhole" or self.sink is None or self.sink_paused:
                    await self._park()
                    continue
                due, item = self._queue[0]
                now = loop.time()
                if due > now:
                    await asyncio.sleep(due - now)
                    continue
                if not item:
                    self._queue.popleft()
                    self._finish(reset=item is _RESET)
                    continue
                if faults.bandwidth:
                    if self._next_send > now:
                        await asyncio.sleep(self._next_send - now)
                        continue
                    start = self._head_offset
                    size = max(1, int(faults.bandwidth * _PACE_S))
                    chunk = item[start : start + size]
                    if start + size < len(item):
                        self._head_offset += len(chunk)
                    else:
                        self._queue.popleft()
                        self._head_offset = 0
                    self._next_send = max(self._next_send, now) + len(chunk) / faults.bandwidth
                else:
                    self._queue.popleft()
                    chunk = item[self._head_offset :] if self._head_offset else item
                    self._head_offset = 0
                self._held -= len(chunk)
                if self._held <= _HOLD_LIMIT // 2:
                    self._hold_source(2, False)
                self._send(chunk)
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    async def _park(self) -> None:
        self._waiter = self.proxy.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _send(self, data: bytes) -> None:
        sink = self.sink
        if sink is None or sink.is_closing():
            return
        stats = self.proxy.stats_counters
        if not self.to_client:
            stats.bytes_to_upstream += len(data)
            sink.write(data)
            return
        cut = False
        limit = self.proxy.faults.reset_after_bytes
        if limit:
            conn = self.conn
            if conn.count_epoch != self.proxy.reset_epoch:
                # Bytes sent before the limit was set do not count toward it.
                conn.count_epoch = self.proxy.reset_epoch
                conn.counted = 0
            room = limit - conn.counted
            if len(data) >= room:
                data = data[: max(0, room)]
                cut = True
            conn.counted += len(data)
        stats.bytes_to_client += len(data)
        if data:
            sink.write(data)
        if cut:
            self.conn.reset_when_flushed()

    def _finish(self, reset: bool) -> None:
        self.done = True
        if reset:
            self.conn.abort()  # the peer reset its side: so does the proxy, to the other peer
            return
        sink = self.sink
        if sink is not None and not sink.is_closing() and sink.can_write_eof():
            sink.write_eof()
        self.conn.maybe_close()


class _Connection:
    """A client connection and its upstream connection, once there is one."""

    def __init__(self, proxy: FaultProxy, client: asyncio.Transport) -> None:
        self.proxy = proxy
        self.client: asyncio.Transport | None = client
        self.upstream: asyncio.Transport | None = None
        self.up = _Direction(self, to_client=False)
        self.down = _Direction(self, to_client=True)
        self.up.attach_source(client)
        self.down.attach_sink(client)
        self.connecting: asyncio.Task[None] | None = None
        self.counted = 0  # bytes to the client toward reset_after_bytes
        self.count_epoch = proxy.reset_epoch
        self.doomed = False  # being reset or closed: forward nothing more
        self._reset_task: asyncio.Task[None] | None = None
        self.flushed: asyncio.Event | None = None  # set while a reset waits for the client buffer

    def connect_upstream(self) -> None:
        if self.connecting is None and not self.doomed and self.client is not None:
            self.connecting = self.proxy.loop.create_task(self._connect())

    async def _connect(self) -> None:
        host, port = self.proxy.upstream
        try:
            async with asyncio.timeout(_UPSTREAM_CONNECT_TIMEOUT_S):
                await self.proxy.loop.create_connection(lambda: _UpstreamSide(self), host, port)
        except OSError:
            self.proxy.stats_counters.upstream_failures += 1
            self.doomed = True
            # The client was accepted already; an RST is the nearest thing to "refused".
            _reset_transport(self.client)
            self.down.drop()
            self.up.drop()
            self._forget_if_gone()

    def upstream_made(self, transport: asyncio.Transport) -> None:
        # Made even if the client has left meanwhile: what it sent still goes through.
        if self.doomed:
            transport.close()
            return
        self.upstream = transport
        self.down.attach_source(transport)
        self.up.attach_sink(transport)

    def client_lost(self, exc: Exception | None) -> None:
        self.client = None
        if self.flushed is not None:
            self.flushed.set()
        self.proxy.stats_counters.active -= 1
        self.down.drop()
        if self.connecting is None:
            # Never reached the upstream (accepted while blackholed): let it vanish, as a
            # connection attempt lost in a partition would.
            self.up.drop()
            self.doomed = True
        else:
            self.up.feed_end(reset=exc is not None)
        self.maybe_close()

    def upstream_lost(self, exc: Exception | None) -> None:
        self.upstream = None
        self.up.drop()
        self.down.feed_end(reset=exc is not None)
        self.maybe_close()

    def maybe_close(self) -> None:
        """Both directions ended: close what is still open (after its queued writes)."""
        # While a reset waits for the client's buffer to drain, a FIN must not go first.
        resetting = self._reset_task is not None and not self._reset_task.done()
        if not resetting and (self.doomed or (self.up.done and self.down.done)):
            for transport in (self.client, self.upstream):
                if transport is not None and not transport.is_closing():
                    transport.close()
        self._forget_if_gone()

    def _forget_if_gone(self) -> None:
        if self.client is None and self.upstream is None:
            task = self.connecting
            if task is not None and not task.done() and task is not asyncio.current_task():
                task.cancel()
            self.proxy.forget(self)

    def abort(self) -> None:
        """Reset both sides and stop forwarding."""
        self.doomed = True
        self.up.drop()
        self.down.drop()
        if self.connecting is not None and not self.connecting.done():
            self.connecting.cancel()
        _reset_transport(self.client)
        _reset_transport(self.upstream)

    def reset(self) -> None:
        """A reset the proxy injects: counted, unlike one passed on from a peer."""
        if self.client is not None and not self.client.is_closing():
            self.proxy.stats_counters.resets += 1
        self.abort()

    def reset_when_flushed(self) -> None:
        """Reset once the bytes already written have left the proxy (an RST discards them)."""
        if self._reset_task is not None:
            return
        self.doomed = True
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.pause_reading()
        self._reset_task = self.proxy.loop.create_task(self._flush_then_reset())

    async def _flush_then_reset(self) -> None:
        client = self.client
        if client is not None and not client.is_closing() and client.get_write_buffer_size():
            self.flushed = asyncio.Event()
            # With a zero low-water mark, resume_writing reports the buffer empty.
            client.set_write_buffer_limits(high=0, low=0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flushed.wait(), _FLUSH_BEFORE_RESET_S)
        self.reset()

    def close(self) -> None:
        """Shut down politely: FIN to both sides once their buffered writes went out."""
        self.doomed = True
        self.up.drop()
        self.down.drop()
        if self.connecting is not None and not self.connecting.done():
            self.connecting.cancel()
        for transport in (self.client, self.upstream):
            if transport is not None and not transport.is_closing():
                transport.close()


class _ClientSide(asyncio.Protocol):
    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.conn: _Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        proxy = self.proxy
        proxy.stats_counters.accepted += 1
        mode = proxy.faults.mode
        if mode in ("reset", "refuse") or proxy.closing:
            # Accepted just before the listener stopped, or reset on purpose: RST it at once.
            if mode == "reset":
                proxy.stats_counters.resets += 1
            _reset_transport(transport)
            return
        conn = _Connection(proxy, cast(asyncio.Transport, transport))
        self.conn = conn
        proxy.remember(conn)
        proxy.stats_counters.active += 1
        if mode != "blackhole":
            conn.connect_upstream()

    def data_received(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.up.feed(data)

    def eof_received(self) -> bool:
        if self.conn is not None:
            self.conn.up.feed_end(reset=False)
        return True  # keep the transport open: the response may still be on its way

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.conn.client_lost(exc)

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.down.set_sink_paused(True)

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.conn.down.set_sink_paused(False)
            if self.conn.flushed is not None:
                self.conn.flushed.set()


class _UpstreamSide(asyncio.Protocol):
    def __init__(self, conn: _Connection) -> None:
        self.conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn.upstream_made(cast(asyncio.Transport, transport))

    def data_received(self, data: bytes) -> None:
        self.conn.down.feed(data)

    def eof_received(self) -> bool:
        self.conn.down.feed_end(reset=False)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn.upstream is not None:
            self.conn.upstream_lost(exc)

    def pause_writing(self) -> None:
        self.conn.up.set_sink_paused(True)

    def resume_writing(self) -> None:
        self.conn.up.set_sink_paused(False)


def _bind(port: int, listen: bool) -> socket.socket:
    """A loopback socket. SO_REUSEPORT lets a second, non-listening socket hold the port while
    the listener is closed for `refuse`, so the port cannot be taken meanwhile."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((LISTEN_HOST, port))
        if listen:
            sock.listen(_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class FaultProxy:
    """The proxy, for use inside a running event loop::

    proxy = FaultProxy("127.0.0.1", backend_port)
    await proxy.start()
    await proxy.set_faults(latency=0.05, jitter=0.01)
    ...
    await proxy.close()
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        port: int = 0,
        faults: Faults | None = None,
        seed: int = 0,
    ) -> None:
        self.upstream: tuple[str, int] = parse_upstream(upstream_host, upstream_port)
        self.faults = faults or Faults()
        self.plain = self._is_plain(self.faults)
        self.stats_counters = Stats()
        self.reset_epoch = 0  # bumped when reset_after_bytes changes: connections count anew
        self.connections: set[_Connection] = set()
        self.closing = False
        self._requested_port = port
        self._port: int | None = None
        self._rng = random.Random(seed)
        self._server: asyncio.AbstractServer | None = None
        self._reservation: socket.socket | None = None
        self._control: asyncio.AbstractServer | None = None
        self._control_port: int | None = None
        self._lock = asyncio.Lock()
        self._no_connections = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @staticmethod
    def _is_plain(faults: Faults) -> bool:
        return faults.mode in ("pass", "refuse") and not faults.shaped

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "start() first"
        return self._loop

    @property
    def port(self) -> int:
        assert self._port is not None, "start() first"
        return self._port

    @property
    def control_port(self) -> int | None:
        return self._control_port

    @property
    def listening(self) -> bool:
        return self._server is not None

    def remember(self, conn: _Connection) -> None:
        self.connections.add(conn)
        self._no_connections.clear()

    def forget(self, conn: _Connection) -> None:
        self.connections.discard(conn)
        if not self.connections:
            self._no_connections.set()

    def stats(self) -> dict[str, int]:
        return asdict(self.stats_counters)

    def release_time(self) -> float:
        """When a chunk arriving now may be forwarded."""
        faults = self.faults
        delay = faults.latency
        if faults.jitter:
            delay += self._rng.uniform(0.0, faults.jitter)
        return self.loop.time() + delay

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        listener = _bind(self._requested_port, listen=True)
        self._port = listener.getsockname()[1]
        try:
            self._reservation = _bind(self._port, listen=False)
        except OSError:
            self._reservation = None  # no SO_REUSEPORT: `refuse` rebinds and may race
        if self.faults.mode == "refuse":
            listener.close()
        else:
            await self._serve(listener)

    async def _serve(self, listener: socket.socket | None = None) -> None:
        if listener is None:
            listener = _bind(self.port, listen=True)
        self._server = await self.loop.create_server(
            lambda: _ClientSide(self), sock=listener, backlog=_BACKLOG
        )

    def _stop_listening(self) -> None:
        if self._server is not None:
            # Connections already accepted stay open; closing the server only stops accepting.
            self._server.close()
            self._server = None

    async def set_faults(self, **changes: object) -> Faults:
        """Merge `changes` into the faults (FaultError if any is invalid) and apply them."""
        return await self._apply(self.faults.merged(changes))

    async def reset_faults(self) -> Faults:
        return await self._apply(Faults())

    async def _apply(self, faults: Faults) -> Faults:
        async with self._lock:
            if faults.reset_after_bytes != self.faults.reset_after_bytes:
                self.reset_epoch += 1
            self.faults = faults
            self.plain = self._is_plain(faults)
            if self._loop is None or self.closing:
                return faults
            if faults.mode == "refuse":
                self._stop_listening()
                await asyncio.sleep(0)  # let the loop finish closing the listening socket
            elif self._server is None:
                await self._serve()
            for conn in list(self.connections):
                if faults.mode == "reset":
                    conn.reset()
                elif faults.mode != "blackhole":
                    conn.connect_upstream()  # those accepted while blackholed
                    conn.up.poke()
                    conn.down.poke()
            return faults

    def set_upstream(self, host: str, port: int) -> None:
        """Where connections accepted from now on go; open connections keep their upstream."""
        self.upstream = parse_upstream(host, port)

    async def start_control(self, port: int = 0) -> int:
        """Serve the HTTP control endpoint on loopback; returns its port."""
        control = _ControlServer(self)
        self._control = await asyncio.start_server(control.handle, LISTEN_HOST, port)
        self._control_port = self._control.sockets[0].getsockname()[1]
        return self._control_port

    async def close(self) -> None:
        """Stop listening and close every connection (FIN, or RST if they will not drain)."""
        if self.closing:
            return
        self.closing = True
        self._stop_listening()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None
        if self._loop is None:
            return
        for conn in list(self.connections):
            conn.close()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._no_connections.wait(), _CLOSE_GRACE_S)
        for conn in list(self.connections):
            conn.abort()
        await asyncio.sleep(0)  # let the aborted transports report their loss

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    500: "Internal Server Error",
}
_MAX_BODY: Final = 64 * 1024
_READ_TIMEOUT_S: Final = 5.0


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _ControlServer:
    """Minimal HTTP/1.1: one request per connection, JSON in and out."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self._routes: dict[tuple[str, str], Callable[[bytes], Awaitable[object]]] = {
            ("GET", "/faults"): self._get_faults,
            ("POST", "/faults"): self._set_faults,
            ("POST", "/reset"): self._reset,
            ("GET", "/stats"): self._stats,
            ("GET", "/upstream"): self._get_upstream,
            ("POST", "/upstream"): self._set_upstream,
        }

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                status, payload = 200, await self._dispatch(reader)
            except _HttpError as exc:
                status, payload = exc.status, {"error": str(exc)}
            except (ConnectionError, asyncio.IncompleteReadError):
                raise
            except Exception as exc:  # e.g. the port could not be bound again after `refuse`
                status, payload = 500, {"error": f"{type(exc).__name__}: {exc}"}
            body = json.dumps(payload).encode() + b"\n"
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                "Content-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the caller went away
        finally:
            writer.close()

    async def _dispatch(self, reader: asyncio.StreamReader) -> object:
        try:
            async with asyncio.timeout(_READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, headers = _parse_head(head)
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    raise _HttpError(411, "send a Content-Length, not a chunked body")
                try:
                    length = int(headers.get("content-length", "0"))
                except ValueError:
                    raise _HttpError(400, "bad Content-Length") from None
                if not 0 <= length <= _MAX_BODY:
                    raise _HttpError(413, f"body larger than {_MAX_BODY} bytes")
                body = await reader.readexactly(length)
        except TimeoutError:
            raise _HttpError(408, "request not received in time") from None
        except asyncio.LimitOverrunError:
            raise _HttpError(413, "request head too large") from None
        handler = self._routes.get((method, path))
        if handler is None:
            if any(p == path for _, p in self._routes):
                raise _HttpError(405, f"{method} not allowed on {path}")
            raise _HttpError(404, f"no route for {path}")
        return await handler(body)

    async def _get_faults(self, body: bytes) -> object:
        return self.proxy.faults.as_dict()

    async def _set_faults(self, body: bytes) -> object:
        changes = _json_object(body)
        try:
            faults = await self.proxy.set_faults(**changes)
        except FaultError as exc:
            raise _HttpError(400, str(exc)) from None
        return faults.as_dict()

    async def _reset(self, body: bytes) -> object:
        return (await self.proxy.reset_faults()).as_dict()

    async def _stats(self, body: bytes) -> object:
        return {**self.proxy.stats(), "listening": self.proxy.listening}

    async def _get_upstream(self, body: bytes) -> object:
        host, port = self.proxy.upstream
        return {"host": host, "port": port}

    async def _set_upstream(self, body: bytes) -> object:
        value = _json_object(body)
        unknown = set(value) - {"host", "port"}
        if unknown:
            raise _HttpError(400, f"unknown keys {sorted(unknown)}; expected host and port")
        try:
            self.proxy.set_upstream(cast(str, value.get("host")), cast(int, value.get("port")))
        except FaultError as exc:
            raise _HttpError(400, str(exc)) from None
        return await self._get_upstream(b"")


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _HttpError(400, "bad request line")
    method, target, _ = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _HttpError(400, "bad header line")
        headers[name.strip().lower()] = value.strip()
    return method, target.split("?", 1)[0], headers


def _json_object(body: bytes) -> dict[str, object]:
    try:
        value = json.loads(body)
    except ValueError:
        raise _HttpError(400, "body is not valid JSON") from None
    if not isinstance(value, dict):
        raise _HttpError(400, "body must be a JSON object")
    return cast(dict[str, object], value)


# --- command line ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.chaos.tcpproxy",
        description="Fault-injecting TCP proxy on 127.0.0.1 in front of one upstream.",
    )
    parser.add_argument("--listen-port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--control-port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter generator")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per chunk")
    parser.add_argument("--jitter", type=float, default=0.0, help="extra 0..S seconds per chunk")
    parser.add_argument("--bandwidth", type=int, default=0, help="bytes/s per direction; 0 = off")
    parser.add_argument("--mode", default="pass", choices=MODES)
    parser.add_argument("--reset-after-bytes", type=int, default=0, help="0 = off")
    return parser.parse_args(argv)


def _split_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise FaultError(f"--upstream must be HOST:PORT, not {value!r}")
    return parse_upstream(host.strip("[]"), int(port))


async def _serve(args: argparse.Namespace, faults: Faults, upstream: tuple[str, int]) -> None:
    proxy = FaultProxy(*upstream, port=args.listen_port, faults=faults, seed=args.seed)
    await proxy.start()
    control_port = await proxy.start_control(args.control_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"tcpproxy READY port={proxy.port} control={control_port}", flush=True)
    try:
        await stop.wait()
    finally:
        await proxy.close()


def _run(main: Callable[[], Awaitable[T]]) -> T:
    """On uvloop when it is installed: the proxy must not be the bottleneck of a load test."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop comes with the gateway
        factory = None

    async def wrapper() -> T:
        return await main()

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(wrapper())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        upstream = _split_host_port(args.upstream)
        faults = Faults().merged(
            {
                "latency": args.latency,
                "jitter": args.jitter,
                "bandwidth": args.bandwidth,
                "mode": args.mode,
                "reset_after_bytes": args.reset_after_bytes,
            }
        )
    except FaultError as exc:
        print(f"tcpproxy: {exc}", file=sys.stderr)
        return 2
    try:
        _run(lambda: _serve(args, faults, upstream))
    except OSError as exc:
        print(f"tcpproxy: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
