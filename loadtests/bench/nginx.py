"""nginx as the benchmark's fast fixed-body upstream and as the proxy_pass reference.

Each server runs from its own temporary prefix (config, pid file, logs, temp paths), in the
foreground (`daemon off`), in its own session so a forced stop can take its worker along.
nginx cannot announce a port it picked itself, so its port is chosen first: outside the kernel's
ephemeral range and held until the server stops (loadtests/ports.py), so that nothing else can
take it before nginx binds it (nginx sets SO_REUSEADDR, which lets it bind next to the hold).
Should nginx fail to start all the same, it is tried again a few times, each on a new port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from loadtests.ports import PortHold, hold_port

NGINX_CANDIDATES = (
    "nginx",
    "/usr/sbin/nginx",
    "/usr/local/sbin/nginx",
    "/usr/local/nginx/sbin/nginx",
)


class NginxFailed(RuntimeError):
    """nginx exited or did not accept connections in time."""


def find_nginx() -> str | None:
    for candidate in NGINX_CANDIDATES:
        path = shutil.which(candidate)
        if path:
            return path
    return None


def _quote(text: str) -> str:
    """A single-quoted nginx string. nginx has no escape for `$` (variables), so refuse it."""
    if "$" in text:
        raise ValueError("nginx strings cannot contain '$'")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _affinity(cpu: int | None) -> str:
    # worker_cpu_affinity takes a bit mask written in binary, lowest CPU rightmost.
    return "" if cpu is None else f"worker_cpu_affinity {1 << cpu:b};"


def _config(prefix: Path, port: int, cpu: int | None, server_body: str, http_extra: str) -> str:
    p = str(prefix)
    return f"""
worker_processes 1;
{_affinity(cpu)}
pid {p}/nginx.pid;
error_log {p}/error.log warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {p}/client_body;
    proxy_temp_path {p}/proxy;
    fastcgi_temp_path {p}/fastcgi;
    uwsgi_temp_path {p}/uwsgi;
    scgi_temp_path {p}/scgi;
    # Long-lived keep-alive connections: the benchmark measures requests, not reconnects.
    keepalive_requests 10000000;
    keepalive_timeout 120s;
    {http_extra}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        {server_body}
    }}
}}
"""


def fixed_body_config(prefix: Path, port: int, cpu: int | None, body: bytes) -> str:
    """Answers every request at once with `body` as JSON (the request body is discarded)."""
    server = f"""
        location / {{
            default_type application/json;
            return 200 {_quote(body.decode())};
        }}"""
    return _config(prefix, port, cpu, server, "")


def proxy_config(
    prefix: Path, port: int, cpu: int | None, upstream_port: int, streaming: bool = False
) -> str:
    """A plain keep-alive reverse proxy: what a well-tuned proxy_pass costs per request.
    `streaming`: tuned for SSE as nginx's users tune it, each chunk passed on as it comes
    (`proxy_buffering off`)."""
    upstream = f"""
    upstream bench_upstream {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
        keepalive_requests 10000000;
        keepalive_timeout 120s;
    }}"""
    buffering = "proxy_buffering off;" if streaming else ""
    server = f"""
        location / {{
            proxy_pass http://bench_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            {buffering}
        }}"""
    return _config(prefix, port, cpu, server, upstream)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class NginxServer:
    """One nginx master + worker in a temporary prefix; `stop()` removes the prefix too."""

    def __init__(
        self,
        binary: str,
        render: Callable[[Path, int], str],
        *,
        name: str,
        start_timeout_s: float = 10.0,
        attempts: int = 3,
    ) -> None:
        self.prefix = Path(tempfile.mkdtemp(prefix=f"bench-nginx-{name}-"))
        # Workers run as an unprivileged user when the master is root: let them reach
        # their temp paths inside the prefix.
        if os.geteuid() == 0:
            self.prefix.chmod(0o711)
        self.proc: subprocess.Popen[bytes] | None = None
        self._hold: PortHold | None = None
        self.port = 0
        try:
            for _ in range(attempts):
                self._release_port()
                self._hold = hold_port()
                self.port = self._hold.port
                conf = self.prefix / "nginx.conf"
                conf.write_text(render(self.prefix, self.port))
                if self._start(binary, conf, start_timeout_s):
                    return
            raise NginxFailed(f"nginx ({name}) did not start:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _start(self, binary: str, conf: Path, timeout_s: float) -> bool:
        argv = [binary, "-p", str(self.prefix), "-e", str(self.prefix / "error.log")]
        argv += ["-c", str(conf), "-g", "daemon off;"]
        with open(self.prefix / "stdout.log", "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._terminate()  # its worker, if it got that far
                return False  # most likely it could not bind its port: try another
            # nginx writes its pid file once its listening sockets are open: with the pid of
            # this nginx in it, what accepts on the port is this nginx, not another server.
            if self._pid_written() and _accepts(self.port):
                return True
            time.sleep(0.02)
        self._terminate()
        return False

    def _pid_written(self) -> bool:
        assert self.proc is not None
        try:
            return (self.prefix / "nginx.pid").read_text().strip() == str(self.proc.pid)
        except OSError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        text = ""
        for name in ("stdout.log", "error.log"):
            path = self.prefix / name
            if path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _terminate(self, timeout_s: float = 5.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # fast shutdown of master and worker
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)
        # The session we created holds the worker too: nothing of ours may outlive the stop.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(timeout_s)
        self.proc = None

    def _release_port(self) -> None:
        if self._hold is not None:
            self._hold.close()
            self._hold = None

    def stop(self) -> None:
        try:
            self._terminate()
        finally:
            self._release_port()
            shutil.rmtree(self.prefix, ignore_errors=True)
