"""A pool's recent failure rate, the input of the retry tier choice."""

from __future__ import annotations


class FailureRateState:
    """EMA of the failure indicator over a pool's finished attempts.

    On each attempt: `rate = β·rate + (1 - β)·(1 if failed else 0)`, β = `smoothing`
    (`retries.failure_smoothing`, 0.97). Starts at 0: a new pool is presumed healthy. With
    β = 0.97 the memory is about 1 / (1 - β) ≈ 33 attempts.
    """

    __slots__ = ("rate", "smoothing")

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self.rate = 0.0

    def observe(self, failed: bool) -> float:
        """Fold one finished attempt into the rate (rule in the class docstring); the new rate."""
        beta = self.smoothing
        self.rate = beta * self.rate + (1.0 - beta if failed else 0.0)
        return self.rate
