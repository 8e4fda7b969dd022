"""A real `redis-server` on a loopback port, for the tests and benchmarks of shared decisions.

It keeps nothing on disk (no RDB, no AOF), so a restart on the same port is a Redis restarted
empty. `kill`, `pause` and `restart` are the faults the tests inject.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable

import redis

from loadtests.ports import PortHold, hold_port


class RedisServer:
    """redis-server on `port`, or on a port held for it (see loadtests/ports.py) until `close()`:
    a restart after a kill or a stop comes back on the same port, and while it is down nothing
    else takes the port and connections to it are refused."""

    def __init__(self, port: int | None = None, ready_timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/install-system-deps)")
        self.binary = binary
        self._hold: PortHold | None = None
        if port is None:
            self._hold = hold_port()
            port = self._hold.port
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.start(ready_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, ready_timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # A second one could not bind the port, and the first would be left untracked.
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        argv = [
            self.binary,
            *("--port", str(self.port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no"),
            *("--protected-mode", "yes", "--loglevel", "warning"),
        ]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        try:
            self._wait_ready(self.proc, ready_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}")
            try:
                client = self.client()
                try:
                    if client.ping():
                        return
                finally:
                    # Typed in some redis releases, untyped in others: a typed name for both.
                    close: Callable[[], None] = client.close
                    close()
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
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
        # Typed in some redis releases, untyped in others: a typed name for both.
        command: Callable[..., object] = self.client().execute_command
        command("CLIENT", "PAUSE", str(round(seconds * 1000)), "ALL")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def close(self) -> None:
        """Stopped for good: the port it held is let go."""
        try:
            self.stop()
        finally:
            if self._hold is not None:
                self._hold.close()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
