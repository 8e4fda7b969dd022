"""Connections in memory: two asyncio transports joined back to back, and an event loop on
virtual time whose `create_connection` reaches servers in memory instead of sockets.

The gateway's own protocols run on them unchanged (uvicorn's HTTP/1.1 server protocol in front,
the gateway's HTTP/1.1 client behind): every byte of a request and of its answer is written,
parsed and relayed as on a socket, with no kernel in between and no wall-clock time. A write is
read by the peer on the loop's next turn, one `data_received` per write, so a run is the same
on any machine: what the cost budget counts.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from loadtests.virtual_time import VirtualTimeLoop

Address = tuple[str, int]


class MemoryTransport(asyncio.Transport):
    """One end of a connection in memory."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, protocol: asyncio.Protocol, local: Address
    ) -> None:
        super().__init__()
        self._loop = loop
        self._protocol = protocol
        self._local = local
        self.peer: MemoryTransport | None = None
        self._closing = False
        self._paused = False
        self._held: deque[bytes] = deque()  # arrived while reading was paused

    # -- what the protocols ask ---------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sockname":
            return self._local
        if name == "peername":
            return self.peer._local if self.peer is not None else default
        return default  # no socket, no TLS

    def is_closing(self) -> bool:
        return self._closing

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        assert isinstance(protocol, asyncio.Protocol)
        self._protocol = protocol

    def is_reading(self) -> bool:
        return not self._paused and not self._closing

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        self._paused = False
        while self._held and not self._paused and not self._closing:
            self._protocol.data_received(self._held.popleft())

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self.peer is None or not data:
            return
        self._loop.call_soon(self.peer._receive, bytes(data))

    def close(self) -> None:
        self._end(None)

    def abort(self) -> None:
        self._end(ConnectionResetError("aborted"))

    # -- the other end's doing ------------------------------------------------------------------

    def _receive(self, data: bytes) -> None:
        if self._closing:
            return
        if self._paused:
            self._held.append(data)
        else:
            self._protocol.data_received(data)

    def _end(self, exc: Exception | None) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.call_soon(self._protocol.connection_lost, exc)
        if self.peer is not None:
            self._loop.call_soon(self.peer._peer_ended, exc)

    def _peer_ended(self, exc: Exception | None) -> None:
        """The other end closed (its bytes written before were delivered first)."""
        if self._closing:
            return
        if exc is None and not self._protocol.eof_received():
            self.close()
        elif exc is not None:
            self._closing = True
            self._protocol.connection_lost(exc)


def join(
    loop: asyncio.AbstractEventLoop,
    client: asyncio.Protocol,
    server: asyncio.Protocol,
    client_address: Address,
    server_address: Address,
) -> MemoryTransport:
    """Connect two protocols, both told `connection_made` at once; the client's transport."""
    near = MemoryTransport(loop, client, client_address)
    far = MemoryTransport(loop, server, server_address)
    near.peer, far.peer = far, near
    server.connection_made(far)
    client.connection_made(near)
    return near


class WireLoop(VirtualTimeLoop):
    """The virtual-time loop with servers in memory: `create_connection` to an address one
    was registered at (`listen`) joins the caller's protocol to a new server protocol; any
    other address is refused (nothing ever leaves the process)."""

    def __init__(self) -> None:
        # Closing the gateway waits for threads (the span exporter's shutdown).
        super().__init__(patience_s=10.0)
        self._servers: dict[Address, Callable[[], asyncio.Protocol]] = {}
        self._ports = 40000

    def listen(self, address: Address, factory: Callable[[], asyncio.Protocol]) -> None:
        self._servers[address] = factory

    def dial(self, address: Address, protocol: asyncio.Protocol) -> MemoryTransport:
        """Connect `protocol` to the server at `address`, as a client of this process."""
        self._ports += 1
        return join(self, protocol, self._servers[address](), ("127.0.0.1", self._ports), address)

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        """`create_connection(protocol_factory, host, port, ...)`, as asyncio's (every one of
        its overloads, in one signature: the rest of the arguments, TLS among them, is moot)."""
        protocol_factory, host, port = (*args, None, None)[:3]
        host, port = kwargs.get("host", host), kwargs.get("port", port)
        address = (host or "", port or 0)
        if address not in self._servers:
            raise ConnectionRefusedError(f"nothing listens at {host}:{port} in memory")
        protocol = protocol_factory()
        return self.dial(address, protocol), protocol
