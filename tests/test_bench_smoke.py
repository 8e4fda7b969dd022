"""The overhead benchmark runs end to end in quick mode and records every figure.

Behaviour only: the run completes and the JSON holds positive figures and the ratio fields;
no assertion on how fast anything is.
"""

from __future__ import annotations

import gzip
import http.client
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from loadtests.bench.nginx import find_nginx
from loadtests.bench.wrk import find_wrk
from loadtests.procs import ManagedProcess, python_module

REPO = Path(__file__).resolve().parent.parent
HAVE_NGINX = find_nginx() is not None
HAVE_WRK = find_wrk() is not None
# The longer benchmarks' own bounds. pytest's per-test timeout is set well above each, so a
# benchmark that hangs is stopped by its bound, with its output, before pytest gives up.
QUICK_TIMEOUT_S = 150
ADMISSION_TIMEOUT_S = 180
OPERATIONS_TIMEOUT_S = 120


def run_bench(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_overhead", "--quick", "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
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
    for heading in ("1. Throughput", "2. Latency", "3. Streaming", "4. Memory"):
        assert heading in report

    throughput = data["throughput"]
    for name in ("direct", "bare", "gateway"):
        assert_positive(throughput["runs"][name], "rps", "p50_ms", "p99_ms", "requests")
    assert set(throughput["ratios"]) == {"gateway_vs_nginx", "gateway_vs_direct", "gateway_vs_bare"}
    assert_positive(throughput["ratios"], "gateway_vs_direct", "gateway_vs_bare")
    for name in ("bare", "gateway"):
        cpu = throughput["cpu"]["per_proxy"][name]
        assert_positive(cpu, "requests", "cpu_ms", "us_per_request")
        # Every request the load generator completed (warm-up and measured runs), no other.
        assert cpu["requests"] >= throughput["runs"][name]["requests"]
    assert "CPU time per request" in report

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
    assert_positive(streaming["cpu"], "us_per_chunk", "over_bare")
    assert_positive(streaming["cpu"]["bare_proxy"], "streams", "events", "http_chunks")
    assert_positive(streaming["cpu"], "resume_on_us_per_chunk", "resume_off_us_per_chunk")
    assert isinstance(streaming["cpu"]["resume_cost"], float)
    assert "4. Memory per open stream" in report
    for name in ("resume_on", "resume_off"):
        run = data["memory"][name]
        assert run["errors"] == 0
        assert_positive(run, "streams", "baseline_mib", "peak_mib")


def check_tracing(section: dict[str, Any], report: str) -> None:
    assert "5. Tracing cost" in report
    for name in ("off", "on", "on_sampled"):
        assert_positive(section["throughput"]["runs"][name], "rps", "p50_ms", "p99_ms", "requests")
        run = section["latency"]["runs"][name]
        assert_positive(run, "sent")
        assert_positive(run["latency"], "count", "p50_ms", "p99_ms")
        assert {"p50_ms", "p99_ms"} <= set(section["latency"]["added"][name])
    assert_positive(section["throughput"], "on_vs_off")
    assert {"p50_ms", "p99_ms"} == set(section["latency"]["tracing_adds"])
    # Every span the receiver counted decoded; the ones missing were dropped by the exporter's
    # queue (allowed: it drops by design when full), none appeared from nowhere.
    spans = section["spans"]
    assert_positive(spans, "received", "requests_sent", "requests_served", "exports")
    assert spans["rejected_exports"] == 0
    assert spans["unexpected"] == 0
    assert spans["received"] + spans["missing"] == spans["expected"]
    assert spans["expected"] == spans["requests_served"] + spans["upstream_attempts"]
    assert set(spans["by_kind"]) == {"SERVER", "CLIENT"}
    # One request in ten sampled: some spans, far fewer than all (a trace's spans go together).
    sampled = section["sampled"]
    assert sampled["sample_ratio"] == 0.1 and sampled["spans"]["rejected_exports"] == 0
    assert_positive(sampled, "on_vs_off")
    assert 0 < sampled["spans"]["received"] < sampled["spans"]["all_spans"] / 3
    assert "sampled: parentbased_traceidratio (ratio 0.1)" in report
    # The SDK's own encoder, every request sampled: its spans arrive too.
    sdk = section["sdk_encoder"]
    assert_positive(section["throughput"]["runs"]["on_sdk_encoder"], "rps", "requests")
    assert_positive(sdk, "on_vs_off", "spans_received")
    assert sdk["rejected_exports"] == 0
    assert "the SDK's own encoder (GATEWAY_OTLP_ENCODER=sdk" in report


@pytest.mark.timeout(QUICK_TIMEOUT_S + 60)
def test_quick_run(tmp_path: Path) -> None:
    args = () if HAVE_NGINX else ("--skip-nginx",)
    data, report = run_bench(tmp_path, *args)
    check_common(data, report)
    check_tracing(data["tracing"], report)
    throughput = data["throughput"]
    assert throughput["tool"] == ("wrk" if HAVE_WRK else "python")
    if HAVE_NGINX:
        assert_positive(throughput["runs"]["nginx"], "rps", "p50_ms", "p99_ms", "requests")
        assert_positive(throughput["ratios"], "gateway_vs_nginx")
        # CPU per request and per relayed chunk, the gateway beside nginx.
        assert_positive(throughput["cpu"]["per_proxy"]["nginx"], "requests", "us_per_request")
        assert_positive(throughput["cpu"], "gateway_over_nginx")
        stream_cpu = data["streaming"]["cpu"]
        assert_positive(stream_cpu["nginx"], "streams", "http_chunks", "us_per_chunk")
        assert_positive(stream_cpu, "over_nginx")
        assert "the same streams through nginx proxy_pass (proxy_buffering off)" in report


@pytest.mark.timeout(QUICK_TIMEOUT_S + 60)
def test_quick_run_without_wrk_or_nginx(tmp_path: Path) -> None:
    data, report = run_bench(tmp_path, "--skip-nginx", "--no-wrk", "--skip-tracing")
    check_common(data, report)
    assert data["tracing"] is None
    assert "5. Tracing cost, off vs on" in report
    assert "): skipped (--skip-tracing)" in report
    throughput = data["throughput"]
    assert throughput["tool"] == "python"
    assert "wrk not used" in report
    assert throughput["runs"]["nginx"] is None
    assert throughput["ratios"]["gateway_vs_nginx"] is None
    assert "nginx" not in throughput["cpu"]["per_proxy"]
    assert throughput["cpu"]["gateway_over_nginx"] is None
    assert data["streaming"]["cpu"]["nginx"] is None


def test_otlp_sink_counts_spans() -> None:
    """The receiver of phase 4 decodes gzip bodies, counts spans by kind, rejects garbage."""
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    for kind in (Span.SPAN_KIND_SERVER, Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_CLIENT):
        spans.add(name="span", kind=kind)
    protobuf = {"Content-Type": "application/x-protobuf"}
    gzipped = {**protobuf, "Content-Encoding": "gzip"}
    with ManagedProcess(python_module("loadtests.otlp_sink", "--port", "0")) as sink:
        connection = http.client.HTTPConnection("127.0.0.1", sink.port(), timeout=5)

        def exchange(
            method: str, path: str, body: bytes, headers: dict[str, str]
        ) -> tuple[int, bytes]:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()

        try:
            status, answer = exchange(
                "POST", "/v1/traces", gzip.compress(request.SerializeToString()), gzipped
            )
            assert status == 200, answer
            assert ExportTraceServiceResponse.FromString(answer) == ExportTraceServiceResponse()
            assert exchange("POST", "/v1/traces", b"\xff", protobuf)[0] == 400
            status, answer = exchange("GET", "/stats", b"", {})
            assert status == 200, answer
        finally:
            connection.close()
        assert sink.stop() == 0
    assert json.loads(answer) == {
        "requests": 1,
        "spans": 3,
        "spans_by_kind": {"CLIENT": 2, "SERVER": 1},
        "rejected": 1,
    }


@pytest.mark.timeout(ADMISSION_TIMEOUT_S + 60)
def test_the_admission_step_benchmark_runs_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "admission.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtests.bench_admission",
            "--step-s",
            "1",
            "--calibrate-s",
            "1",
            "--traffic",
            "whole",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=ADMISSION_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["capacity_rps"] > 0
    without, default, tokens = report["results"]
    assert [r["name"] for r in report["results"]] == [
        "without admission",
        "default admission",
        "with KV tokens",
    ]
    for result in report["results"]:
        assert result["traffic"] == "whole" and result["sent"] > 0
        assert set(result["at_300"]) == {"interactive", "standard", "batch"}
        assert result["goodput"]["at_300"]["rps"] > 0
    # Only the gateways with admission have queues to report.
    assert without["queue_wait_p99_s"] == {}
    for result in (default, tokens):
        assert set(result["queue_wait_p99_s"]) == {"interactive", "standard", "batch"}
    assert "| whole | default admission | 300 % | interactive |" in done.stdout


@pytest.mark.timeout(OPERATIONS_TIMEOUT_S + 60)
def test_the_operations_benchmark_loses_no_request_to_reloads_or_a_drain() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtests.bench_operations",
            "--rate",
            "20",
            "--reloads",
            "2",
            "--interval-s",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=OPERATIONS_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    reloads, drain = report["reloads"], report["drain"]
    assert reloads["requests"] > 0 and reloads["failed"] == {}
    assert reloads["reloads"] == {"api": 1, "SIGHUP": 1}
    assert drain["in_flight_at_sigterm"] > 0 and drain["failed"] == {}
    assert drain["exit_code"] == 0
