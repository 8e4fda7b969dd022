"""Plain result records shared by the load generators and the report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for an empty sequence)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass(frozen=True)
class Latency:
    """Latency percentiles in milliseconds."""

    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @staticmethod
    def of(seconds: Sequence[float]) -> Latency:
        ordered = sorted(seconds)
        ms = [s * 1000.0 for s in ordered]
        return Latency(
            count=len(ms),
            p50_ms=percentile(ms, 50),
            p90_ms=percentile(ms, 90),
            p99_ms=percentile(ms, 99),
            max_ms=ms[-1] if ms else 0.0,
        )


@dataclass(frozen=True)
class Throughput:
    """One run at fixed concurrency: completed requests per second and their latency."""

    tool: str
    connections: int
    duration_s: float
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p99_ms: float
