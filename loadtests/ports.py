"""Loopback ports for servers that cannot pick their own, or that must come back on the same port.

A server that binds port 0 itself and announces the port it got is always the first choice (see
loadtests/procs.py). Some cannot: nginx takes its port from its config file, and an instance
that is stopped and started again must come back where clients and the gateway expect it.

Binding port 0, closing the socket and handing the number to another process does not work
reliably: until that process binds, and again whenever it is down, anything on the machine may
take the port, and every outgoing connection is given a local port from the kernel's ephemeral
range, the same range port 0 picks from. So a port here is

- taken outside the ephemeral range (below it when there is room): no outgoing connection is
  ever given it;
- held by a bound socket that does not listen, for as long as the `PortHold` stays open:
  connections to the port are refused, the kernel leaves it out of its ephemeral choices, and
  nothing else can bind it unless it sets SO_REUSEADDR. The server does set it (uvicorn on
  `gateway.server.bind_listener`'s socket, redis-server, nginx and llama-server all do), so it
  binds and listens on the held port, and binds it again after a restart, TIME_WAIT included.

The hold is taken by a plain bind (no SO_REUSEADDR yet), which fails while any other socket uses
the port, a TIME_WAIT one or another harness's hold included; only then is SO_REUSEADDR set, so
that the server can join it.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
# Where ports are taken when the ephemeral range leaves room below it: clear of the well-known
# ports and of the low ranges other software tends to configure.
LOW_FLOOR = 20000
DEFAULT_EPHEMERAL = (32768, 60999)
ATTEMPTS = 200
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")

# Not the `random` module's shared generator: a caller that seeds it (the load generator does)
# would make every process pick the same sequence of ports.
_rng = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (and for port 0)."""
    try:
        low, high = (int(word) for word in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def candidate_range() -> range:
    """Ports outside the ephemeral range: below it if there is room, else above it; empty when
    the ephemeral range covers both."""
    low, high = ephemeral_range()
    if low - LOW_FLOOR >= 1000:
        return range(LOW_FLOOR, low)
    if high < 65535:
        return range(high + 1, 65536)
    return range(0)


class PortHold:
    """A loopback port held by a bound, non-listening socket until `close()`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self.port: int = sock.getsockname()[1]

    def close(self) -> None:
        """Let the port go (a server listening on it keeps it while it runs)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    @property
    def held(self) -> bool:
        return self._sock is not None

    def __enter__(self) -> PortHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _try_hold(port: int, host: str) -> PortHold | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except OSError:
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return PortHold(sock)


def hold_port(host: str = HOST) -> PortHold:
    """A free port outside the ephemeral range, held until the hold is closed.

    When the ephemeral range leaves no room (or every try there is taken), the kernel picks
    one: still held, so still safe while the hold is open, only not once it is closed."""
    ports = candidate_range()
    if len(ports):
        for _ in range(ATTEMPTS):
            held = _try_hold(_rng.choice(ports), host)
            if held is not None:
                return held
    held = _try_hold(0, host)
    if held is None:
        raise OSError(f"no free port on {host}")
    return held


def hold_ports(count: int, host: str = HOST) -> list[PortHold]:
    """`count` holds; none is left open if taking one fails."""
    holds: list[PortHold] = []
    try:
        for _ in range(count):
            holds.append(hold_port(host))
    except BaseException:
        close_all(holds)
        raise
    return holds


def close_all(holds: list[PortHold]) -> None:
    for hold in holds:
        with contextlib.suppress(OSError):
            hold.close()
