"""A real Prometheus on a loopback port (Debian's `prometheus`), scraping gateways every second
and evaluating rule files, for the tests of the dashboard's queries and the alert rules.

Its data lives in a temporary folder removed by `close()`; it listens on a held port (Go sets
SO_REUSEADDR, so it binds the held port).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from loadtests.ports import hold_port
from loadtests.procs import terminate

SCRAPE_INTERVAL_S = 1


class PrometheusServer:
    def __init__(
        self,
        targets: Sequence[str],
        rule_files: Sequence[Path] = (),
        ready_timeout_s: float = 30.0,
    ) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (scripts/install-system-deps)")
        self._dir = Path(tempfile.mkdtemp(prefix="prometheus-"))
        self._hold = hold_port()
        self.port = self._hold.port
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
            },
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [
                {"job_name": "gateway", "static_configs": [{"targets": list(targets)}]}
            ],
        }
        config_path = self._dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        argv = [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={self._dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def _get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            body = response.read()
        return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            try:
                self._get("/-/ready")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("prometheus did not become ready") from None
                time.sleep(0.1)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (raises on a query Prometheus refuses)."""
        answer = self._get("/api/v1/query", query=expr)
        if answer.get("status") != "success":
            raise ValueError(f"{expr}: {answer}")
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def scrapes(self) -> int:
        """How many scrapes of every target have succeeded (the fewest of any target)."""
        found = self.query("min(count_over_time(up[1h]) and on() (min(up) == 1))")
        return int(float(found[0]["value"][1])) if found else 0

    def alerts(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self._get("/api/v1/alerts")["data"]["alerts"]
        return found

    def rule_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self._get("/api/v1/rules")["data"]["groups"]
        return groups

    def close(self) -> None:
        proc, self.proc = self.proc, None
        try:
            if proc is not None:
                terminate(proc)
        finally:
            self._hold.close()
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
