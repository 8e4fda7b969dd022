"""Operating under traffic, measured: policy reloads and a SIGTERM drain while requests flow.

    python -m loadtests.bench_operations [--rate 40] [--reloads 10]

1. **Reloads**: three fake vLLM instances; the gateway's policy file alternates between
   instances (a, b) and (b, c), with a breaker setting changed too, every `interval` seconds
   while half-streamed traffic runs, applied by `POST /admin/reload` and SIGHUP in turn. Every
   request must succeed.
2. **Drain**: traffic with streams of a few seconds, then SIGTERM. Clients keep sending during
   `drain.delay` (the endpoints have not been updated yet) and stop when the listener closes,
   as a Service's endpoints would. Every request sent must end properly: a full answer, or a
   stream ending in `[DONE]` (with an error event only for streams still open at the drain's
   deadline, which this run's deadline leaves room to avoid).

Prints the counts; loopback only; every process it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from loadtests.ledger import JsonlWriter, Record, read_records
from loadtests.loadgen import Target, WorkloadSpec, run_load
from loadtests.procs import ManagedProcess, python_module

DRAIN_DELAY_S = 1.0
DRAIN_TIMEOUT_S = 10.0


@contextmanager
def fakes(per_token_s: float) -> Iterator[dict[str, str]]:
    started: dict[str, ManagedProcess] = {}
    try:
        for name in ("a", "b", "c"):
            started[name] = ManagedProcess(
                python_module(
                    "loadtests.fake_vllm", "--name", name, "--models", "m",
                    "--ttft", "0.05", "--per-token", str(per_token_s),
                )
            )  # fmt: skip
        yield {name: f"http://127.0.0.1:{p.port()}" for name, p in started.items()}
    finally:
        for proc in started.values():
            proc.stop()


def policy(urls: dict[str, str], names: tuple[str, ...], consecutive_failures: int) -> str:
    instances = ", ".join(f'{{name: {n}, url: "{urls[n]}"}}' for n in names)
    return f"""
listen: 127.0.0.1:0
admin: {{listen: 127.0.0.1:0}}
drain: {{delay: {DRAIN_DELAY_S}s, timeout: {DRAIN_TIMEOUT_S}s}}
pools:
  chat:
    models: [m]
    instances: [{instances}]
    breaker: {{consecutive_failures: {consecutive_failures}}}
"""


def spec(max_tokens: tuple[int, int]) -> WorkloadSpec:
    return WorkloadSpec(
        models=["m"], stream_share=0.5, prompt_tokens=(20, 200), max_tokens=max_tokens, seed=5
    )


def failures(records: list[Record]) -> dict[str, int]:
    """What went wrong, by kind (nothing for a proper ending)."""
    kinds: Counter[str] = Counter()
    for r in records:
        if not r.ok:
            kinds[
                r.error or f"status {r.status}" + (" (error event)" if r.error_event else "")
            ] += 1
    return dict(kinds)


async def reloads(
    urls: dict[str, str], rate: float, count: int, interval_s: float, work: Path
) -> dict[str, Any]:
    path = work / "policy.yaml"
    path.write_text(policy(urls, ("a", "b"), 5))
    proc = ManagedProcess(python_module("gateway", "run", "--policy", str(path)))
    base, admin = f"http://{proc.ready['data']}", f"http://{proc.ready['admin']}"
    applied: list[str] = []

    async def reload_loop() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            for n in range(count):
                await asyncio.sleep(interval_s)
                names = ("b", "c") if n % 2 == 0 else ("a", "b")
                path.write_text(policy(urls, names, 5 + n % 3))
                if n % 2 == 0:
                    answer = (await client.post(f"{admin}/admin/reload")).json()
                    applied.append("api" if answer.get("reloaded") else "api refused")
                else:
                    before = (await client.get(f"{admin}/admin/state")).json()["policy"]
                    proc.signal(signal.SIGHUP)
                    for _ in range(200):  # bounded: a reload takes milliseconds
                        state = (await client.get(f"{admin}/admin/state")).json()["policy"]
                        if state["version"] != before["version"]:
                            break
                        await asyncio.sleep(0.01)
                    applied.append("SIGHUP" if state["version"] != before["version"] else "lost")

    writer = JsonlWriter(work / "reloads.jsonl")
    try:
        loop_task = asyncio.create_task(reload_loop())
        stats = await run_load(
            spec((20, 200)),
            {"m": [Target("gateway", base, gateway=True)]},
            writer,
            rate=rate,
            requests=1_000_000,
            time_limit=(count + 1) * interval_s,
            drain_timeout=30.0,
        )
        await loop_task
    finally:
        writer.close()
        proc.signal(signal.SIGINT)
        proc.stop()
    records = list(read_records(work / "reloads.jsonl"))
    return {
        "requests": stats.sent,
        "ok": sum(r.ok for r in records),
        "failed": failures(records),
        "reloads": Counter(applied),
    }


async def drain(urls: dict[str, str], rate: float, work: Path) -> dict[str, Any]:
    path = work / "drain.yaml"
    path.write_text(policy(urls, ("a", "b", "c"), 5))
    proc = ManagedProcess(python_module("gateway", "run", "--policy", str(path)))
    base = f"http://{proc.ready['data']}"
    steady_s = 5.0

    async def terminate() -> float:
        await asyncio.sleep(steady_s)
        proc.signal(signal.SIGTERM)
        return time.monotonic()

    writer = JsonlWriter(work / "drain.jsonl")
    try:
        sigterm = asyncio.create_task(terminate())
        stats = await run_load(
            spec((200, 600)),  # streams of 1-3 s: many are in flight at SIGTERM
            {"m": [Target("gateway", base, gateway=True)]},
            writer,
            rate=rate,
            requests=1_000_000,
            # Clients stop when the listener closes (endpoints updated), a little before.
            time_limit=steady_s + 0.9 * DRAIN_DELAY_S,
            drain_timeout=DRAIN_TIMEOUT_S + 10,
        )
        sent_at = await sigterm
        code = await asyncio.to_thread(proc.proc.wait, DRAIN_DELAY_S + DRAIN_TIMEOUT_S + 5)
        exit_after_s = time.monotonic() - sent_at
    finally:
        writer.close()
        proc.stop()
    records = list(read_records(work / "drain.jsonl"))
    in_flight_at_sigterm = sum(
        1 for r in records if r.t < steady_s and r.total is not None and r.t + r.total > steady_s
    )
    return {
        "requests": stats.sent,
        "ok": sum(r.ok for r in records),
        "failed": failures(records),
        "in_flight_at_sigterm": in_flight_at_sigterm,
        "sent_during_delay": sum(1 for r in records if r.t >= steady_s),
        "exit_code": code,
        "exit_after_sigterm_s": round(exit_after_s, 2),
    }


async def main_async(rate: float, count: int, interval_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-operations-"))
    with fakes(per_token_s=0.005) as urls:
        reload_result = await reloads(urls, rate, count, interval_s, work)
        drain_result = await drain(urls, rate, work)
    return {"reloads": reload_result, "drain": drain_result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second")
    parser.add_argument("--reloads", type=int, default=10)
    parser.add_argument("--interval-s", type=float, default=1.5, help="between reloads")
    args = parser.parse_args()
    report = asyncio.run(main_async(args.rate, args.reloads, args.interval_s))
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
