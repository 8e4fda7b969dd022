"""Latency at a fixed arrival rate (open loop).

Requests are sent on a schedule of absolute times, `start + i / rate`, whether or not earlier
ones were answered, so a slow target cannot slow the load down and hide its own latency (the
"coordinated omission" of closed-loop tools). Latency counts from the scheduled time; the lag
between scheduled and actual send time is reported so a generator that falls behind shows.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from loadtests.bench.client import JSON_HEADERS, new_session, run_async
from loadtests.bench.results import Latency


@dataclass(frozen=True)
class OpenLoopResult:
    rate: float
    duration_s: float
    sent: int
    errors: int
    latency: Latency
    send_lag: Latency


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, due: float
) -> tuple[float, float] | None:
    """(latency from the scheduled time, send lag), or None on failure."""
    sent = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as response:
            await response.read()
            if response.status != 200:
                return None
    except (TimeoutError, aiohttp.ClientError):
        return None
    return time.perf_counter() - due, sent - due


async def _measure(url: str, body: bytes, rate: float, duration_s: float) -> OpenLoopResult:
    total = max(1, int(rate * duration_s))
    async with new_session() as session:
        tasks: list[asyncio.Task[tuple[float, float] | None]] = []
        # Scheduled with perf_counter: uvloop's loop.time() has millisecond resolution.
        start = time.perf_counter() + 0.05
        for i in range(total):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, body, due)))
        results = await asyncio.gather(*tasks)
    done = [r for r in results if r is not None]
    return OpenLoopResult(
        rate=rate,
        duration_s=duration_s,
        sent=total,
        errors=total - len(done),
        latency=Latency.of([latency for latency, _ in done]),
        send_lag=Latency.of([lag for _, lag in done]),
    )


def run(url: str, body: bytes, *, rate: float, duration_s: float) -> OpenLoopResult:
    return run_async(lambda: _measure(url, body, rate, duration_s))
