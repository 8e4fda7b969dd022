"""An exponentially weighted moving average of a value and of its deviation (RFC 6298 style)."""

from __future__ import annotations


class Ewma:
    """EWMA of a sample stream and of its mean absolute deviation.

    `smoothing` is the weight of history (a, 0.85 by default in the policy). On a sample x:

    - first sample: `mean = x`, `deviation = x / 2` (RFC 6298 initialises RTTVAR to R/2, so the
      first timeouts keep a margin instead of trusting one sample);
    - then `deviation = a·deviation + (1 - a)·|x - mean|` with the *old* mean, and
      `mean = a·mean + (1 - a)·x`.

    `samples` counts the observations, so callers can ignore an estimate that is still young.
    """

    __slots__ = ("deviation", "mean", "samples", "smoothing")

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self.mean = 0.0
        self.deviation = 0.0
        self.samples = 0

    def observe(self, x: float) -> None:
        """Fold one sample into the mean and deviation (rule in the class docstring)."""
        if self.samples == 0:
            self.mean = x
            self.deviation = x / 2.0
        else:
            alpha = self.smoothing
            mean = self.mean
            self.deviation = alpha * self.deviation + (1.0 - alpha) * abs(x - mean)
            self.mean = alpha * mean + (1.0 - alpha) * x
        self.samples += 1

    def __repr__(self) -> str:
        return f"Ewma(mean={self.mean:.6g}, deviation={self.deviation:.6g}, samples={self.samples})"
