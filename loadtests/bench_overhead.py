"""The gateway's overhead against a direct connection (and against nginx), measured in one run.

1. Throughput at fixed concurrency (wrk): direct to a fast fixed-body upstream, through an nginx
   proxy_pass, through the gateway; the proxies get one core each, the same one. Each proxy's
   CPU time per request (its processes' utime + stime over the requests it served): on a
   shared machine far steadier than requests per second.
2. Latency at a fixed arrival rate (open loop): direct and through the gateway.
3. Streaming: time to first byte one stream at a time and with many concurrent streams, and the
   gateway's CPU time per relayed SSE chunk, beside nginx's relaying the same streams.
4. Stream resume's cost: CPU per relayed chunk with resume on and off (the same long streams,
   side by side), and memory per open stream, each in a gateway of its own.
5. Tracing's cost: the gateway's throughput (as in 1) and added latency (as in 2) with tracing
   off, with tracing on and every request sampled, and with one request in ten sampled (the
   ratio a busy production gateway runs at), spans exported over OTLP/HTTP to receivers in
   processes of their own (`loadtests.otlp_sink`), which count the spans that arrive.

Every server is a child process on a loopback port of its own, stopped before the run ends.
Prints a plain-text report and writes every figure to a JSON file.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtests.bench import closedloop, openloop, streams, wrk
from loadtests.bench.client import chat_body
from loadtests.bench.cpu import (
    CLOCK_TICK_S,
    CpuTimes,
    Placement,
    choose_placement,
    cpu_times,
    pin_process,
    pin_self,
    tree_cpu_times,
)
from loadtests.bench.nginx import NginxServer, find_nginx, fixed_body_config, proxy_config
from loadtests.bench.report import render, table, write_json
from loadtests.bench.results import Throughput
from loadtests.bench.servers import (
    gateway_policy,
    start_bare_proxy,
    start_fake_backend,
    start_gateway,
    url_of,
)
from loadtests.fake_vllm.responses import fixed_chat_body
from loadtests.procs import ManagedProcess, ProcessFailed, gateway_process, python_module

CHAT_PATH = "/v1/chat/completions"
FIXED_MODEL = "bench-model"
STREAM_MODEL = "bench-stream"
# The same streams in a pool with stream resume off, to weigh what resume costs.
PLAIN_MODEL = "bench-stream-plain"
PLAIN_POOL_SETTINGS = {"plain": "resume: false"}
# Open streams held at once while the gateway's memory is read, and their length.
MEMORY_STREAMS = 100
MEMORY_TOKENS = 1000
# Alternate rounds of long streams with resume on and off (each: `sustained_streams` streams).
RESUME_ROUNDS = 3
RESUME_ROUNDS_QUICK = 1
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "bench_overhead.json"

# The project's bars (DESIGN.md): reported as met / not met, never enforced here.
GATEWAY_VS_NGINX_MIN = 0.25
ADDED_TTFB_TARGET_MS = 1.0
CPU_PER_REQUEST_TARGET_US = 90.0
CPU_PER_CHUNK_TARGET_US = 8.0
# Tracing every request may cost at most this share of the gateway's throughput (reported only).
TRACING_COST_MAX = 0.10
STREAM_PER_TOKEN_S = 0.001

# The traced gateway's exporter: OTLP over HTTP/protobuf, every request sampled (ratio 1.0).
# Set explicitly so that OTEL_* variables of the calling shell cannot change what is measured;
# the batch processor's OTEL_BSP_* settings are inherited (SDK defaults unless set).
TRACED_SERVICE = "bench-gateway"
TRACING_SAMPLER = "parentbased_always_on"
# The second traced gateway: a request's trace is sampled by its id, one in ten (a client's
# own sampled flag still wins: parent-based).
SAMPLED_SAMPLER = "parentbased_traceidratio"
SAMPLED_RATIO = 0.1
BSP_DEFAULTS = {
    "OTEL_BSP_SCHEDULE_DELAY": "5000",
    "OTEL_BSP_MAX_QUEUE_SIZE": "2048",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "512",
    "OTEL_BSP_EXPORT_TIMEOUT": "30000",
}

Json = dict[str, Any]


@dataclass(frozen=True)
class Settings:
    duration_s: int  # per wrk run
    warmup_s: int  # before each wrk run, discarded (0: none)
    connections: int
    rate: float
    open_loop_s: float
    open_loop_warmup_s: float
    stream_tokens: int
    sequential_streams: int
    concurrent_streams: int
    sustained_streams: int
    sustained_tokens: int
    idle_s: float
    use_nginx: bool
    use_wrk: bool
    tracing: bool
    quick: bool


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_overhead",
        description="Gateway overhead against a direct connection and nginx proxy_pass.",
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run (10)")
    parser.add_argument("--rate", type=float, default=500.0, help="open-loop req/s (500)")
    parser.add_argument("--quick", action="store_true", help="short phases: a smoke run")
    parser.add_argument("--skip-nginx", action="store_true", help="no nginx upstream/reference")
    parser.add_argument(
        "--skip-tracing", action="store_true", help="no tracing on/off comparison (phase 4)"
    )
    parser.add_argument(
        "--no-wrk", action="store_true", help="use the Python generator even if wrk is installed"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    if args.duration < 1 or args.rate <= 0:
        parser.error("--duration must be >= 1 and --rate > 0")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    quick: bool = args.quick
    return Settings(
        duration_s=1 if quick else args.duration,
        warmup_s=0 if quick else 2,
        connections=64,
        rate=args.rate,
        open_loop_s=1.0 if quick else float(args.duration),
        open_loop_warmup_s=0.2 if quick else 1.0,
        stream_tokens=50,
        sequential_streams=20 if quick else 200,
        concurrent_streams=50 if quick else 200,
        sustained_streams=10 if quick else 20,
        sustained_tokens=500 if quick else 2000,
        idle_s=0.3 if quick else 2.0,
        use_nginx=not args.skip_nginx and find_nginx() is not None,
        use_wrk=not args.no_wrk and wrk.find_wrk() is not None,
        tracing=not args.skip_tracing,
        quick=quick,
    )


@dataclass(frozen=True)
class Rig:
    """Everything started for the run, as URLs (and the gateway's pid for CPU accounting)."""

    upstream_url: str
    upstream_kind: str
    proxy_url: str | None
    proxy_pid: int | None  # nginx's master (its worker is its child)
    # nginx proxy_pass in front of the streaming backend, buffering off (None: no nginx).
    stream_proxy_url: str | None
    stream_proxy_pid: int | None
    gateway_url: str
    gateway_pid: int
    stream_url: str
    pools: Mapping[str, tuple[str, str]]  # the gateway's: pool -> (model, upstream URL)
    # Bare ASGI + aiohttp proxies (no resilience): in front of the streaming backend, and of
    # the throughput runs' upstream.
    bare_url: str
    bare_pid: int
    bare_fixed_url: str
    bare_fixed_pid: int


def start_rig(stack: ExitStack, tmp: Path, settings: Settings, placement: Placement) -> Rig:
    """Upstreams first, then the proxies in front of them; `stack` stops them in reverse."""
    nginx = find_nginx() if settings.use_nginx else None
    if nginx is not None:
        body = fixed_chat_body()
        upstream = NginxServer(
            nginx,
            lambda prefix, port: fixed_body_config(prefix, port, placement.load_core, body),
            name="upstream",
        )
        stack.callback(upstream.stop)
        upstream_url = f"http://127.0.0.1:{upstream.port}"
        upstream_kind = "nginx, fixed JSON body (return 200), 1 worker"
        proxy = NginxServer(
            nginx,
            lambda prefix, port: proxy_config(prefix, port, placement.proxy_core, upstream.port),
            name="proxy",
        )
        stack.callback(proxy.stop)
        proxy_url: str | None = f"http://127.0.0.1:{proxy.port}"
        proxy_pid: int | None = proxy.pid
    else:
        fixed = start_fake_backend("fixed", FIXED_MODEL, "--fixed-body")
        stack.callback(fixed.stop)
        upstream_url = url_of(fixed)
        upstream_kind = "fake vLLM --fixed-body (nginx not used)"
        proxy_url = proxy_pid = None
    streamer = start_fake_backend(
        "stream",
        f"{STREAM_MODEL},{PLAIN_MODEL}",
        *("--ttft", "0", "--per-token", str(STREAM_PER_TOKEN_S)),
    )
    stack.callback(streamer.stop)
    stream_url = url_of(streamer)
    stream_proxy_url = stream_proxy_pid = None
    if nginx is not None:
        stream_proxy = NginxServer(
            nginx,
            lambda prefix, port: proxy_config(
                prefix, port, placement.proxy_core, streamer.port(), streaming=True
            ),
            name="stream-proxy",
        )
        stack.callback(stream_proxy.stop)
        stream_proxy_url = f"http://127.0.0.1:{stream_proxy.port}"
        stream_proxy_pid = stream_proxy.pid
    pools = {
        "fixed": (FIXED_MODEL, upstream_url),
        "stream": (STREAM_MODEL, stream_url),
        "plain": (PLAIN_MODEL, stream_url),
    }
    gateway = start_gateway(tmp, pools, placement.proxy_core, PLAIN_POOL_SETTINGS)
    stack.callback(gateway.stop)
    bare = start_bare_proxy(stream_url, placement.proxy_core)
    stack.callback(bare.stop)
    bare_fixed = start_bare_proxy(upstream_url, placement.proxy_core)
    stack.callback(bare_fixed.stop)
    return Rig(
        upstream_url=upstream_url,
        upstream_kind=upstream_kind,
        proxy_url=proxy_url,
        proxy_pid=proxy_pid,
        stream_proxy_url=stream_proxy_url,
        stream_proxy_pid=stream_proxy_pid,
        gateway_url=url_of(gateway, "data"),
        gateway_pid=gateway.pid,
        stream_url=stream_url,
        pools=pools,
        bare_url=url_of(bare),
        bare_pid=bare.pid,
        bare_fixed_url=url_of(bare_fixed),
        bare_fixed_pid=bare_fixed.pid,
    )


def _ratio(numerator: Json | None, denominator: Json | None) -> float | None:
    if numerator is None or denominator is None or denominator["rps"] <= 0:
        return None
    return float(numerator["rps"]) / float(denominator["rps"])


@dataclass(frozen=True)
class ThroughputTool:
    """The fixed-concurrency load generator of the throughput runs: wrk, or the Python one."""

    name: str  # "wrk" or "python"
    description: str
    note: str | None
    measure: Callable[[str, int], Throughput]  # (URL, seconds) -> one run

    def run(self, base_url: str, settings: Settings) -> Json:
        """A discarded warm-up run (connections open, caches warm), then the measured one."""
        return self.run_counted(base_url, settings)[0]

    def run_counted(self, base_url: str, settings: Settings) -> tuple[Json, int]:
        """`run`, and the requests completed in both runs, the warm-up's included."""
        warm = 0
        if settings.warmup_s:
            warm = self.measure(base_url + CHAT_PATH, settings.warmup_s).requests
        measured = self.measure(base_url + CHAT_PATH, settings.duration_s)
        return asdict(measured), warm + measured.requests


def throughput_tool(settings: Settings, tmp: Path) -> ThroughputTool:
    body = chat_body(FIXED_MODEL, max_tokens=16)
    wrk_binary = wrk.find_wrk() if settings.use_wrk else None
    c = settings.connections
    if wrk_binary is not None:
        script = wrk.write_post_script(tmp, body)

        def run_wrk(url: str, seconds: int) -> Throughput:
            return wrk.run(wrk_binary, url, script, duration_s=seconds, connections=c)

        return ThroughputTool(
            name="wrk",
            description=f"wrk -t1 -c{c} -d{settings.duration_s}s --latency, POST {CHAT_PATH}",
            note=None,
            measure=run_wrk,
        )

    def run_python(url: str, seconds: int) -> Throughput:
        return closedloop.run(url, body, duration_s=seconds, connections=c)

    return ThroughputTool(
        name="python",
        description=f"Python/aiohttp, {c} connections, {settings.duration_s} s, POST {CHAT_PATH}",
        note=(
            "wrk not used: the Python generator saturates long before nginx does, so these "
            "figures (and ratios) partly measure the client"
        ),
        measure=run_python,
    )


def throughput_section(rig: Rig, settings: Settings, tmp: Path) -> Json:
    tool = throughput_tool(settings, tmp)
    c = settings.connections
    targets = {
        "direct": rig.upstream_url,
        "nginx": rig.proxy_url,
        "bare": rig.bare_fixed_url,
        "gateway": rig.gateway_url,
    }
    pids = {"nginx": rig.proxy_pid, "bare": rig.bare_fixed_pid, "gateway": rig.gateway_pid}
    runs: dict[str, Json | None] = {}
    cpu: dict[str, Json] = {}
    for name, base in targets.items():
        if base is None:
            runs[name] = None
            continue
        pid = pids.get(name)
        before = tree_cpu_times(pid) if pid is not None else None
        runs[name], served = tool.run_counted(base, settings)
        if pid is not None and before is not None:
            cpu[name] = _cpu_per_request(tree_cpu_times(pid) - before, served)
    vs_nginx = _ratio(runs["gateway"], runs["nginx"])
    gateway_us = cpu.get("gateway", {}).get("us_per_request")
    nginx_us = cpu.get("nginx", {}).get("us_per_request")
    return {
        "tool": tool.name,
        "tool_description": tool.description,
        "note": tool.note,
        "upstream": rig.upstream_kind,
        "connections": c,
        "duration_s": settings.duration_s,
        "runs": runs,
        "ratios": {
            "gateway_vs_nginx": vs_nginx,
            "gateway_vs_direct": _ratio(runs["gateway"], runs["direct"]),
            # What the resilience costs: the same stack (uvicorn, aiohttp) without any of it.
            "gateway_vs_bare": _ratio(runs["gateway"], runs["bare"]),
        },
        "bar": {
            "gateway_vs_nginx_min": GATEWAY_VS_NGINX_MIN,
            "met": None if vs_nginx is None else vs_nginx >= GATEWAY_VS_NGINX_MIN,
        },
        # CPU per request of each proxy, warm-up and measured runs together.
        "cpu": {
            "per_proxy": cpu,
            "gateway_over_nginx": gateway_us / nginx_us if gateway_us and nginx_us else None,
            "target_us": CPU_PER_REQUEST_TARGET_US,
            "met": None if gateway_us is None else gateway_us <= CPU_PER_REQUEST_TARGET_US,
        },
    }


def _cpu_per_request(cpu: CpuTimes, requests: int) -> Json:
    """A proxy's CPU time over the requests it served (at saturation, its idle work is
    negligible next to them: nothing is subtracted)."""
    return {
        "requests": requests,
        "cpu_ms": cpu.total_s * 1000.0,
        "us_per_request": cpu.total_s / requests * 1e6 if requests else None,
        "user_us_per_request": cpu.user_s / requests * 1e6 if requests else None,
        "system_us_per_request": cpu.system_s / requests * 1e6 if requests else None,
    }


def open_loop_run(base_url: str, settings: Settings) -> Json:
    """A discarded warm-up at the same rate, then the measured open-loop run."""
    return open_loop_run_counted(base_url, settings)[0]


def open_loop_run_counted(base_url: str, settings: Settings) -> tuple[Json, int]:
    """`open_loop_run`, and the requests sent in both runs, the warm-up's included."""
    body = chat_body(FIXED_MODEL, max_tokens=16)
    url = base_url + CHAT_PATH
    warm = openloop.run(url, body, rate=settings.rate, duration_s=settings.open_loop_warmup_s)
    measured = openloop.run(url, body, rate=settings.rate, duration_s=settings.open_loop_s)
    return asdict(measured), warm.sent + measured.sent


def open_loop_section(rig: Rig, settings: Settings) -> Json:
    runs = {
        "direct": open_loop_run(rig.upstream_url, settings),
        "gateway": open_loop_run(rig.gateway_url, settings),
    }
    direct, gateway = runs["direct"]["latency"], runs["gateway"]["latency"]
    return {
        "rate": settings.rate,
        "duration_s": settings.open_loop_s,
        "runs": runs,
        "added": {
            "p50_ms": gateway["p50_ms"] - direct["p50_ms"],
            "p99_ms": gateway["p99_ms"] - direct["p99_ms"],
        },
    }


def _compare(direct: streams.StreamPhase, gateway: streams.StreamPhase) -> Json:
    added_p50 = gateway.ttfb.p50_ms - direct.ttfb.p50_ms
    return {
        "direct": asdict(direct),
        "gateway": asdict(gateway),
        "added_ttfb_p50_ms": added_p50,
        "added_ttfb_p99_ms": gateway.ttfb.p99_ms - direct.ttfb.p99_ms,
        "met": added_p50 <= ADDED_TTFB_TARGET_MS,
    }


def _cpu_per_chunk(phase: streams.StreamPhase, idle_per_s: float) -> Json:
    """The gateway's CPU time per relayed HTTP chunk (one write each) and per SSE event."""
    cpu = phase.cpu or CpuTimes(0.0, 0.0)
    cpu_s = max(0.0, cpu.total_s - idle_per_s * phase.wall_s)

    def per(seconds: float, count: int) -> float | None:
        return seconds / count * 1e6 if count else None

    return {
        "streams": phase.requests,
        "events": phase.events,
        "http_chunks": phase.http_chunks,
        "wall_s": phase.wall_s,
        "cpu_ms": cpu_s * 1000.0,
        "us_per_chunk": per(cpu_s, phase.http_chunks),
        "us_per_event": per(cpu_s, phase.events),
        # Raw split, before the idle baseline: user = Python and the event loop, system = syscalls.
        "user_us_per_chunk": per(cpu.user_s, phase.http_chunks),
        "system_us_per_chunk": per(cpu.system_s, phase.http_chunks),
    }


def streaming_section(rig: Rig, settings: Settings) -> Json:
    tokens = settings.stream_tokens
    body = chat_body(STREAM_MODEL, stream=True, max_tokens=tokens)
    warm = chat_body(STREAM_MODEL, stream=True, max_tokens=1)
    direct_url, gateway_url = rig.stream_url + CHAT_PATH, rig.gateway_url + CHAT_PATH

    def probe() -> CpuTimes:
        return cpu_times(rig.gateway_pid)

    # The gateway's own background work (timers, health checks), to subtract from phases.
    before = probe()
    time.sleep(settings.idle_s)
    idle_per_s = (probe() - before).total_s / settings.idle_s

    def pair(requests: int, concurrency: int) -> tuple[streams.StreamPhase, streams.StreamPhase]:
        direct = streams.run(direct_url, body, warm, requests=requests, concurrency=concurrency)
        gateway = streams.run(
            gateway_url, body, warm, requests=requests, concurrency=concurrency, cpu_probe=probe
        )
        return direct, gateway

    def sustained_through(url: str, cpu_probe: Callable[[], CpuTimes]) -> streams.StreamPhase:
        """Long streams, at once: per-request costs negligible next to the per-chunk ones."""
        return streams.run(
            url,
            chat_body(STREAM_MODEL, stream=True, max_tokens=settings.sustained_tokens),
            warm,
            requests=settings.sustained_streams,
            concurrency=settings.sustained_streams,
            cpu_probe=cpu_probe,
        )

    seq = pair(settings.sequential_streams, 1)
    conc = pair(settings.concurrent_streams, settings.concurrent_streams)
    sustained = sustained_through(gateway_url, probe)
    phases = {
        "one at a time": _cpu_per_chunk(seq[1], idle_per_s),
        f"{settings.concurrent_streams} concurrent": _cpu_per_chunk(conc[1], idle_per_s),
        f"sustained ({settings.sustained_streams} x {settings.sustained_tokens} tokens)": (
            _cpu_per_chunk(sustained, idle_per_s)
        ),
    }
    # The same long streams through the bare proxy on the same core: the floor of the stack.
    bare = sustained_through(rig.bare_url + CHAT_PATH, lambda: cpu_times(rig.bare_pid))
    bare_cpu = _cpu_per_chunk(bare, 0.0)
    per_chunk = _cpu_per_chunk(sustained, idle_per_s)["us_per_chunk"]
    floor = bare_cpu["us_per_chunk"]
    # And through nginx proxy_pass (buffering off), same core: what a tuned proxy pays.
    nginx_cpu: Json | None = None
    if rig.stream_proxy_url is not None and rig.stream_proxy_pid is not None:
        proxy_pid = rig.stream_proxy_pid
        nginx_phase = sustained_through(
            rig.stream_proxy_url + CHAT_PATH, lambda: tree_cpu_times(proxy_pid)
        )
        nginx_cpu = _cpu_per_chunk(nginx_phase, 0.0)
    nginx_us = None if nginx_cpu is None else nginx_cpu["us_per_chunk"]
    # What keeping streams resumable costs: the same long streams with resume on and off, in
    # alternate rounds (a single pair is at the mercy of the machine's moods), medians.
    on_off: dict[str, list[float]] = {STREAM_MODEL: [], PLAIN_MODEL: []}
    for _ in range(RESUME_ROUNDS_QUICK if settings.quick else RESUME_ROUNDS):
        for model, runs in on_off.items():
            phase = streams.run(
                gateway_url,
                chat_body(model, stream=True, max_tokens=settings.sustained_tokens),
                chat_body(model, stream=True, max_tokens=1),
                requests=settings.sustained_streams,
                concurrency=settings.sustained_streams,
                cpu_probe=probe,
            )
            us = _cpu_per_chunk(phase, idle_per_s)["us_per_chunk"]
            if us is not None:
                runs.append(us)
    on_runs, off_runs = on_off[STREAM_MODEL], on_off[PLAIN_MODEL]
    resume_on = statistics.median(on_runs) if on_runs else None
    plain_per_chunk = statistics.median(off_runs) if off_runs else None
    return {
        "max_tokens": tokens,
        "per_token_s": STREAM_PER_TOKEN_S,
        "added_ttfb_target_ms": ADDED_TTFB_TARGET_MS,
        "sequential": _compare(*seq),
        "concurrent": _compare(*conc),
        "sustained": asdict(sustained),
        "cpu": {
            "cpu_tick_s": CLOCK_TICK_S,
            "idle_cpu_ms_per_s": idle_per_s * 1000.0,
            "phases": phases,
            "us_per_chunk": per_chunk,
            "bare_proxy": bare_cpu,
            "over_bare": None if per_chunk is None or not floor else per_chunk / floor,
            "nginx": nginx_cpu,
            "over_nginx": None if per_chunk is None or not nginx_us else per_chunk / nginx_us,
            "target_us": CPU_PER_CHUNK_TARGET_US,
            "met": None if per_chunk is None else per_chunk <= CPU_PER_CHUNK_TARGET_US,
            "resume_on_us_per_chunk": resume_on,
            "resume_off_us_per_chunk": plain_per_chunk,
            "resume_rounds": {"on": on_runs, "off": off_runs},
            "resume_cost": (
                None
                if resume_on is None or not plain_per_chunk
                else resume_on / plain_per_chunk - 1.0
            ),
        },
    }


def _rss_bytes(pid: int) -> int:
    """A process's resident memory, from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _memory_per_stream(
    tmp: Path, rig: Rig, placement: Placement, resume: bool, settings: Settings
) -> Json:
    """A fresh gateway's resident memory while `MEMORY_STREAMS` long streams are open at
    once, above what it held before, per stream: with or without keeping them resumable."""
    model = STREAM_MODEL if resume else PLAIN_MODEL
    pools = {"memory": (model, rig.stream_url)}
    extra = None if resume else {"memory": "resume: false"}
    name = f"memory-{'on' if resume else 'off'}.yaml"
    gateway = start_gateway(tmp, pools, placement.proxy_core, extra, name=name)
    try:
        url = url_of(gateway, "data") + CHAT_PATH
        count = 20 if settings.quick else MEMORY_STREAMS
        body = chat_body(model, stream=True, max_tokens=MEMORY_TOKENS)
        warm = chat_body(model, stream=True, max_tokens=1)
        streams.run(url, warm, warm, requests=count, concurrency=count)
        baseline = _rss_bytes(gateway.pid)
        peak = [baseline]
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.01):
                peak[0] = max(peak[0], _rss_bytes(gateway.pid))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            phase = streams.run(url, body, warm, requests=count, concurrency=count)
        finally:
            done.set()
            watcher.join()
        return {
            "streams": count,
            "tokens": MEMORY_TOKENS,
            "errors": phase.errors,
            "baseline_mib": baseline / 2**20,
            "peak_mib": peak[0] / 2**20,
            "kib_per_stream": (peak[0] - baseline) / count / 1024,
        }
    finally:
        gateway.stop()


def memory_section(rig: Rig, settings: Settings, tmp: Path, placement: Placement) -> Json:
    """Memory per open stream, resume on vs off, each in a gateway of its own."""
    off = _memory_per_stream(tmp, rig, placement, False, settings)
    on = _memory_per_stream(tmp, rig, placement, True, settings)
    return {"resume_on": on, "resume_off": off}


def tracing_env(
    sink_url: str, sampler: str = TRACING_SAMPLER, ratio: float | None = None
) -> dict[str, str]:
    """A traced gateway's exporter settings, over whatever OTEL_* the caller's shell has."""
    env = {
        "OTEL_SDK_DISABLED": "false",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{sink_url}/v1/traces",
        "OTEL_TRACES_SAMPLER": sampler,
    }
    if ratio is not None:
        env["OTEL_TRACES_SAMPLER_ARG"] = f"{ratio:g}"
    return env


def exporter_settings() -> Json:
    """The batch processor's and exporter's settings the traced gateway inherits."""
    compression = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION")
        or os.environ.get("OTEL_EXPORTER_OTLP_COMPRESSION")
        or "none"
    )
    bsp = {name: os.environ.get(name) or default for name, default in BSP_DEFAULTS.items()}
    return {"batch_processor": bsp, "compression": compression}


def start_traced_gateway(
    directory: Path,
    pools: Mapping[str, tuple[str, str]],
    cpu: int | None,
    env: dict[str, str],
    name: str = "traced",
) -> ManagedProcess:
    """Another gateway, the first's policy plus `telemetry.tracing: true`, moved to `cpu`."""
    policy = directory / f"gateway-policy-{name}.yaml"
    telemetry = f"telemetry: {{tracing: true, service_name: {TRACED_SERVICE}}}\n"
    policy.write_text(gateway_policy(pools) + telemetry)
    gateway = gateway_process(policy, env)
    try:
        pin_process(gateway.pid, cpu)
    except BaseException:
        gateway.stop()
        raise
    return gateway


def _get(port: int, path: str) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def sink_stats(port: int) -> Json:
    status, text = _get(port, "/stats")
    if status != 200:
        raise RuntimeError(f"OTLP sink /stats answered {status}: {text}")
    stats: Json = json.loads(text)
    return stats


def served_counts(admin_port: int) -> tuple[int, int] | None:
    """(client requests, upstream attempts) as the gateway counted them on /metrics; None if
    the admin plane does not answer (an admin token in the environment, say)."""
    try:
        status, text = _get(admin_port, "/metrics")
    except OSError:
        return None
    if status != 200:
        return None
    totals = {"gateway_requests_total": 0.0, "gateway_upstream_attempts_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return int(totals["gateway_requests_total"]), int(totals["gateway_upstream_attempts_total"])


def _latency_added(run: Json, direct_latency: Json) -> Json:
    latency = run["latency"]
    return {
        "p50_ms": latency["p50_ms"] - direct_latency["p50_ms"],
        "p99_ms": latency["p99_ms"] - direct_latency["p99_ms"],
    }


def _spans(sent: int, served: tuple[int, int] | None, before_exit: Json, received: Json) -> Json:
    requests, attempts = served if served is not None else (None, None)
    expected = None if served is None else sum(served)
    spans: int = received["spans"]
    missing = None if expected is None else expected - spans
    per_request_of = requests if requests else sent
    return {
        "requests_sent": sent,  # by the load generators, warm-ups included
        "requests_served": requests,  # by the gateway's own count: one SERVER span each
        "upstream_attempts": attempts,  # one CLIENT span each
        "expected": expected,
        "received": spans,
        "received_before_exit": before_exit["spans"],
        "by_kind": received["spans_by_kind"],
        "exports": received["requests"],
        "rejected_exports": received["rejected"],
        "per_request": spans / per_request_of if per_request_of else None,
        # Spans the batch processor dropped (queue full, by design) never reach the receiver;
        # so would spans still queued when the gateway's flush at exit (3 s at most) ran out.
        "missing": None if missing is None else max(0, missing),
        "unexpected": None if missing is None else max(0, -missing),
    }


def tracing_section(
    rig: Rig, settings: Settings, tmp: Path, placement: Placement, direct_latency: Json
) -> Json:
    """Tracing off (the rig's gateway) against tracing on (a second, identical one that
    exports every span) and tracing on at one request in ten (a third), back to back:
    throughput as in 1, then latency as in 2. Added latency is against `direct_latency`, the
    direct run of 2."""
    tool = throughput_tool(settings, tmp)
    with ExitStack() as stack:
        # The receivers inherit the load CPU: decoding spans is the collector's work, not the
        # gateway's. The gateway's own cost (spans, encoding, export) stays on its CPU.
        sink = ManagedProcess(python_module("loadtests.otlp_sink", "--port", "0"))
        stack.callback(sink.stop)
        sampled_sink = ManagedProcess(python_module("loadtests.otlp_sink", "--port", "0"))
        stack.callback(sampled_sink.stop)
        traced = start_traced_gateway(
            tmp, rig.pools, placement.proxy_core, tracing_env(url_of(sink))
        )
        stack.callback(traced.stop)
        targets = {"off": rig.gateway_url, "on": url_of(traced, "data")}
        throughput: dict[str, Json] = {}
        latency: dict[str, Json] = {}
        sent = dict.fromkeys(targets, 0)
        for name, base in targets.items():
            throughput[name], count = tool.run_counted(base, settings)
            sent[name] += count
        for name, base in targets.items():
            latency[name], count = open_loop_run_counted(base, settings)
            sent[name] += count
        served = served_counts(traced.port("admin"))
        before_exit = sink_stats(sink.port())
        exit_code = traced.stop()  # SIGTERM: the gateway exports what it still holds, then exits
        received = sink_stats(sink.port())
        # The sampled gateway starts once the first has exported all it held and left its
        # CPU: nothing of the first's export runs during its measurement.
        sampled_env = tracing_env(url_of(sampled_sink), SAMPLED_SAMPLER, SAMPLED_RATIO)
        sampled = start_traced_gateway(tmp, rig.pools, placement.proxy_core, sampled_env, "sampled")
        stack.callback(sampled.stop)
        throughput["on_sampled"], _ = tool.run_counted(url_of(sampled, "data"), settings)
        latency["on_sampled"], _ = open_loop_run_counted(url_of(sampled, "data"), settings)
        sampled_served = served_counts(sampled.port("admin"))
        sampled.stop()
        sampled_received = sink_stats(sampled_sink.port())
        # The SDK's stock exporter (its own protobuf encoder) on the same batch processor, every
        # request sampled: what the gateway's encoder saves (throughput only).
        sdk_sink = ManagedProcess(python_module("loadtests.otlp_sink", "--port", "0"))
        stack.callback(sdk_sink.stop)
        sdk_env = {**tracing_env(url_of(sdk_sink)), "GATEWAY_OTLP_ENCODER": "sdk"}
        sdk = start_traced_gateway(tmp, rig.pools, placement.proxy_core, sdk_env, "sdk")
        stack.callback(sdk.stop)
        throughput["on_sdk_encoder"], _ = tool.run_counted(url_of(sdk, "data"), settings)
        sdk.stop()
        sdk_received = sink_stats(sdk_sink.port())
    on_vs_off = _ratio(throughput["on"], throughput["off"])
    cost = None if on_vs_off is None else 1.0 - on_vs_off
    off_latency, on_latency = latency["off"]["latency"], latency["on"]["latency"]
    sampled_vs_off = _ratio(throughput["on_sampled"], throughput["off"])
    sampled_latency = latency["on_sampled"]["latency"]
    sampled_expected = None if sampled_served is None else sum(sampled_served)
    sdk_vs_off = _ratio(throughput["on_sdk_encoder"], throughput["off"])
    return {
        "exporter": "OTLP HTTP/protobuf, BatchSpanProcessor",
        "sampler": TRACING_SAMPLER,
        "sample_ratio": 1.0,
        "service_name": TRACED_SERVICE,
        **exporter_settings(),
        "receiver": "loadtests.otlp_sink (own process, on the load CPU)",
        "traced_gateway_exit_code": exit_code,
        "throughput": {
            "tool": tool.name,
            "tool_description": tool.description,
            "duration_s": settings.duration_s,
            "warmup_s": settings.warmup_s,
            "runs": throughput,
            "on_vs_off": on_vs_off,
            "cost": cost,
            "bar": {
                "cost_max": TRACING_COST_MAX,
                "met": None if cost is None else cost <= TRACING_COST_MAX,
            },
        },
        "latency": {
            "rate": settings.rate,
            "duration_s": settings.open_loop_s,
            "runs": latency,
            "direct": {key: direct_latency[key] for key in ("p50_ms", "p99_ms")},
            "added": {name: _latency_added(run, direct_latency) for name, run in latency.items()},
            "tracing_adds": {
                "p50_ms": on_latency["p50_ms"] - off_latency["p50_ms"],
                "p99_ms": on_latency["p99_ms"] - off_latency["p99_ms"],
            },
        },
        "spans": _spans(sent["on"], served, before_exit, received),
        "sampled": {
            "sampler": SAMPLED_SAMPLER,
            "sample_ratio": SAMPLED_RATIO,
            "on_vs_off": sampled_vs_off,
            "cost": None if sampled_vs_off is None else 1.0 - sampled_vs_off,
            "tracing_adds": {
                "p50_ms": sampled_latency["p50_ms"] - off_latency["p50_ms"],
                "p99_ms": sampled_latency["p99_ms"] - off_latency["p99_ms"],
            },
            "spans": {
                "received": sampled_received["spans"],
                "all_spans": sampled_expected,  # had every request been sampled
                "share": (
                    sampled_received["spans"] / sampled_expected if sampled_expected else None
                ),
                "rejected_exports": sampled_received["rejected"],
            },
        },
        "sdk_encoder": {
            "on_vs_off": sdk_vs_off,
            "cost": None if sdk_vs_off is None else 1.0 - sdk_vs_off,
            "spans_received": sdk_received["spans"],
            "rejected_exports": sdk_received["rejected"],
        },
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f} ms"


def render_tracing(section: Json | None) -> str:
    """Phase 4 of the plain-text report (the other phases are `render`'s)."""
    title = (
        "5. Tracing cost, off vs on (every request sampled, and one in ten; and every request "
        "sampled with the SDK's own encoder)"
    )
    if section is None:
        return f"{title}: skipped (--skip-tracing)\n"
    if "error" in section:
        return f"{title}: FAILED\n  {section['error']}\n"
    bsp = section["batch_processor"]
    tput, lat, spans = section["throughput"], section["latency"], section["spans"]
    tput_rows = [
        [
            name,
            _fmt(run["rps"], 1),
            _fmt(run["p50_ms"], 3),
            _fmt(run["p99_ms"], 3),
            _fmt(run["errors"]),
        ]
        for name, run in tput["runs"].items()
    ]
    lat_rows = [
        [
            name,
            _fmt(run["sent"]),
            _fmt(run["errors"]),
            _fmt(run["latency"]["p50_ms"], 3),
            _fmt(run["latency"]["p99_ms"], 3),
            _ms(lat["added"][name]["p50_ms"]),
            _ms(lat["added"][name]["p99_ms"]),
        ]
        for name, run in lat["runs"].items()
    ]
    warmup = f"{tput['warmup_s']} s warm-up before each" if tput["warmup_s"] else "no warm-up"
    cost, met = tput["cost"], tput["bar"]["met"]
    verdict = "n/a" if met is None else ("met" if met else "NOT met")
    cost_text = "-" if cost is None else f"{cost * 100:.1f} %"
    kinds = ", ".join(f"{kind} {count:,}" for kind, count in spans["by_kind"].items()) or "none"
    if spans["requests_served"] is None:
        served = f"{spans['requests_sent']:,} requests sent (the gateway's count unavailable)"
        accounting = "  dropped: unknown (no count of the gateway's requests and attempts)"
    else:
        served = (
            f"{spans['requests_served']:,} requests served, "
            f"{spans['upstream_attempts']:,} upstream attempts "
            f"({spans['requests_sent']:,} sent by the load generators)"
        )
        missing = spans["missing"]
        if missing:
            share = missing / spans["expected"] * 100.0
            accounting = (
                f"  DROPPED: {missing:,} of {spans['expected']:,} expected spans "
                f"({share:.2f} %) never arrived: the batch processor's queue was full "
                "(it drops by design rather than slow or grow the gateway)"
            )
        else:
            accounting = f"  dropped: none ({spans['expected']:,} expected, all received)"
        if spans["unexpected"]:
            accounting += f"; {spans['unexpected']:,} more spans than requests + attempts"
    lines = [
        title,
        f"   exporter: {section['exporter']} to {section['receiver']}",
        f"   sampler {section['sampler']} (ratio {section['sample_ratio']:g}); queue "
        f"{bsp['OTEL_BSP_MAX_QUEUE_SIZE']}, batch {bsp['OTEL_BSP_MAX_EXPORT_BATCH_SIZE']}, "
        f"delay {bsp['OTEL_BSP_SCHEDULE_DELAY']} ms, compression {section['compression']}",
        f"   throughput ({tput['tool_description']}; {warmup})",
        table(["tracing", "req/s", "p50 ms", "p99 ms", "errors"], tput_rows),
        f"  tracing on / off: {_fmt(tput['on_vs_off'], 3)}, throughput cost {cost_text}"
        f"   (bar <= {tput['bar']['cost_max'] * 100:g} %: {verdict})",
        f"   latency ({lat['rate']:g} req/s for {lat['duration_s']:g} s, open loop; "
        f"added = gateway - direct, direct p50 {lat['direct']['p50_ms']:.3f} ms, "
        f"p99 {lat['direct']['p99_ms']:.3f} ms, from 2.)",
        table(
            ["tracing", "sent", "errors", "p50 ms", "p99 ms", "added p50", "added p99"],
            lat_rows,
        ),
        f"  tracing adds: p50 {_ms(lat['tracing_adds']['p50_ms'])}, "
        f"p99 {_ms(lat['tracing_adds']['p99_ms'])}",
        f"   spans: {spans['received']:,} received ({kinds}) in {spans['exports']:,} "
        f"exports, {spans['rejected_exports']:,} rejected",
        f"  for {served}: {_fmt(spans['per_request'], 3)} spans per request",
        accounting,
        *_render_sampled(section["sampled"]),
        *_render_sdk_encoder(section["sdk_encoder"]),
    ]
    return "\n".join(lines) + "\n"


def _render_sdk_encoder(sdk: Json) -> list[str]:
    cost = sdk["cost"]
    return [
        "   the SDK's own encoder (GATEWAY_OTLP_ENCODER=sdk, every request sampled), the "
        "on_sdk_encoder row above",
        f"  tracing on / off: {_fmt(sdk['on_vs_off'], 3)}, throughput cost "
        f"{'-' if cost is None else f'{cost * 100:.1f} %'}; {sdk['spans_received']:,} spans "
        f"received, {sdk['rejected_exports']:,} exports rejected",
    ]


def _render_sampled(sampled: Json) -> list[str]:
    cost = sampled["cost"]
    spans = sampled["spans"]
    share = spans["share"]
    return [
        f"   sampled: {sampled['sampler']} (ratio {sampled['sample_ratio']:g}), the on_sampled "
        "rows above",
        f"  tracing on / off: {_fmt(sampled['on_vs_off'], 3)}, throughput cost "
        f"{'-' if cost is None else f'{cost * 100:.1f} %'}; adds p50 "
        f"{_ms(sampled['tracing_adds']['p50_ms'])}, p99 {_ms(sampled['tracing_adds']['p99_ms'])}",
        f"  spans: {spans['received']:,} received, "
        f"{'-' if share is None else f'{share * 100:.1f} %'} of all "
        f"({_fmt(spans['all_spans'])} had every request been sampled)",
    ]


def run_benchmark(settings: Settings, placement: Placement) -> Json:
    data: Json = {
        "meta": {
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpu_placement": placement.describe(),
            "proxy_cpu": placement.proxy_core,
            "load_cpu": placement.load_core,
            "quick": settings.quick,
            "python": sys.version.split()[0],
            "settings": asdict(settings),
        }
    }

    def tracing(rig: Rig, tmp: Path) -> Json | None:
        if not settings.tracing:
            return None
        direct_latency = data["open_loop"]["runs"]["direct"]["latency"]
        try:
            return tracing_section(rig, settings, tmp, placement, direct_latency)
        except ProcessFailed as error:  # keep the other figures: report why this one is missing
            print(f"[bench] tracing phase failed: {error}", file=sys.stderr, flush=True)
            return {"error": str(error)}

    sections: list[tuple[str, Callable[[Rig, Path], Json | None]]] = [
        ("throughput", lambda rig, tmp: throughput_section(rig, settings, tmp)),
        ("open_loop", lambda rig, tmp: open_loop_section(rig, settings)),
        ("streaming", lambda rig, tmp: streaming_section(rig, settings)),
        ("memory", lambda rig, tmp: memory_section(rig, settings, tmp, placement)),
        ("tracing", tracing),
    ]
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-overhead-")))
        rig = start_rig(stack, tmp, settings, placement)
        for name, section in sections:
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            data[name] = section(rig, tmp)
    return data


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    placement = choose_placement()
    # Children inherit this thread's affinity: upstreams, wrk and the Python generators share
    # the load CPU; the gateway and the nginx proxy are moved to the proxy CPU explicitly.
    pin_self(placement.load_core)
    data = run_benchmark(settings, placement)
    write_json(args.out, data)  # first: the figures survive a rendering problem
    sys.stdout.write(render(data) + "\n" + render_tracing(data["tracing"]))
    print(f"figures written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
