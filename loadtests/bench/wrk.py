"""Running wrk with a POST script, and reading its text report."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from loadtests.bench.results import Throughput

_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PERCENTILE = re.compile(r"^\s*(\d+(?:\.\d+)?)%\s+([\d.]+)(us|ms|s|m|h)\s*$", re.M)
_RPS = re.compile(r"^Requests/sec:\s+([\d.]+)", re.M)
_TOTAL = re.compile(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m|h)", re.M)
_SOCKET_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")
_NON_2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")


class WrkError(RuntimeError):
    """wrk failed or printed something this parser does not understand."""


def find_wrk() -> str | None:
    return shutil.which("wrk")


def write_post_script(directory: Path, body: bytes) -> Path:
    """A wrk Lua script sending `body` as a JSON POST on every request."""
    text = body.decode()
    # A Lua long bracket string needs no escaping as long as the text does not close it.
    if "]==]" in text:
        raise ValueError("the body cannot be embedded in the Lua script")
    script = directory / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [==[{text}]==]\n"
    )
    return script


def parse(output: str, connections: int) -> Throughput:
    """The figures of a `wrk --latency` report."""
    rps = _RPS.search(output)
    total = _TOTAL.search(output)
    percentiles = {float(p): float(v) * _UNITS_S[u] for p, v, u in _PERCENTILE.findall(output)}
    if rps is None or total is None or 50.0 not in percentiles or 99.0 not in percentiles:
        raise WrkError(f"unexpected wrk output:\n{output}")
    errors = 0
    socket_errors = _SOCKET_ERRORS.search(output)
    if socket_errors:
        errors += sum(int(n) for n in socket_errors.groups())
    non_2xx = _NON_2XX.search(output)
    if non_2xx:
        errors += int(non_2xx.group(1))
    return Throughput(
        tool="wrk",
        connections=connections,
        duration_s=float(total.group(2)) * _UNITS_S[total.group(3)],
        requests=int(total.group(1)),
        errors=errors,
        rps=float(rps.group(1)),
        p50_ms=percentiles[50.0] * 1000.0,
        p99_ms=percentiles[99.0] * 1000.0,
    )


def run(
    binary: str,
    url: str,
    script: Path,
    *,
    duration_s: int,
    connections: int = 64,
    threads: int = 1,
) -> Throughput:
    """One wrk run; the child inherits the caller's CPU affinity."""
    argv = [binary, f"-t{threads}", f"-c{connections}", f"-d{duration_s}s", "--latency"]
    argv += ["--timeout", "5s", "-s", str(script), url]
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=duration_s + 30,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise WrkError(f"wrk did not finish: {argv!r}") from exc
    if done.returncode != 0:
        raise WrkError(f"wrk exited with {done.returncode}:\n{done.stdout}{done.stderr}")
    return parse(done.stdout, connections)
