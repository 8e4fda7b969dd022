"""The report's figures, computed from a mode's ledger columns and events.

Definitions (the report states them too):
- a request *failed* when it is not `Record.ok` (HTTP 200 with a proper body or stream end);
- latency percentiles interpolate linearly between the closest ranks (numpy's default) and are
  taken over every request that has a `total`, failures included, unless said otherwise;
- the *cold start* of an instance, for each `start`/`restart` event on it, is the time from the
  event to the completion (`t + total`) of the first successful request it served among those
  sent at or after the event and before its next start/restart; an instance serving from t=0
  without such an event has no cold start.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtests.ledger import Event
from loadtests.report.data import NO_INSTANCE, Bools, Floats, ModeData

START_ACTIONS = ("start", "restart")
# Event action -> the actions that end its span (on the same target).
CLOSERS: dict[str, tuple[str, ...]] = {
    "set": ("clear",),
    "freeze": ("thaw",),
    "kill": ("start", "restart"),
    "stop": ("start", "restart"),
    "partition": ("heal",),
}
BUCKET_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 86400)
MAX_BUCKETS = 600


def percentile(values: Floats, q: float) -> float | None:
    """The q-th percentile of the finite values, None when there are none."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return None
    return float(np.percentile(finite, q))


def number(value: Any) -> float | None:
    """A meta value as a float, or None when absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


@dataclass
class ColdStart:
    instance: str
    events: int  # start/restart events on the instance
    delays: list[float] = field(default_factory=list)  # one per event that reached an ok

    @property
    def worst(self) -> float | None:
        return max(self.delays) if self.delays else None


def cold_starts(mode: ModeData) -> dict[str, ColdStart]:
    """Per instance with at least one start/restart event, its cold start delays."""
    by_target: dict[str, list[float]] = {}
    for event in mode.events:
        if event.action in START_ACTIONS and event.target != "redis":  # not a backend
            by_target.setdefault(event.target, []).append(event.t)
    completion = np.where(np.isfinite(mode.total), mode.t + mode.total, mode.t)
    result: dict[str, ColdStart] = {}
    for target, times in by_target.items():
        times.sort()
        entry = ColdStart(target, len(times))
        index = mode.instance_index(target)
        if index is not None:
            served = mode.ok & (mode.instance == index)
            sent = mode.t[served]
            done = completion[served]
            for i, start in enumerate(times):
                end = times[i + 1] if i + 1 < len(times) else math.inf
                window = (sent >= start) & (sent < end)
                if window.any():
                    entry.delays.append(float(done[window].min()) - start)
        result[target] = entry
    return result


@dataclass
class Summary:
    requests: int
    succeeded: int
    failed: int
    improper: int  # 200 but not proper
    error_events: int  # of which the stream carried an error event
    client_errors: int  # status 0
    status_4xx: int
    status_5xx: int
    status_other: int  # neither 200, 0, 4xx nor 5xx
    ooms: int
    latency: dict[str, float | None]  # p50, p95, p99, max (seconds)
    latency_ok_p99: float | None
    ttfb: dict[str, float | None]  # p50, p95, p99 (seconds), streams only
    retries: int | None  # None when no record carries attempts
    retried_requests: int
    lag_p99: float | None
    lag_max: float | None
    # Of the requests that succeeded only: what a client that got its answer waited.
    latency_ok_p50: float | None = None
    ttfb_ok: dict[str, float | None] = field(default_factory=dict)  # p50, p95, streams only

    @property
    def failure_rate(self) -> float | None:
        return 100.0 * self.failed / self.requests if self.requests else None

    @property
    def failures_per_100k(self) -> float | None:
        return 100_000.0 * self.failed / self.requests if self.requests else None

    @property
    def oom_per_100k(self) -> float | None:
        return 100_000.0 * self.ooms / self.requests if self.requests else None


def summarize(mode: ModeData, mask: Bools | None = None) -> Summary:
    """Figures over the mode's records, or over the records selected by `mask`."""

    def pick(values: Any) -> Any:
        return values if mask is None else values[mask]

    status = pick(mode.status)
    ok = pick(mode.ok)
    total = pick(mode.total)
    attempts = pick(mode.attempts)
    stream = pick(mode.stream)
    all_ttfb = pick(mode.ttfb)
    ttfb = all_ttfb[stream]
    requests = int(status.size)
    improper = (status == 200) & ~ok
    has_attempts = attempts > 0
    lag = pick(mode.lag)
    return Summary(
        requests=requests,
        succeeded=int(ok.sum()),
        failed=requests - int(ok.sum()),
        improper=int(improper.sum()),
        error_events=int((improper & pick(mode.error_event)).sum()),
        client_errors=int((status == 0).sum()),
        status_4xx=int(((status >= 400) & (status < 500)).sum()),
        status_5xx=int(((status >= 500) & (status < 600)).sum()),
        status_other=int(
            ((status != 0) & (status != 200) & ((status < 400) | (status >= 600))).sum()
        ),
        ooms=int(pick(mode.oom).sum()),
        latency={
            "p50": percentile(total, 50),
            "p95": percentile(total, 95),
            "p99": percentile(total, 99),
            "max": percentile(total, 100),
        },
        latency_ok_p99=percentile(total[ok], 99),
        ttfb={q: percentile(ttfb, float(q[1:])) for q in ("p50", "p95", "p99")},
        retries=int((attempts[has_attempts] - 1).sum()) if has_attempts.any() else None,
        retried_requests=int((attempts > 1).sum()),
        lag_p99=percentile(lag, 99),
        lag_max=percentile(lag, 100),
        latency_ok_p50=percentile(total[ok], 50),
        ttfb_ok={q: percentile(all_ttfb[stream & ok], float(q[1:])) for q in ("p50", "p95")},
    )


def succeeded_everywhere(modes: Sequence[ModeData]) -> list[Bools]:
    """Per mode, the records of the requests that succeeded in every mode (by `seq`): the same
    requests, so their latencies compare like for like. The `ok:` figures alone do not: the
    requests direct failed at once (a 503, a refused connection) are the ones the gateway
    served through a retry or a resume, which its `ok:` figures include and direct's do not."""
    common: set[int] | None = None
    for mode in modes:
        done = set(mode.seq[mode.ok].tolist())
        common = done if common is None else common & done
    wanted = np.array(sorted(common or ()), dtype=np.int64)
    return [np.isin(mode.seq, wanted) & mode.ok for mode in modes]


def model_instances(mode: ModeData, model: str) -> set[str]:
    """Instances serving a model: declared in meta, or seen answering it in the ledger."""
    names: set[str] = set()
    declared = mode.meta.get("instances")
    if isinstance(declared, dict):
        for name, info in declared.items():
            models = info.get("models") if isinstance(info, dict) else None
            if isinstance(models, list) and model in models:
                names.add(str(name))
    if model in mode.models:
        seen = np.unique(mode.instance[mode.model == mode.models.index(model)])
        names.update(mode.instances[int(i)] for i in seen)
    names.discard(NO_INSTANCE)
    return names


def instance_pool(modes: Iterable[ModeData], instance: str) -> str | None:
    for mode in modes:
        declared = mode.meta.get("instances")
        if isinstance(declared, dict):
            info = declared.get(instance)
            if isinstance(info, dict) and info.get("pool") is not None:
                return str(info["pool"])
    return None


def gateway_counters(mode: ModeData) -> dict[str, Any] | None:
    counters = mode.meta.get("gateway_counters")
    return counters if isinstance(counters, dict) else None


# ---- time buckets --------------------------------------------------------------------------


def duration(modes: Iterable[ModeData]) -> float:
    """The span the charts cover (by send time): the last send or fault event over all modes.

    Not the run's duration: that includes draining the last requests, after sending stopped.
    """
    end = 0.0
    for mode in modes:
        if mode.count:
            end = max(end, float(mode.t.max()))
        for event in mode.events:
            end = max(end, event.t, number(event.detail.get("until")) or 0.0)
    return end


def bucket_step(span: float) -> float:
    """1 s buckets, or the smallest round step giving at most MAX_BUCKETS buckets."""
    for step in BUCKET_STEPS:
        if math.ceil(span / step) <= MAX_BUCKETS:
            return float(step)
    return float(math.ceil(span / MAX_BUCKETS))


@dataclass
class Buckets:
    step: float
    count: int  # number of buckets

    @property
    def centers(self) -> Floats:
        return (np.arange(self.count, dtype=np.float64) + 0.5) * self.step

    def index(self, t: Floats) -> Any:
        return np.clip((t // self.step).astype(np.int64), 0, self.count - 1)


def make_buckets(modes: Iterable[ModeData]) -> Buckets:
    span = duration(list(modes))
    step = bucket_step(span)
    return Buckets(step, max(1, math.floor(span / step) + 1))


def bucket_percentiles(mode: ModeData, buckets: Buckets, qs: tuple[float, ...]) -> list[Floats]:
    """Per bucket (by send time) percentiles of total latency; NaN for empty buckets."""
    out = [np.full(buckets.count, np.nan) for _ in qs]
    has = np.isfinite(mode.total)
    if not has.any():
        return out
    index = buckets.index(mode.t[has])
    values = mode.total[has]
    order = np.argsort(index, kind="stable")
    index, values = index[order], values[order]
    bounds = np.flatnonzero(np.diff(index)) + 1
    for chunk_index, chunk in zip(np.split(index, bounds), np.split(values, bounds), strict=True):
        row = np.percentile(chunk, qs)
        for k in range(len(qs)):
            out[k][int(chunk_index[0])] = row[k]
    return out


def bucket_counts(mode: ModeData, buckets: Buckets, mask: Bools | None = None) -> Floats:
    t = mode.t if mask is None else mode.t[mask]
    if t.size == 0:
        return np.zeros(buckets.count)
    return np.bincount(buckets.index(t), minlength=buckets.count).astype(np.float64)


def bucket_instance_counts(mode: ModeData, buckets: Buckets) -> Floats:
    """Requests per (instance, bucket): shape (len(instances), buckets.count)."""
    n = max(1, len(mode.instances))
    grid = np.zeros((n, buckets.count))
    if mode.count:
        flat = mode.instance * buckets.count + buckets.index(mode.t)
        grid = np.bincount(flat, minlength=n * buckets.count).astype(np.float64).reshape(n, -1)
    return grid


# ---- fault markers -------------------------------------------------------------------------


@dataclass
class Marker:
    start: float
    end: float | None  # None: a point event (a vertical line)
    action: str
    target: str
    label: str


def _label(event: Event) -> str:
    text = f"{event.action} {event.target}"
    keys = [k for k in event.detail if k not in ("until", "revert", "reverts")]
    if keys:
        first = keys[0]
        value = event.detail[first]
        text += f" {first}" if isinstance(value, dict | list) else f" {first}={value}"
        if len(keys) > 1:
            text += " …"
    return text if len(text) <= 36 else text[:35] + "…"


def _is_revert(event: Event) -> bool:
    return bool(event.detail.get("revert") or event.detail.get("reverts"))


def markers(events: list[Event]) -> list[Marker]:
    """Fault events as chart markers: spans (until / matching revert) or points."""
    result: list[Marker] = []
    open_: dict[str, list[Marker]] = {}  # target -> markers still waiting for a closer
    for event in sorted(events, key=lambda e: e.t):
        waiting = open_.get(event.target, [])
        closer = next(
            (
                m
                for m in reversed(waiting)
                if event.action in CLOSERS.get(m.action, ())
                or (_is_revert(event) and event.action == m.action)
            ),
            None,
        )
        if closer is not None:
            # The revert as applied wins over a planned `until`.
            closer.end = max(event.t, closer.start)
            waiting.remove(closer)
            if event.action not in START_ACTIONS:
                continue  # a pure revert is drawn as the span's end, not on its own
        until = number(event.detail.get("until"))
        marker = Marker(event.t, None, event.action, event.target, _label(event))
        if until is not None and until > event.t:
            marker.end = until
        if event.action in CLOSERS:
            open_.setdefault(event.target, []).append(marker)
        result.append(marker)
    return result
