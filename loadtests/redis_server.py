"""A real `redis-server` on a loopback port, for the tests and benchmarks of shared decisions.

It keeps nothing on disk (no RDB, no AOF), so a restart on the same port is a Redis restarted
empty. `kill`, `pause` and `restart` are the faults the tests inject.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class RedisServer:
    def __init__(self, port: int | None = None, ready_timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/install-system-deps)")
        self.binary = binary
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start(ready_timeout_s)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, ready_timeout_s: float = 10.0) -> None:
        argv = [
            self.binary,
            *("--port", str(self.port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no"),
            *("--protected-mode", "yes", "--loglevel", "warning"),
        ]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                if self.client().ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer")

    def kill(self) -> None:
        """SIGKILL: connections die with a reset, nothing is saved."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        """Killed, then started again empty on the same port."""
        self.kill()
        self.start()

    def pause(self, seconds: float) -> None:
        """`CLIENT PAUSE ... ALL`: the server holds every client's commands for that long."""
        self.client().execute_command("CLIENT", "PAUSE", str(round(seconds * 1000)), "ALL")  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
