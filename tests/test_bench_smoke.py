"""The overhead benchmark runs end to end in quick mode and records every figure.

Behaviour only: the run completes and the JSON holds positive figures and the ratio fields;
no assertion on how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from loadtests.bench.nginx import find_nginx
from loadtests.bench.wrk import find_wrk

REPO = Path(__file__).resolve().parent.parent
HAVE_NGINX = find_nginx() is not None
HAVE_WRK = find_wrk() is not None


def run_bench(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_overhead", "--quick", "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data: dict[str, Any] = json.loads(out.read_text())
    return data, done.stdout


def assert_positive(record: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = record[key]
        assert isinstance(value, int | float) and value > 0, (key, record)


def check_common(data: dict[str, Any], report: str) -> None:
    for heading in ("1. Throughput", "2. Latency", "3. Streaming"):
        assert heading in report

    throughput = data["throughput"]
    for name in ("direct", "gateway"):
        assert_positive(throughput["runs"][name], "rps", "p50_ms", "p99_ms", "requests")
    assert set(throughput["ratios"]) == {"gateway_vs_nginx", "gateway_vs_direct"}
    assert_positive(throughput["ratios"], "gateway_vs_direct")

    open_loop = data["open_loop"]
    for name in ("direct", "gateway"):
        run = open_loop["runs"][name]
        assert_positive(run, "sent")
        assert_positive(run["latency"], "count", "p50_ms", "p90_ms", "p99_ms", "max_ms")
    assert {"p50_ms", "p99_ms"} <= set(open_loop["added"])

    streaming = data["streaming"]
    for phase in ("sequential", "concurrent"):
        for name in ("direct", "gateway"):
            run = streaming[phase][name]
            assert_positive(run, "requests", "events", "wall_s")
            assert_positive(run["ttfb"], "count", "p50_ms", "p99_ms")
        assert {"added_ttfb_p50_ms", "added_ttfb_p99_ms"} <= set(streaming[phase])
    assert_positive(streaming["cpu"], "us_per_chunk")


def test_quick_run(tmp_path: Path) -> None:
    args = () if HAVE_NGINX else ("--skip-nginx",)
    data, report = run_bench(tmp_path, *args)
    check_common(data, report)
    throughput = data["throughput"]
    assert throughput["tool"] == ("wrk" if HAVE_WRK else "python")
    if HAVE_NGINX:
        assert_positive(throughput["runs"]["nginx"], "rps", "p50_ms", "p99_ms", "requests")
        assert_positive(throughput["ratios"], "gateway_vs_nginx")


def test_quick_run_without_wrk_or_nginx(tmp_path: Path) -> None:
    data, report = run_bench(tmp_path, "--skip-nginx", "--no-wrk")
    check_common(data, report)
    throughput = data["throughput"]
    assert throughput["tool"] == "python"
    assert "wrk not used" in report
    assert throughput["runs"]["nginx"] is None
    assert throughput["ratios"]["gateway_vs_nginx"] is None
