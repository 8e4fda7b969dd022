"""Run-level figures kept in constant memory: a log-bucket histogram, CPU time and peak RSS."""

from __future__ import annotations

import math
import resource
from dataclasses import asdict, dataclass
from typing import Any

_BASE = 1e-6  # values at or below 1 µs share bucket 0
_GROWTH = math.log(1.01)  # bucket bounds grow by 1 %: quantiles within 1 % of the truth


class Histogram:
    """Counts of non-negative values (seconds) in buckets 1 % wide; memory grows with range only."""

    __slots__ = ("_buckets", "count", "max")

    def __init__(self) -> None:
        self._buckets: dict[int, int] = {}
        self.count = 0
        self.max = 0.0

    def add(self, value: float) -> None:
        index = 0 if value <= _BASE else 1 + int(math.log(value / _BASE) / _GROWTH)
        self._buckets[index] = self._buckets.get(index, 0) + 1
        self.count += 1
        if value > self.max:
            self.max = value

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding quantile `q` (capped at the maximum seen)."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for index in sorted(self._buckets):
            seen += self._buckets[index]
            if seen >= rank:
                upper = _BASE if index == 0 else _BASE * math.exp(index * _GROWTH)
                return min(upper, self.max)
        return self.max


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mib() -> float:
    """The process's peak resident set size since it started (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass(frozen=True)
class LoadStats:
    planned: int  # the request count asked for
    sent: int
    completed: int  # records written (== sent once the run has returned)
    ok: int  # records with status 200 and a proper body
    duration_s: float  # from the run's start to the last record written
    target_rate: float  # with rate steps: their mean over [0, the last scheduled send]
    send_rate: float  # achieved: (sent - 1) / (last send - first send)
    max_lag_s: float
    p99_lag_s: float
    max_in_flight: int
    cpu_s: float  # CPU time of the whole process during the run (getrusage)
    peak_rss_mib: float  # the process's peak RSS, since the process started
    stopped_by: str  # "count", "time_limit", "stop" (Progress.stop) or "cancelled"
    rate_steps: tuple[tuple[float, float], ...] | None = None  # ((start_s, rate), ...) if any

    @property
    def cpu_percent(self) -> float:
        """CPU used as a percentage of one core over the run."""
        return 100.0 * self.cpu_s / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["cpu_percent"] = self.cpu_percent
        return data
