"""Streamed completions: time to first byte, and how many SSE events and HTTP chunks came through.

TTFB runs from just before the request is sent to the first body byte (the first SSE event):
the gateway holds the response headers until the first chunk arrives (its commit point), so
the time to headers would not compare like with like.

HTTP chunk boundaries survive TCP coalescing, and a proxy writes one chunk per relayed piece,
so counting them tells how many writes the sender made; under load one chunk may carry
several SSE events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from loadtests.bench.client import JSON_HEADERS, new_session, run_async
from loadtests.bench.cpu import CpuTimes
from loadtests.bench.results import Latency

_DONE = b"data: [DONE]"


@dataclass(frozen=True)
class StreamPhase:
    """One phase of `requests` streams, `concurrency` at a time."""

    requests: int
    concurrency: int
    errors: int
    events: int
    http_chunks: int
    wall_s: float
    ttfb: Latency
    # CPU time a watched process spent during the measured part (None when not watched).
    cpu: CpuTimes | None


@dataclass(frozen=True)
class _Stream:
    ttfb_s: float
    events: int
    http_chunks: int


async def _stream(session: aiohttp.ClientSession, url: str, body: bytes) -> _Stream | None:
    """One streamed request, or None if it failed or ended early."""
    start = time.perf_counter()
    ttfb = 0.0
    parts: list[bytes] = []
    chunks = 0
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as response:
            if response.status != 200:
                return None
            while True:
                # (data, True) at each end of an HTTP chunk; (b"", False) at the end of the body.
                data, chunk_end = await response.content.readchunk()
                if not data and not chunk_end:
                    break
                if data and not parts:
                    ttfb = time.perf_counter() - start
                parts.append(data)
                chunks += chunk_end
    except (TimeoutError, aiohttp.ClientError):
        return None
    text = b"".join(parts)
    if not text.rstrip().endswith(_DONE):
        return None
    return _Stream(ttfb, text.count(b"\n\n"), chunks)


async def _phase(
    session: aiohttp.ClientSession, url: str, body: bytes, requests: int, concurrency: int
) -> tuple[list[_Stream | None], float]:
    results: list[_Stream | None] = []
    remaining = [requests]

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            results.append(await _stream(session, url, body))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    return results, time.perf_counter() - start


async def _measure(
    url: str,
    body: bytes,
    warmup_body: bytes,
    requests: int,
    concurrency: int,
    cpu_probe: Callable[[], CpuTimes] | None,
) -> StreamPhase:
    async with new_session() as session:
        # Open as many connections as the phase will use (client side and, through a proxy,
        # upstream side) so the measured part does not pay for connection set-up.
        await _phase(session, url, warmup_body, concurrency, concurrency)
        cpu_before = cpu_probe() if cpu_probe else None
        results, wall_s = await _phase(session, url, body, requests, concurrency)
        cpu = cpu_probe() - cpu_before if cpu_probe and cpu_before is not None else None
    done = [r for r in results if r is not None]
    return StreamPhase(
        requests=requests,
        concurrency=concurrency,
        errors=requests - len(done),
        events=sum(s.events for s in done),
        http_chunks=sum(s.http_chunks for s in done),
        wall_s=wall_s,
        ttfb=Latency.of([s.ttfb_s for s in done]),
        cpu=cpu,
    )


def run(
    url: str,
    body: bytes,
    warmup_body: bytes,
    *,
    requests: int,
    concurrency: int,
    cpu_probe: Callable[[], CpuTimes] | None = None,
) -> StreamPhase:
    return run_async(lambda: _measure(url, body, warmup_body, requests, concurrency, cpu_probe))
