"""`make demo`: fake vLLM backends and the gateway on loopback, real traffic, a summary.

Two phases of the same traffic: all backends healthy, then one backend failing a share of its
requests. The summary shows what clients got through the gateway in each phase.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from loadtests.procs import ManagedProcess, python_module

ROOT = Path(__file__).resolve().parent.parent
MODEL = "demo-chat"


@dataclass
class PhaseResult:
    name: str
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    instances: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    @property
    def ok(self) -> int:
        return self.statuses[200]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def demo_policy(backend_urls: dict[str, str]) -> str:
    policy = yaml.safe_load((ROOT / "policies" / "demo.yaml").read_text())
    policy["listen"] = "127.0.0.1:0"
    policy["admin"] = {"listen": "127.0.0.1:0"}
    policy["pools"]["chat"]["instances"] = [
        {"name": name, "url": url} for name, url in backend_urls.items()
    ]
    return yaml.safe_dump(policy, sort_keys=False)


async def one_request(client: httpx.AsyncClient, rng: random.Random, result: PhaseResult) -> None:
    stream = rng.random() < 0.5
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about resilience."}],
        "max_tokens": rng.randint(8, 64),
        "stream": stream,
    }
    started = time.monotonic()
    status = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            status = response.status_code
            text = b"".join([chunk async for chunk in response.aiter_bytes()])
            if status == 200 and stream and not text.rstrip().endswith(b"data: [DONE]"):
                status = 599  # a stream that did not end properly counts as failed
            result.instances[response.headers.get("x-gateway-instance", "-")] += 1
    except httpx.HTTPError:
        status = 598
    result.statuses[status] += 1
    result.latencies_s.append(time.monotonic() - started)


async def run_phase(url: str, name: str, requests: int, concurrency: int, seed: int) -> PhaseResult:
    result = PhaseResult(name)
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)

    async def guarded(client: httpx.AsyncClient) -> None:
        async with gate:
            await one_request(client, rng, result)

    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        await asyncio.gather(*(guarded(client) for _ in range(requests)))
    return result


def print_summary(results: list[PhaseResult]) -> None:
    print()
    print(f"{'phase':<34}{'requests':>9}{'success':>10}{'p50 ms':>9}{'p99 ms':>9}  traffic")
    for r in results:
        share = ", ".join(f"{k}={v}" for k, v in sorted(r.instances.items()))
        print(
            f"{r.name:<34}{r.total:>9}{100 * r.ok / max(1, r.total):>9.1f}%"
            f"{1000 * percentile(r.latencies_s, 0.5):>9.0f}"
            f"{1000 * percentile(r.latencies_s, 0.99):>9.0f}  {share}"
        )
        failures = {k: v for k, v in r.statuses.items() if k != 200}
        if failures:
            print(f"{'':<34}failures by status: {failures}")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=300, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    procs: list[ManagedProcess] = []
    try:
        print("starting two fake vLLM backends (50 ms to first token, 5 ms per token)...")
        backends = {}
        for name in ("a", "b"):
            proc = ManagedProcess(
                python_module(
                    "loadtests.fake_vllm",
                    *("--port", "0", "--name", name, "--models", MODEL),
                    *("--ttft", "0.05", "--per-token", "0.005", "--seed", str(args.seed)),
                )
            )
            procs.append(proc)
            backends[name] = f"http://127.0.0.1:{proc.port()}"
        policy_dir = Path(tempfile.mkdtemp(prefix="gateway-demo-"))
        policy_file = policy_dir / "demo.yaml"
        policy_file.write_text(demo_policy(backends))
        gateway = ManagedProcess(python_module("gateway", "run", "--policy", str(policy_file)))
        procs.append(gateway)
        url = f"http://{gateway.ready['data']}"
        print(f"gateway on {url}, admin on http://{gateway.ready['admin']}")

        results = []
        print(f"phase 1: {args.requests} requests, all backends healthy")
        results.append(
            asyncio.run(run_phase(url, "healthy", args.requests, args.concurrency, args.seed))
        )
        print("phase 2: backend b now fails 30% of its requests with 500s")
        httpx.post(f"{backends['b']}/_fake/faults", json={"error_rate": 0.3}).raise_for_status()
        results.append(
            asyncio.run(
                run_phase(url, "b fails 30% (500s)", args.requests, args.concurrency, args.seed)
            )
        )
        print_summary(results)
        state = httpx.get(f"http://{gateway.ready['admin']}/admin/state", timeout=5).json()
        b = next(i for i in state["pools"]["chat"]["instances"] if i["name"] == "b")
        print(
            "The gateway retried b's failures on a before any byte reached the client, so"
            " clients\nsaw none of them; b's breaker now says"
            f" {b['state']} ({b['isolations']} isolation(s), {b['failures']} failed attempts)."
        )
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
