"""Admission control, measured: a step from 100 % to 300 % of the backends' capacity, through the
gateway without admission and with it, in one run, for a mixed traffic and for whole answers.

    python -m loadtests.bench_admission [--step-s 20] [--traffic mixed --traffic whole]
        [--out loadtests/out/bench_admission.json]

Two fake vLLM instances run the engine model (`--max-running 8`: at most 8 requests generate at
once, the rest queue; a KV cache of `KV_TOKENS` tokens: a request that starts when it does not
fit fails with CUDA out of memory; decoding slows as the batch fills). Their capacity is
measured first, by a closed loop that keeps every batch full. Then each configuration gets
fresh backends and the same seeded traffic (20 % interactive, 30 % standard, 50 % batch; half
of it streamed, or none of it: `--traffic`): `step_s` seconds at 100 % of capacity, then
`step_s` at 300 %.

- **without admission**: `admission: false`, the gateway with dynamic timeouts, retries and
  breakers only;
- **default admission**: the policy says nothing of admission (adaptive limits, the engines'
  gauges read);
- **with KV tokens**: the same plus `tokens`, a KV-token budget per instance of the size its
  engine reports (default overcommit 1.3: the gateway estimates a prompt at 4 bytes a token,
  and this fake counts a word, about 6.5 bytes, as one).

Reported per configuration and step: per class, requests, ok %, shed, p50/p99 of the ok ones;
per step, the goodput (requests answered well per second, and their output tokens per second);
and the OOMs the backends raised. Loopback only; every process it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from contextlib import AbstractContextManager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests.engine_pool import engines, gateway, one_pool_policy, url
from loadtests.ledger import JsonlWriter, Record, read_records
from loadtests.loadgen import ClassSummary, Target, WorkloadSpec, per_class_summary, run_load
from loadtests.procs import ManagedProcess

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

CONFIGS = {
    "without admission": "    admission: false\n",
    "default admission": "",
    "with KV tokens": "    admission: {tokens: {}}\n",
}
TRAFFIC = {"mixed": 0.5, "whole": 0.0}


def backends() -> AbstractContextManager[dict[str, ManagedProcess]]:
    return engines(BACKENDS, FAKE_ARGS)


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
    name: str, pool_settings: str, capacity: float, step_s: float, out: Path, stream_share: float
) -> dict[str, Any]:
    steps = ((0.0, capacity), (step_s, 3.0 * capacity))
    spec = replace(SPEC, stream_share=stream_share)
    with backends() as fakes, gateway(one_pool_policy(fakes, pool_settings)) as proc:
        base = f"http://{proc.ready['data']}"
        writer = JsonlWriter(out)
        try:
            stats = await run_load(
                spec,
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
        "goodput": {
            "at_100": goodput(records, 0.0, step_s),
            "at_300": goodput(records, step_s, 2 * step_s),
        },
    }


def goodput(records: list[Record], since: float, until: float) -> dict[str, float]:
    """Requests answered well, and their output tokens, per second of the step: those whose
    answer ended in [since, until), whenever they were sent (what a throughput meter shows)."""
    ok = [r for r in records if r.ok and since <= r.t + (r.total or 0.0) < until]
    span = until - since
    return {"rps": len(ok) / span, "tokens_per_s": sum(r.max_tokens for r in ok) / span}


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
        "| traffic | config | step | class | requests | ok % | shed | p50 ms | p99 ms |",
        "|---|---|---|---|--:|--:|--:|--:|--:|",
    ]
    for result in results:
        for step in ("at_100", "at_300"):
            for klass in ("interactive", "standard", "batch"):
                s = result[step].get(klass)
                if s is None:
                    continue
                lines.append(
                    f"| {result['traffic']} | {result['name']} | {step[3:]} % | {klass} | "
                    f"{s['count']} | {s['ok_percent']:.1f} | {s['shed']} | {_ms(s['p50_s'])} | "
                    f"{_ms(s['p99_s'])} |"
                )
    lines += [
        "",
        "| traffic | config | goodput at 100 %: ok/s, tokens/s | at 300 %: ok/s, tokens/s "
        "| backend OOMs | OOMs reaching clients |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for result in results:
        at_100, at_300 = result["goodput"]["at_100"], result["goodput"]["at_300"]
        lines.append(
            f"| {result['traffic']} | {result['name']} | {at_100['rps']:.1f}, "
            f"{at_100['tokens_per_s']:,.0f} | {at_300['rps']:.1f}, {at_300['tokens_per_s']:,.0f} "
            f"| {result['backend_ooms']} | {result['client_saw_oom']} |"
        )
    lines.append("")
    for result in results:
        waits = ", ".join(
            f"{klass} ≤ {_ms(bound)} ms" for klass, bound in result["queue_wait_p99_s"].items()
        )
        if waits:
            lines.append(
                f"{result['traffic']}, {result['name']}: queue wait p99 (whole run): {waits}"
            )
    return "\n".join(lines)


async def main_async(
    step_s: float, calibrate_s: float, traffic: list[str], configs: list[str]
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    capacity = await measure_capacity(calibrate_s, work / "capacity.jsonl")
    print(f"capacity: {capacity:.1f} req/s ({len(BACKENDS)} x max-running {MAX_RUNNING})")
    results = []
    for mix in traffic:
        for name in configs:
            out = work / f"{mix}-{name}.jsonl"
            result = await step_run(name, CONFIGS[name], capacity, step_s, out, TRAFFIC[mix])
            results.append({"traffic": mix, **result})
            print(f"{mix}, {name}: done")
    return {"capacity_rps": capacity, "step_s": step_s, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-s", type=float, default=20.0, help="seconds per step")
    parser.add_argument("--calibrate-s", type=float, default=10.0)
    parser.add_argument("--traffic", action="append", choices=sorted(TRAFFIC))
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS))
    parser.add_argument("--out", type=Path, default=Path("loadtests/out/bench_admission.json"))
    args = parser.parse_args()
    report = asyncio.run(
        main_async(
            args.step_s,
            args.calibrate_s,
            args.traffic or list(TRAFFIC),
            args.config or list(CONFIGS),
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(table(report["results"]))


if __name__ == "__main__":
    main()
