"""Real servers on loopback for the integration tests: fake vLLM backends and the gateway."""

from __future__ import annotations

import socket
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtests.procs import ManagedProcess, gateway_process, python_module


@dataclass
class Backend:
    """A fake vLLM server running in its own process."""

    name: str
    proc: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proc.port()}"

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
        self.proc.stop()


def start_backend(name: str, models: list[str], *extra: str, port: int = 0) -> Backend:
    argv = python_module(
        "loadtests.fake_vllm",
        *("--port", str(port), "--name", name, "--models", ",".join(models)),
        *extra,
    )
    return Backend(name, ManagedProcess(argv))


def start_backends(names: tuple[str, ...], models: list[str], *extra: str) -> dict[str, Backend]:
    """Several fake backends serving the same models, by name."""
    return {name: start_backend(name, models, *extra) for name in names}


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
    for backend in backends.values():
        backend.stop()


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


def closed_port() -> int:
    """A loopback port with nothing listening (bound then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


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
