"""Figures per priority class, from ledger records: how each admission class fared.

`per_class_summary(records)` is the pure entry point for benchmark scripts (any iterable of
Records, e.g. `read_records(path)`, optionally cut to a window of send times); `ClassTally` is
the same thing fed one record at a time, for the CLI's closing summary. Memory stays constant:
latencies go into `Histogram`s (quantiles within 1 % of the truth), never into lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loadtests.ledger import Record
from loadtests.loadgen.stats import Histogram
from loadtests.loadgen.workload import PRIORITIES

NO_CLASS = "(none)"  # records sent without a priority header


@dataclass(frozen=True)
class ClassSummary:
    priority: str  # a class of PRIORITIES, or NO_CLASS
    count: int  # records (sent requests) of the class
    ok: int  # status 200 with a proper body or stream end
    shed: int  # 429s with the gateway's "shed" error code
    status_429: int  # every 429, shed or not (an upstream's 429 passed through counts here only)
    p50_s: float | None  # total latency of ok requests; None without any
    p99_s: float | None
    ttfb_p99_s: float | None  # time to first byte of ok streams; None without any

    @property
    def ok_percent(self) -> float:
        return 100.0 * self.ok / self.count if self.count else 0.0


class _Class:
    __slots__ = ("count", "ok", "shed", "status_429", "total", "ttfb")

    def __init__(self) -> None:
        self.count = self.ok = self.shed = self.status_429 = 0
        self.total = Histogram()
        self.ttfb = Histogram()


class ClassTally:
    """Per-class counters and latency histograms, fed one record at a time."""

    def __init__(self) -> None:
        self._classes: dict[str, _Class] = {}

    def add(self, record: Record) -> None:
        key = record.priority or NO_CLASS
        entry = self._classes.get(key)
        if entry is None:
            entry = self._classes[key] = _Class()
        entry.count += 1
        if record.status == 429:
            entry.status_429 += 1
            if record.shed:
                entry.shed += 1
        if record.ok:
            entry.ok += 1
            if record.total is not None:
                entry.total.add(record.total)
            if record.stream and record.ttfb is not None:
                # A plain response's first byte comes with its last: only streams tell here.
                entry.ttfb.add(record.ttfb)

    @property
    def has_priorities(self) -> bool:
        """Some record carried a priority class."""
        return any(key != NO_CLASS for key in self._classes)

    def summaries(self) -> dict[str, ClassSummary]:
        """Per class seen, most urgent first, records without a class last."""
        order = [*PRIORITIES, NO_CLASS]
        keys = sorted(self._classes, key=lambda k: (order.index(k) if k in order else 99, k))
        return {key: _summary(key, self._classes[key]) for key in keys}


def per_class_summary(
    records: Iterable[Record], since: float | None = None, until: float | None = None
) -> dict[str, ClassSummary]:
    """Per priority class, the figures of `records` sent (`Record.t`) in [since, until)."""
    tally = ClassTally()
    for record in records:
        if (since is None or record.t >= since) and (until is None or record.t < until):
            tally.add(record)
    return tally.summaries()


def class_table(summaries: dict[str, ClassSummary]) -> str:
    """A fixed-width text table, one line per class, for the CLI's closing summary."""
    lines = [
        f"{'class':<12}{'sent':>8}{'ok %':>8}{'shed':>7}{'429':>7}"
        f"{'p50 (ok)':>11}{'p99 (ok)':>11}{'ttfb p99':>11}"
    ]
    for key, s in summaries.items():
        lines.append(
            f"{key:<12}{s.count:>8}{s.ok_percent:>8.1f}{s.shed:>7}{s.status_429:>7}"
            f"{_secs(s.p50_s):>11}{_secs(s.p99_s):>11}{_ms(s.ttfb_p99_s):>11}"
        )
    return "\n".join(lines)


def _summary(key: str, entry: _Class) -> ClassSummary:
    def quantile(histogram: Histogram, q: float) -> float | None:
        return histogram.quantile(q) if histogram.count else None

    return ClassSummary(
        priority=key,
        count=entry.count,
        ok=entry.ok,
        shed=entry.shed,
        status_429=entry.status_429,
        p50_s=quantile(entry.total, 0.5),
        p99_s=quantile(entry.total, 0.99),
        ttfb_p99_s=quantile(entry.ttfb, 0.99),
    )


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"
