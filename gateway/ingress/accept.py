"""Accepting new connections many at a time.

libuv, under uvloop, accepts one connection per turn of the event loop. On a busy gateway a
turn is long (it relays thousands of chunks a second), so new connections wait in the kernel's
accept queue while the open ones are served at once. Measured on chaos-mix (2,000 requests at
200/s, two cores shared with the engines): up to 480 connections queued in the kernel, and
streams' first bytes reached clients 4-7 s late while the gateway had them out in under 0.5 s.
Like asyncio's own loop, nginx's `multi_accept` and Envoy's listeners, `BatchAcceptor` takes
every pending connection at each wakeup, up to `ACCEPT_BATCH`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("gateway")

# The most connections taken in one wakeup: a flood of connections cannot hold the loop.
ACCEPT_BATCH = 256
# Out of file descriptors (or kernel memory): accepting again at once would spin; the pending
# connections wait in the kernel's queue meanwhile, as asyncio's loop lets them.
RETRY_AFTER_S = 1.0
_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO})


class BatchAcceptor:
    """Serves a listening socket: its pending connections are accepted at each wakeup and each
    gets a transport of the loop's own with a protocol from `protocol_factory`. Closes like
    an asyncio server (`close`, `wait_closed`); the socket stays its owner's to close."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._factory = protocol_factory
        self._tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
        self._opening: set[asyncio.Task[None]] = set()
        self._retry: asyncio.TimerHandle | None = None
        self._retry_after_s = retry_after_s
        self.closed = False
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # nothing more pending
            except OSError as exc:
                if exc.errno in _GONE:
                    continue  # the client gave up while it waited: the next one
                self._pause(exc)  # out of file descriptors, kernel memory...
                return
            conn.setblocking(False)
            if self._tcp:
                # Small writes (a stream's events) go out at once, as on asyncio's transports;
                # a connection already reset fails here or on its transport, not the batch.
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._open(conn))
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)

    async def _open(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:
            conn.close()  # reset before its transport was made: nothing to serve

    def _pause(self, exc: OSError) -> None:
        log.error(
            "cannot accept connections, retrying",
            extra={"fields": {"error": exc.strerror, "retry_s": self._retry_after_s}},
        )
        self._loop.remove_reader(self._sock.fileno())
        self._retry = self._loop.call_later(self._retry_after_s, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if not self.closed:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        """No new connection from here on; those accepted are their protocols'."""
        if self.closed:
            return
        self.closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        elif self._sock.fileno() != -1:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._sock.fileno())

    async def wait_closed(self) -> None:
        """Returns once the connections accepted before `close` have their transports."""
        if self._opening:
            await asyncio.gather(*self._opening, return_exceptions=True)
