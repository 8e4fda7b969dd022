"""The gateway's overhead against a direct connection (and against nginx), measured in one run.

1. Throughput at fixed concurrency (wrk): direct to a fast fixed-body upstream, through an nginx
   proxy_pass, through the gateway; the proxies get one core each, the same one.
2. Latency at a fixed arrival rate (open loop): direct and through the gateway.
3. Streaming: time to first byte one stream at a time and with many concurrent streams, and the
   gateway's CPU time per relayed SSE chunk.

Every server is a child process on a loopback port of its own, stopped before the run ends.
Prints a plain-text report and writes every figure to a JSON file.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtests.bench import closedloop, openloop, streams, wrk
from loadtests.bench.client import chat_body
from loadtests.bench.cpu import (
    CLOCK_TICK_S,
    CpuTimes,
    Placement,
    choose_placement,
    cpu_times,
    pin_self,
)
from loadtests.bench.nginx import NginxServer, find_nginx, fixed_body_config, proxy_config
from loadtests.bench.report import render, write_json
from loadtests.bench.results import Throughput
from loadtests.bench.servers import start_fake_backend, start_gateway, url_of
from loadtests.fake_vllm.responses import fixed_chat_body

CHAT_PATH = "/v1/chat/completions"
FIXED_MODEL = "bench-model"
STREAM_MODEL = "bench-stream"
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "bench_overhead.json"

# The project's bars (DESIGN.md): reported as met / not met, never enforced here.
GATEWAY_VS_NGINX_MIN = 0.10
ADDED_TTFB_TARGET_MS = 1.0
CPU_PER_CHUNK_TARGET_US = 15.0
STREAM_PER_TOKEN_S = 0.001

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
        quick=quick,
    )


@dataclass(frozen=True)
class Rig:
    """Everything started for the run, as URLs (and the gateway's pid for CPU accounting)."""

    upstream_url: str
    upstream_kind: str
    proxy_url: str | None
    gateway_url: str
    gateway_pid: int
    stream_url: str


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
    else:
        fixed = start_fake_backend("fixed", FIXED_MODEL, "--fixed-body")
        stack.callback(fixed.stop)
        upstream_url = url_of(fixed)
        upstream_kind = "fake vLLM --fixed-body (nginx not used)"
        proxy_url = None
    streamer = start_fake_backend(
        "stream", STREAM_MODEL, "--ttft", "0", "--per-token", str(STREAM_PER_TOKEN_S)
    )
    stack.callback(streamer.stop)
    stream_url = url_of(streamer)
    pools = {"fixed": (FIXED_MODEL, upstream_url), "stream": (STREAM_MODEL, stream_url)}
    gateway = start_gateway(tmp, pools, placement.proxy_core)
    stack.callback(gateway.stop)
    return Rig(
        upstream_url=upstream_url,
        upstream_kind=upstream_kind,
        proxy_url=proxy_url,
        gateway_url=url_of(gateway, "data"),
        gateway_pid=gateway.pid,
        stream_url=stream_url,
    )


def _ratio(numerator: Json | None, denominator: Json | None) -> float | None:
    if numerator is None or denominator is None or denominator["rps"] <= 0:
        return None
    return float(numerator["rps"]) / float(denominator["rps"])


def throughput_section(rig: Rig, settings: Settings, tmp: Path) -> Json:
    body = chat_body(FIXED_MODEL, max_tokens=16)
    wrk_binary = wrk.find_wrk() if settings.use_wrk else None
    c = settings.connections
    if wrk_binary is not None:
        script = wrk.write_post_script(tmp, body)
        description = f"wrk -t1 -c{c} -d{settings.duration_s}s --latency, POST {CHAT_PATH}"
        note = None

        def measure(url: str, seconds: int) -> Throughput:
            return wrk.run(wrk_binary, url, script, duration_s=seconds, connections=c)
    else:
        description = f"Python/aiohttp, {c} connections, {settings.duration_s} s, POST {CHAT_PATH}"
        note = (
            "wrk not used: the Python generator saturates long before nginx does, so these "
            "figures (and ratios) partly measure the client"
        )

        def measure(url: str, seconds: int) -> Throughput:
            return closedloop.run(url, body, duration_s=seconds, connections=c)

    targets = {"direct": rig.upstream_url, "nginx": rig.proxy_url, "gateway": rig.gateway_url}
    runs: dict[str, Json | None] = {}
    for name, base in targets.items():
        if base is None:
            runs[name] = None
            continue
        if settings.warmup_s:
            measure(base + CHAT_PATH, settings.warmup_s)  # connections open, caches warm
        runs[name] = asdict(measure(base + CHAT_PATH, settings.duration_s))
    vs_nginx = _ratio(runs["gateway"], runs["nginx"])
    return {
        "tool": "wrk" if wrk_binary else "python",
        "tool_description": description,
        "note": note,
        "upstream": rig.upstream_kind,
        "connections": c,
        "duration_s": settings.duration_s,
        "runs": runs,
        "ratios": {
            "gateway_vs_nginx": vs_nginx,
            "gateway_vs_direct": _ratio(runs["gateway"], runs["direct"]),
        },
        "bar": {
            "gateway_vs_nginx_min": GATEWAY_VS_NGINX_MIN,
            "met": None if vs_nginx is None else vs_nginx >= GATEWAY_VS_NGINX_MIN,
        },
    }


def open_loop_section(rig: Rig, settings: Settings) -> Json:
    body = chat_body(FIXED_MODEL, max_tokens=16)
    runs: dict[str, Json] = {}
    for name, base in (("direct", rig.upstream_url), ("gateway", rig.gateway_url)):
        url = base + CHAT_PATH
        openloop.run(url, body, rate=settings.rate, duration_s=settings.open_loop_warmup_s)
        result = openloop.run(url, body, rate=settings.rate, duration_s=settings.open_loop_s)
        runs[name] = asdict(result)
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

    seq = pair(settings.sequential_streams, 1)
    conc = pair(settings.concurrent_streams, settings.concurrent_streams)
    # Long streams make per-request costs negligible next to the per-chunk ones.
    sustained = streams.run(
        gateway_url,
        chat_body(STREAM_MODEL, stream=True, max_tokens=settings.sustained_tokens),
        warm,
        requests=settings.sustained_streams,
        concurrency=settings.sustained_streams,
        cpu_probe=probe,
    )
    phases = {
        "one at a time": _cpu_per_chunk(seq[1], idle_per_s),
        f"{settings.concurrent_streams} concurrent": _cpu_per_chunk(conc[1], idle_per_s),
        f"sustained ({settings.sustained_streams} x {settings.sustained_tokens} tokens)": (
            _cpu_per_chunk(sustained, idle_per_s)
        ),
    }
    per_chunk = _cpu_per_chunk(sustained, idle_per_s)["us_per_chunk"]
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
            "target_us": CPU_PER_CHUNK_TARGET_US,
            "met": None if per_chunk is None else per_chunk <= CPU_PER_CHUNK_TARGET_US,
        },
    }


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
    sections: list[tuple[str, Callable[[Rig, Path], Json]]] = [
        ("throughput", lambda rig, tmp: throughput_section(rig, settings, tmp)),
        ("open_loop", lambda rig, tmp: open_loop_section(rig, settings)),
        ("streaming", lambda rig, tmp: streaming_section(rig, settings)),
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
    sys.stdout.write(render(data))
    print(f"figures written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
