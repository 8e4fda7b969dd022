"""Real servers on loopback for the integration tests: fake vLLM backends and the gateway."""

from __future__ import annotations

import socket
import textwrap
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtests.ports import PortHold, hold_port
from loadtests.procs import ManagedProcess, gateway_process, python_module


@dataclass
class Backend:
    """A fake vLLM server running in its own process."""

    name: str
    proc: ManagedProcess
    # The port held for it (see loadtests/ports.py) from its start to `stop()`, so that a test
    # can kill it and start it again on the same port without anything taking the port between.
    hold: PortHold | None = None
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.proc.port()}"

    def set_faults(self, **faults: Any) -> None:
        httpx.post(f"{self.url}/_fake/faults", json=faults, timeout=5).raise_for_status()

    def reset(self) -> None:
        httpx.post(f"{self.url}/_fake/reset", timeout=5).raise_for_status()

    def requests(
        self, wait_for: int | None = None, timeout_s: float = 10.0
    ) -> list[dict[str, Any]]:
        """The backend's request log; with `wait_for`, once that many requests have ended."""
        params: dict[str, Any] = {}
        if wait_for is not None:
            params = {"wait_for": wait_for, "timeout": timeout_s}
        response = httpx.get(f"{self.url}/_fake/requests", params=params, timeout=timeout_s + 5)
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()
        return result

    def stop(self) -> None:
        """Stops the process and lets its port go."""
        try:
            self.proc.stop()
        finally:
            self._release()

    def _release(self) -> None:
        hold, self.hold = self.hold, None
        if hold is not None:
            if _holders.get(hold.port) is self:
                del _holders[hold.port]
            hold.close()


# Who holds which port: a backend started again on the port of one that was killed (not
# stopped) takes its hold over, and releases it when it is stopped in turn.
_holders: dict[int, Backend] = {}


def start_backend(
    name: str, models: list[str], *extra: str, port: int | None = None, host: str = "127.0.0.1"
) -> Backend:
    """A fake backend on a port held for it (restartable there), or on `port` (0: one the
    process picks itself), listening on `host` (another loopback address: several backends
    on one port, as pods behind one DNS name)."""
    hold: PortHold | None = None
    if port is None:
        hold = hold_port()
        port = hold.port
    else:
        previous = _holders.pop(port, None)
        if previous is not None:
            hold, previous.hold = previous.hold, None
    argv = python_module(
        "loadtests.fake_vllm",
        *("--host", host, "--port", str(port), "--name", name, "--models", ",".join(models)),
        *extra,
    )
    try:
        backend = Backend(name, ManagedProcess(argv), hold, host)
    except BaseException:
        if hold is not None:
            hold.close()
        raise
    if hold is not None:
        _holders[hold.port] = backend
    return backend


def start_backends(names: tuple[str, ...], models: list[str], *extra: str) -> dict[str, Backend]:
    """Several fake backends serving the same models, by name (none left running if one of
    them fails to start)."""
    started: dict[str, Backend] = {}
    try:
        for name in names:
            started[name] = start_backend(name, models, *extra)
    except BaseException:
        stop_backends(started)
        raise
    return started


def running_backends(
    names: tuple[str, ...], models: list[str], *extra: str
) -> Iterator[dict[str, Backend]]:
    """For a fixture: `yield from running_backends(...)`; stopped when the fixture ends."""
    started = start_backends(names, models, *extra)
    try:
        yield started
    finally:
        stop_backends(started)


def stop_backends(backends: dict[str, Backend]) -> None:
    """Stop them all, even if stopping one fails."""
    errors: list[BaseException] = []
    for backend in backends.values():
        try:
            backend.stop()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def instances_yaml(backends: dict[str, Backend]) -> str:
    """A policy's flow list of instances for these backends."""
    return ", ".join(f'{{name: {name}, url: "{b.url}"}}' for name, b in backends.items())


# A test gateway's listeners: loopback, on ports the kernel picks (announced when READY).
LOOPBACK_LISTENERS = "listen: 127.0.0.1:0\nadmin: {listen: 127.0.0.1:0}"


def pool_policy(backends: dict[str, Backend], pool_settings: str = "", top: str = "") -> str:
    """A test gateway's policy: one pool `chat` serving model `m` from these backends, with
    `pool_settings` (YAML lines, indented as pool keys) and `top` (top-level YAML lines)."""
    settings = textwrap.indent(textwrap.dedent(pool_settings).strip("\n"), "    ")
    return f"""
{LOOPBACK_LISTENERS}
{textwrap.dedent(top).strip()}
pools:
  chat:
    models: [m]
    instances: [{instances_yaml(backends)}]
{settings}
"""


@dataclass
class Gateway:
    """`gateway run` in its own process, on ports it chose itself."""

    proc: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://{self.proc.ready['data']}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.proc.ready['admin']}"

    def stop(self) -> None:
        self.proc.stop()


def start_gateway(
    policy_path: Path, policy_text: str, env: dict[str, str] | None = None
) -> Gateway:
    policy_path.write_text(policy_text)
    proc = gateway_process(policy_path, env)
    return Gateway(proc)


@contextmanager
def gateways(
    policy_path: Path, env: dict[str, str] | None = None
) -> Iterator[Callable[[str], Gateway]]:
    """For a fixture: a function starting gateways on `policy_path` (one at a time), every one
    stopped when the block ends."""
    started: list[Gateway] = []

    def start(policy_text: str) -> Gateway:
        gateway = start_gateway(policy_path, policy_text, env)
        started.append(gateway)
        return gateway

    try:
        yield start
    finally:
        for gateway in started:
            gateway.stop()


# Held for the rest of the session: see closed_port.
_closed_ports: list[PortHold] = []


def closed_port() -> int:
    """A loopback port that refuses connections for the rest of the test session.

    Bound (by a socket that never listens) and kept: a port released at once could be taken by
    another server, or given to an outgoing connection, even to the very connection made to it
    (a TCP self-connect, which then succeeds)."""
    hold = hold_port()
    _closed_ports.append(hold)
    return hold.port


def raw_http(port: int, request: bytes, timeout_s: float = 5.0) -> bytes:
    """Send bytes as they are and read until the server closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        chunks = []
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
                if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                    break
        except TimeoutError:
            pass
        return b"".join(chunks)


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def post_in_parallel(
    base_url: str,
    bodies: Sequence[dict[str, Any]],
    path: str = "/v1/chat/completions",
    at_once: int = 4,
) -> list[int]:
    """Each body POSTed to `path`, `at_once` in flight at a time; their statuses, in order.

    What teaches every instance of a pool its figures: one request after another each goes
    to the instance priced lowest, the one whose latest answers were the fastest, while
    requests in flight together spread by what each instance holds."""
    with httpx.Client(base_url=base_url, timeout=60) as http, ThreadPoolExecutor(at_once) as pool:
        replies = pool.map(lambda body: http.post(path, json=body), bodies)
        return [reply.status_code for reply in replies]
