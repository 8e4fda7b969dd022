"""A latency histogram cheap enough for the request path: one bisect, two additions."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

# Seconds, for LLM requests: from a few milliseconds (an embedding, a cached error) to the
# minutes a long generation takes.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# Time per output token: milliseconds, where an engine's decoding lives (vLLM's own buckets,
# finer at the low end).
TOKEN_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5
)  # fmt: skip


class Histogram:
    """Counts per bucket (`value <= bound`, Prometheus' `le`), plus one for above the last."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("bucket bounds must increase")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        """`(le, count of values <= le)` per bound, ending with `(inf, total)`."""
        total = 0
        result = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            result.append((bound, total))
        return result
