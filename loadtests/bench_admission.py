"""Admission control, measured: a step from 100 % to 300 % of the backends' capacity, through the
gateway without admission and with it, in one run.

    python -m loadtests.bench_admission [--step-s 20] [--out loadtests/out/bench_admission.json]

Two fake vLLM instances run the engine model (`--max-running 8`: at most 8 requests generate at
once, the rest queue; a KV cache of `KV_TOKENS` tokens: a request that starts when it does not
fit fails with CUDA out of memory; decoding slows as the batch fills). Their capacity is
measured first, by a closed loop that keeps every batch full. Then each configuration gets
fresh backends and the same seeded traffic (20 % interactive, 30 % standard, 50 % batch):
`step_s` seconds at 100 % of capacity, then `step_s` at 300 %.

- **without admission**: the gateway with dynamic timeouts, retries and breakers only;
- **with admission**: the same plus `admission` with defaults, a KV-token budget of the cache's
  size (default overcommit 1.3: the gateway estimates a prompt at 4 bytes a token, and this
  fake counts a word, about 6.5 bytes, as one) and vLLM's load gauges scraped.

Reported per configuration and step: per class, requests, ok %, shed, p50/p99 of the ok ones;
and the OOMs the backends raised. Loopback only; every process it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests.ledger import JsonlWriter, read_records
from loadtests.loadgen import ClassSummary, Target, WorkloadSpec, per_class_summary, run_load
from loadtests.procs import ManagedProcess, gateway_process, python_module

MAX_RUNNING = 8
KV_TOKENS = 4000
BACKENDS = ("a", "b")
SPEC = WorkloadSpec(
    models=["m"],
    chat_share=0.7,
    stream_share=0.5,
    prompt_tokens=(100, 400),
    max_tokens=(50, 300),
    priorities=(("interactive", 0.2), ("standard", 0.3), ("batch", 0.5)),
    seed=7,
)
FAKE_ARGS = (
    "--max-running", str(MAX_RUNNING), "--kv-tokens", str(KV_TOKENS), "--batch-slowdown", "1.0",
    "--ttft", "0.05", "--per-token", "0.002",
)  # fmt: skip

WITHOUT = ""
WITH = f"""
    admission:
      tokens: {{capacity: {KV_TOKENS}}}
      vllm_signals: {{interval: 200ms, max_waiting: 0}}
"""


@contextmanager
def backends() -> Iterator[dict[str, ManagedProcess]]:
    started: dict[str, ManagedProcess] = {}
    try:
        for name in BACKENDS:
            started[name] = ManagedProcess(
                python_module(
                    "loadtests.fake_vllm", "--name", name, "--models", "m", "--seed", "3",
                    *FAKE_ARGS,
                )
            )  # fmt: skip
        yield started
    finally:
        for proc in started.values():
            proc.stop()


def url(proc: ManagedProcess) -> str:
    return f"http://127.0.0.1:{proc.port()}"


@contextmanager
def gateway(fakes: dict[str, ManagedProcess], pool_settings: str) -> Iterator[ManagedProcess]:
    instances = ", ".join(f'{{name: {n}, url: "{url(p)}"}}' for n, p in fakes.items())
    policy = f"""
listen: 127.0.0.1:0
admin: {{listen: 127.0.0.1:0}}
pools:
  chat:
    models: [m]
    instances: [{instances}]
{pool_settings}
"""
    path = Path(tempfile.mkdtemp(prefix="bench-admission-")) / "policy.yaml"
    path.write_text(policy)
    with gateway_process(path) as proc:
        yield proc


def scrape(url: str) -> str:
    return httpx.get(url, timeout=5).text


def ooms(fakes: dict[str, ManagedProcess]) -> int:
    return sum(
        int(httpx.get(f"{url(p)}/_fake/engine", timeout=5).json()["ooms"]) for p in fakes.values()
    )


async def measure_capacity(seconds: float, out: Path) -> float:
    """Requests per second the two backends complete with every batch kept full."""
    with backends() as fakes:
        targets = {"m": [Target(n, url(p)) for n, p in fakes.items()]}
        writer = JsonlWriter(out)
        try:
            stats = await run_load(
                SPEC,
                targets,
                writer,
                rate=1000.0,
                requests=100_000,
                time_limit=seconds,
                concurrency_cap=MAX_RUNNING * len(fakes),
                drain_timeout=30.0,
            )
        finally:
            writer.close()
        if stats.ok == 0:
            raise RuntimeError("the backends completed nothing")
        return stats.ok / seconds


async def step_run(
    name: str, pool_settings: str, capacity: float, step_s: float, out: Path
) -> dict[str, Any]:
    steps = ((0.0, capacity), (step_s, 3.0 * capacity))
    with backends() as fakes, gateway(fakes, pool_settings) as proc:
        base = f"http://{proc.ready['data']}"
        writer = JsonlWriter(out)
        try:
            stats = await run_load(
                SPEC,
                {"m": [Target("gateway", base, gateway=True)]},
                writer,
                rate_steps=steps,
                requests=1_000_000,
                time_limit=2 * step_s,
                drain_timeout=60.0,
                request_timeout=120.0,
            )
        finally:
            writer.close()
        backend_ooms = await asyncio.to_thread(ooms, fakes)
        metrics = await asyncio.to_thread(scrape, f"http://{proc.ready['admin']}/metrics")
    records = list(read_records(out))
    return {
        "name": name,
        "sent": stats.sent,
        "backend_ooms": backend_ooms,
        "queue_wait_p99_s": queue_wait_p99(metrics),
        "client_saw_oom": sum(r.oom for r in records),
        "at_100": _summaries(per_class_summary(records, until=step_s)),
        "at_300": _summaries(per_class_summary(records, since=step_s)),
    }


def queue_wait_p99(metrics: str) -> dict[str, float]:
    """Per class, the bucket bound under which 99 % of admitted requests waited (from the
    gateway's histogram; nothing for a gateway without admission)."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "gateway_admission_queue_wait_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets.setdefault(sample.labels["class"], []).append((bound, sample.value))
    result = {}
    for klass, counts in buckets.items():
        counts.sort()
        total = counts[-1][1]
        if total:
            result[klass] = next(bound for bound, count in counts if count >= 0.99 * total)
    return result


def _summaries(summaries: dict[str, ClassSummary]) -> dict[str, dict[str, Any]]:
    return {name: {**asdict(s), "ok_percent": s.ok_percent} for name, s in summaries.items()}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| config | step | class | requests | ok % | shed | p50 ms | p99 ms |",
        "|---|---|---|--:|--:|--:|--:|--:|",
    ]
    for result in results:
        for step in ("at_100", "at_300"):
            for klass in ("interactive", "standard", "batch"):
                s = result[step].get(klass)
                if s is None:
                    continue
                lines.append(
                    f"| {result['name']} | {step[3:]} % | {klass} | {s['count']} | "
                    f"{s['ok_percent']:.1f} | {s['shed']} | {_ms(s['p50_s'])} | {_ms(s['p99_s'])} |"
                )
    lines.append("")
    for result in results:
        waits = ", ".join(
            f"{klass} ≤ {_ms(bound)} ms" for klass, bound in result["queue_wait_p99_s"].items()
        )
        lines.append(
            f"{result['name']}: backend OOMs {result['backend_ooms']}, "
            f"OOM answers reaching clients {result['client_saw_oom']}"
            + (f"; queue wait p99 (whole run): {waits}" if waits else "")
        )
    return "\n".join(lines)


async def main_async(step_s: float, calibrate_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    capacity = await measure_capacity(calibrate_s, work / "capacity.jsonl")
    print(f"capacity: {capacity:.1f} req/s ({len(BACKENDS)} x max-running {MAX_RUNNING})")
    results = []
    for name, settings in (("without admission", WITHOUT), ("with admission", WITH)):
        results.append(await step_run(name, settings, capacity, step_s, work / f"{name}.jsonl"))
        print(f"{name}: done")
    return {"capacity_rps": capacity, "step_s": step_s, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-s", type=float, default=20.0, help="seconds per step")
    parser.add_argument("--calibrate-s", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("loadtests/out/bench_admission.json"))
    args = parser.parse_args()
    report = asyncio.run(main_async(args.step_s, args.calibrate_s))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(table(report["results"]))


if __name__ == "__main__":
    main()
