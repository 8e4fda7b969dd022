"""Start and stop the local servers that tests, the demo and the benchmarks use.

Each server binds its own loopback port (port 0) and announces it on one output line, so callers
never race for a free port. Output is drained by a thread so a chatty child never blocks on a
full pipe.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

READY_RE = re.compile(r"\bREADY\b(?P<fields>.*)$")
FIELD_RE = re.compile(r"(\w+)=(\S+)")


def ready_fields(line: str) -> dict[str, str]:
    """The fields of a `READY key=value ...` line, or of a JSON log line whose message says
    READY (its other keys are the fields); {} for any other line."""
    if line.startswith("{"):
        try:
            data = json.loads(line)
        except ValueError:
            return {}
        if isinstance(data, dict) and READY_RE.search(str(data.get("msg", ""))):
            skip = {"ts", "level", "logger", "msg"}
            return {str(k): str(v) for k, v in data.items() if k not in skip}
        return {}
    match = READY_RE.search(line)
    return dict(FIELD_RE.findall(match.group("fields"))) if match else {}


class ProcessFailed(RuntimeError):
    """A child exited or stayed silent before announcing that it was ready."""


class ManagedProcess:
    """A child process that announces `READY key=value ...` on stdout or stderr once it serves."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 20.0,
        cwd: str | None = None,
        stop_signal: int = signal.SIGTERM,
        cpus: frozenset[int] | None = None,
    ) -> None:
        """`cpus`: the only CPUs the child may run on (None: this process's own)."""
        self.argv = list(argv)
        self.stop_signal = stop_signal
        self.lines: deque[str] = deque(maxlen=2000)
        self.ready: dict[str, str] = {}
        self._ready_event = threading.Event()
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            text=True,
            bufsize=1,
            preexec_fn=None if cpus is None else partial(os.sched_setaffinity, 0, cpus),
        )
        self._reader = threading.Thread(target=self._drain, daemon=True)
        try:
            self._reader.start()
            ready = self._ready_event.wait(ready_timeout_s) and bool(self.ready)
        except BaseException:
            # Interrupted while waiting (Ctrl-C, a test's timeout): the caller never gets this
            # object, so nothing else could stop the child.
            self.stop()
            raise
        if not ready:
            self.stop()
            raise ProcessFailed(f"{self.argv!r} did not become ready:\n{self.output()}")
        with _started_lock:
            _started.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if not self.ready:
                self.ready = ready_fields(line)
                if self.ready:
                    self._ready_event.set()
        self._ready_event.set()  # exited: wake a waiter so it can report the failure

    def output(self) -> str:
        return "\n".join(self.lines)

    def port(self, key: str = "port") -> int:
        """The port announced as `key=PORT` or `key=HOST:PORT`."""
        return int(self.ready[key].rsplit(":", 1)[-1])

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        """`stop_signal` (SIGTERM), then SIGKILL if it has not exited within `timeout_s`; returns
        the exit code."""
        terminate(self.proc, timeout_s, self.stop_signal)
        if self._reader.ident is not None:
            self._reader.join(timeout=2.0)
        return self.proc.returncode

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Every process started here and not yet collected: `running()` finds those still up, for a
# last-resort cleanup (the test session's end) of whatever a failed caller did not stop.
_started: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()
_started_lock = threading.Lock()


def running() -> list[ManagedProcess]:
    """The ManagedProcesses of this interpreter whose child has not exited."""
    with _started_lock:
        procs = list(_started)
    return [proc for proc in procs if proc.proc.poll() is None]


def terminate(
    proc: subprocess.Popen[Any], timeout_s: float = 10.0, sig: int = signal.SIGTERM
) -> None:
    """Stop a child: `sig` (after SIGCONT: a frozen child cannot handle it), then SIGKILL if it
    has not exited within `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


def gateway_process(
    policy_path: str | Path,
    env: dict[str, str] | None = None,
    *extra: str,
    cpus: frozenset[int] | None = None,
) -> ManagedProcess:
    """`gateway run` on a policy file (on `cpus` only, when given). Stopped by SIGINT, the
    gateway's quick stop: a test or benchmark has nobody to drain for (SIGTERM would wait out
    `drain.delay`)."""
    return ManagedProcess(
        python_module("gateway", "run", "--policy", str(policy_path), *extra),
        env=env,
        stop_signal=signal.SIGINT,
        cpus=cpus,
    )


def python_module(module: str, *args: str) -> list[str]:
    """argv running `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.01
) -> bool:
    """Poll a condition on another process's state (for use only where no event exists)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False
