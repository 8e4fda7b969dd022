"""The burst a minimal policy must survive: steady interactive traffic while a batch client sends
a burst at about three times what the backends can serve.

    python -m loadtests.admission_burst [--out loadtests/out/admission_burst.json]

Two fake vLLM instances (`--max-running 8`: at most 8 requests generate at once, the rest wait
in the engine's queue; decoding slows as the batch fills) behind a gateway whose policy is one
pool with its models and instances and nothing else. Per run:

1. **unloaded**: interactive requests alone, one at a time, for the latency a client gets when
   nothing else runs;
2. **burst**: `interactive` requests at a steady rate from the start, and from `burst_at_s` a
   batch client's `batch` requests at `BURST_FACTOR` times the backends' capacity.

The backends' capacity is worked out from the engine model (`capacity_rps`), not measured, so
every run asks the same of them. Each traffic mix (whole answers, streams, half and half) runs
with admission off (`admission: false`) and as the defaults have it. Reported per run and class:
ok %, shed (429 with Retry-After), p50/p99, and the most requests each engine held at once.

`--engine no-gauges`: one engine instead, as a server that exports no load gauges (`/metrics`
is a 404) and has no batch bound of its own: it runs whatever it is sent and fails a request
that would start beyond `OOM_ABOVE` running with a CUDA out-of-memory 500. The gateway knows it
only by its answers. Reported besides: the engine's OOMs, the 5xx each class got, and how many
429/503 carried Retry-After.

`--tenants`: two tenants (API keys) in the batch class, one sending ten times the other, with
admission off and on: each tenant's share of the completions while both have requests waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from loadtests.engine_pool import engines, gateway, one_pool_policy, url
from loadtests.ledger import JsonlWriter, Record, read_records
from loadtests.loadgen import Target, WorkloadSpec, per_class_summary, run_load
from loadtests.procs import ManagedProcess

MAX_RUNNING = 8
BACKENDS = ("a", "b")
TTFT_S = 0.05
PER_TOKEN_S = 0.002
BATCH_SLOWDOWN = 1.0
BURST_FACTOR = 3.0
OOM_ABOVE = 40


@dataclass(frozen=True)
class EngineModel:
    """The backends of a run: their names, the fake's engine flags, and how many requests each
    runs at once when full (with `per_token_s`, what `capacity_rps` works from)."""

    backends: tuple[str, ...]
    batch: int
    per_token_s: float
    flags: tuple[str, ...]


ENGINES = {
    "queueing": EngineModel(
        BACKENDS, MAX_RUNNING, PER_TOKEN_S, ("--max-running", str(MAX_RUNNING))
    ),
    # Slower tokens, several to an event: the burst stays within what two cores drive.
    "no-gauges": EngineModel(
        ("a",), OOM_ABOVE, 0.005,
        ("--oom-above", str(OOM_ABOVE), "--no-metrics", "--tokens-per-event", "10"),
    ),
}  # fmt: skip

INTERACTIVE = WorkloadSpec(
    models=["m"],
    chat_share=1.0,
    prompt_tokens=(40, 120),
    max_tokens=(20, 60),
    priorities=(("interactive", 1.0),),
    seed=11,
)
BATCH = WorkloadSpec(
    models=["m"],
    chat_share=0.7,
    prompt_tokens=(100, 400),
    max_tokens=(100, 300),
    priorities=(("batch", 1.0),),
    seed=12,
)
MIXES = {"whole": 0.0, "streamed": 1.0, "half": 0.5}


def capacity_rps(engine: EngineModel = ENGINES["queueing"]) -> float:
    """Batch requests a second the backends complete with full batches: each engine runs
    `engine.batch` at once, a request taking its first-token time plus its mean `max_tokens`
    at the per-token time slowed by a full batch (`1 + BATCH_SLOWDOWN`)."""
    mean_tokens = sum(BATCH.max_tokens) / 2
    service_s = TTFT_S + mean_tokens * engine.per_token_s * (1.0 + BATCH_SLOWDOWN)
    return len(engine.backends) * engine.batch / service_s


@dataclass(frozen=True)
class Burst:
    interactive: int = 100
    interactive_rps: float = 5.0
    batch: int = 600
    burst_at_s: float = 4.0
    unloaded: int = 20


def backends(
    engine: EngineModel = ENGINES["queueing"],
) -> AbstractContextManager[dict[str, ManagedProcess]]:
    return engines(
        engine.backends,
        (
            *engine.flags, "--batch-slowdown", str(BATCH_SLOWDOWN),
            "--ttft", str(TTFT_S), "--per-token", str(engine.per_token_s),
        ),
    )  # fmt: skip


def engine_peaks(fakes: dict[str, ManagedProcess]) -> dict[str, dict[str, int]]:
    """Each engine's most requests running and waiting at once since it started, and the
    requests it failed out of memory."""
    peaks = {}
    for name, proc in fakes.items():
        state = httpx.get(f"{url(proc)}/_fake/engine", timeout=5).json()
        peaks[name] = {
            "running": state["peak_running"],
            "waiting": state["peak_waiting"],
            "ooms": state["ooms"],
        }
    return peaks


def refusals(records: list[Record]) -> dict[str, dict[str, int]]:
    """Per class: answers of 500 and up, and 429/503 answers with and without Retry-After."""
    out: dict[str, dict[str, int]] = {}
    for record in records:
        counts = out.setdefault(
            record.priority or "-", {"5xx": 0, "refused_with_retry_after": 0, "refused_bare": 0}
        )
        if record.status in (429, 503):
            key = "refused_with_retry_after" if record.retry_after else "refused_bare"
            counts[key] += 1
        elif record.status >= 500:
            counts["5xx"] += 1
    return out


async def _load(
    spec: WorkloadSpec,
    base: str,
    out: Path,
    rate: float,
    requests: int,
    delay_s: float = 0.0,
    api_key: str | None = None,
) -> list[Record]:
    await asyncio.sleep(delay_s)
    writer = JsonlWriter(out)
    try:
        await run_load(
            spec,
            {"m": [Target("gateway", base, gateway=True, api_key=api_key)]},
            writer,
            rate=rate,
            requests=requests,
            arrival="fixed",
            drain_timeout=120.0,
            request_timeout=120.0,
        )
    finally:
        writer.close()
    return [replace(r, t=r.t + delay_s) for r in read_records(out)]


async def run(
    stream_share: float,
    pool_settings: str,
    burst: Burst,
    work: Path,
    engine: EngineModel = ENGINES["queueing"],
) -> dict[str, Any]:
    """One mix through one gateway: unloaded interactive latency, then the burst."""
    interactive = replace(INTERACTIVE, stream_share=stream_share)
    batch = replace(BATCH, stream_share=stream_share)
    with backends(engine) as fakes, gateway(one_pool_policy(fakes, pool_settings)) as proc:
        base = f"http://{proc.ready['data']}"
        alone = await _load(
            replace(interactive, seed=interactive.seed + 100), base, work / "unloaded.jsonl",
            rate=1000.0, requests=1, delay_s=0.0,
        )  # fmt: skip
        for i in range(1, burst.unloaded):
            alone += await _load(
                replace(interactive, seed=interactive.seed + 100 + i), base,
                work / f"unloaded-{i}.jsonl", rate=1000.0, requests=1,
            )  # fmt: skip
        rate = BURST_FACTOR * capacity_rps(engine)
        steady, flood = await asyncio.gather(
            _load(interactive, base, work / "interactive.jsonl", burst.interactive_rps,
                  burst.interactive),
            _load(batch, base, work / "batch.jsonl", rate, burst.batch, burst.burst_at_s),
        )  # fmt: skip
        peaks = await asyncio.to_thread(engine_peaks, fakes)
    unloaded = per_class_summary(alone)["interactive"]
    classes = per_class_summary(steady + flood)
    return {
        "unloaded_p50_s": unloaded.p50_s,
        "unloaded_p99_s": unloaded.p99_s,
        "classes": {name: {**asdict(s), "ok_percent": s.ok_percent} for name, s in classes.items()},
        "records": steady + flood,
        "engine_peaks": peaks,
        "refusals": refusals(steady + flood),
    }


async def run_tenants(
    pool_settings: str, work: Path, seconds: float = 10.0, small_share: float = 0.6
) -> dict[str, list[Record]]:
    """Two tenants (API keys) in the batch class, one sending ten times the other: the small
    one at `small_share` of the backends' capacity (more than its fair half, so that it has
    requests waiting throughout), the large one at ten times that, for `seconds`."""
    small_rps = small_share * capacity_rps()
    count = round(small_rps * seconds)
    big, small = replace(BATCH, seed=21), replace(BATCH, seed=22)
    with backends() as fakes, gateway(one_pool_policy(fakes, pool_settings)) as proc:
        base = f"http://{proc.ready['data']}"
        sent = await asyncio.gather(
            _load(big, base, work / "big.jsonl", 10 * small_rps, 10 * count, api_key="tenant-big"),
            _load(small, base, work / "small.jsonl", small_rps, count, api_key="tenant-small"),
        )
    return {"big": sent[0], "small": sent[1]}


def completion_share(
    tenants: dict[str, list[Record]], since: float, until: float
) -> dict[str, float]:
    """Each tenant's share of the requests answered well between `since` and `until` (by when
    they were answered)."""
    done = {
        name: sum(1 for r in records if r.ok and since <= r.t + (r.total or 0.0) < until)
        for name, records in tenants.items()
    }
    total = sum(done.values())
    return {name: count / total if total else 0.0 for name, count in done.items()}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| mix | admission | class | requests | ok % | shed | p50 ms | p99 ms | unloaded p99 ms "
        "| 5xx | 429/503 with / without Retry-After "
        "| engine peak running / waiting / OOMs |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for result in results:
        peaks = ", ".join(
            f"{n} {p['running']}/{p['waiting']}/{p.get('ooms', 0)}"
            for n, p in result["engine_peaks"].items()
        )
        for klass in ("interactive", "batch"):
            s = result["classes"].get(klass)
            if s is None:
                continue
            r = result.get("refusals", {}).get(klass, {})
            lines.append(
                f"| {result['mix']} | {result['admission']} | {klass} | {s['count']} | "
                f"{s['ok_percent']:.1f} | {s['shed']} | {_ms(s['p50_s'])} | {_ms(s['p99_s'])} | "
                f"{_ms(result['unloaded_p99_s'])} | {r.get('5xx', 0)} | "
                f"{r.get('refused_with_retry_after', 0)} / {r.get('refused_bare', 0)} | {peaks} |"
            )
    return "\n".join(lines)


CONFIGS = {
    "off": "    admission: false\n",
    "default": "",
    # Whole answers sent as they came (not fetched as streams): the limiter learns from their
    # time per output token alone.
    "per-token": "    resume: {whole_answers: false}\n",
    # The limiter alone (no engine gauges), as a pool of engines that export none gets it.
    "limiter": "    admission: {vllm_signals: false}\n",
    # The limiter alone, whole answers as they came: with and without the
    # time-per-token signal (a tolerance nothing reaches turns it off).
    "limiter-per-token": "    resume: {whole_answers: false}\n"
    "    admission: {vllm_signals: false}\n",
    "limiter-no-signal": "    resume: {whole_answers: false}\n"
    "    admission: {vllm_signals: false, concurrency: {per_token_tolerance: 1000}}\n",
    # Batch clients that would rather come back later than wait minutes in the queue.
    "short-batch-wait": "    admission: {batch: {queue_timeout: 5s}}\n",
}


async def main_async(
    mixes: list[str], configs: list[str], burst: Burst, engine: EngineModel = ENGINES["queueing"]
) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="admission-burst-"))
    capacity = capacity_rps(engine)
    print(f"capacity {capacity:.1f} req/s; burst at {BURST_FACTOR * capacity:.1f}")
    results = []
    for mix in mixes:
        for config in configs:
            folder = work / f"{mix}-{config}"
            folder.mkdir()
            result = await run(MIXES[mix], CONFIGS[config], burst, folder, engine)
            result.pop("records")
            results.append({"mix": mix, "admission": config, **result})
            print(table(results[-1:]).splitlines()[-1])
    return results


async def tenants_async(configs: list[str], seconds: float) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="admission-tenants-"))
    results = []
    for config in configs:
        folder = work / config
        folder.mkdir()
        tenants = await run_tenants(CONFIGS[config], folder, seconds)
        share = completion_share(tenants, 2.0, seconds)
        counts = {
            name: {"sent": len(rs), "ok": sum(r.ok for r in rs), "shed": sum(r.shed for r in rs)}
            for name, rs in tenants.items()
        }
        results.append({"admission": config, "share": share, "counts": counts})
        print(
            f"| {config} | {share['small']:.3f} | {share['big']:.3f} | "
            + " | ".join(f"{c['sent']} / {c['ok']} / {c['shed']}" for c in counts.values())
            + " |"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mix", action="append", choices=sorted(MIXES))
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS))
    parser.add_argument("--engine", choices=sorted(ENGINES), default="queueing")
    parser.add_argument("--tenants", action="store_true", help="the two-tenant run instead")
    parser.add_argument("--seconds", type=float, default=10.0, help="of the two-tenant run")
    parser.add_argument("--out", type=Path, default=Path("loadtests/out/admission_burst.json"))
    args = parser.parse_args()
    if args.tenants:
        print(
            "| admission | small tenant's share (fair: 0.5) | big tenant's share "
            "| big: sent / ok / shed | small: sent / ok / shed |\n|---|--:|--:|---|---|"
        )
        report = asyncio.run(tenants_async(args.config or ["off", "default"], args.seconds))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        return
    results = asyncio.run(
        main_async(
            args.mix or list(MIXES), args.config or list(CONFIGS), Burst(), ENGINES[args.engine]
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
