"""Fixed-concurrency load in Python, used for the throughput section when wrk is missing.

Each of `connections` workers sends its next request as soon as the previous one is answered
(the same model as wrk). A Python client is much slower than wrk, so with this generator the
figures show the client's limit as much as the target's.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from loadtests.bench.client import JSON_HEADERS, new_session, run_async
from loadtests.bench.results import Throughput, percentile


async def _worker(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    until: float,
    latencies: list[float],
    errors: list[int],
) -> None:
    while True:
        start = time.perf_counter()
        if start >= until:
            return
        try:
            async with session.post(url, data=body, headers=JSON_HEADERS) as response:
                await response.read()
                ok = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok:
            latencies.append(time.perf_counter() - start)
        else:
            errors[0] += 1


async def _measure(url: str, body: bytes, duration_s: float, connections: int) -> Throughput:
    latencies: list[float] = []
    errors = [0]
    async with new_session() as session:
        start = time.perf_counter()
        until = start + duration_s
        await asyncio.gather(
            *(_worker(session, url, body, until, latencies, errors) for _ in range(connections))
        )
        elapsed = time.perf_counter() - start
    latencies.sort()
    return Throughput(
        tool="python",
        connections=connections,
        duration_s=elapsed,
        requests=len(latencies),
        errors=errors[0],
        rps=len(latencies) / elapsed,
        p50_ms=percentile(latencies, 50) * 1000.0,
        p99_ms=percentile(latencies, 99) * 1000.0,
    )


def run(url: str, body: bytes, *, duration_s: float, connections: int = 64) -> Throughput:
    return run_async(lambda: _measure(url, body, duration_s, connections))
