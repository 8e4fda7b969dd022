"""What a pool and its instances look like at one moment: the one read both the metrics and the
operator's view (/admin/state) make of them.

Each figure is worked out here once, from the state objects that keep it (`PoolState`,
`InstanceState`, the HTTP client's connection counts), so the two views cannot disagree on
what it is and a new one is added in one place, then shown by whichever view wants it. Times
stay event-loop times: a view that shows wall-clock times converts them.

The counters the request path keeps (`PoolStats`, `InstanceStats`) are handed over as they
are, not copied: a scrape runs on the event loop that updates them, so nothing changes them
while a view reads them, and copying every histogram at each scrape would cost for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from yarl import URL

from gateway.core.ewma import Ewma
from gateway.core.tiers import Tier
from gateway.upstream.h1_pool import ConnectionCounts, ConnectionUse
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.stats import InstanceStats, PoolStats


class Estimate(NamedTuple):
    """One latency estimate's EWMA: its mean, deviation, and the samples it learned from."""

    mean_s: float
    deviation_s: float
    samples: int


class Estimates(NamedTuple):
    """An instance's latency predictor, by estimate (the field names are the metrics' label
    values and the operator view's keys)."""

    ttfb: Estimate
    gap: Estimate
    per_token: Estimate
    prefill_per_token: Estimate
    service: Estimate


class Timeouts(NamedTuple):
    """The timeouts the next attempt on an instance would get, by phase: first byte and idle
    gap of a stream, first byte of a whole answer at the policy's assumed max_tokens."""

    connect_s: float | None
    stream_first_byte_s: float | None
    stream_idle_s: float | None
    whole_first_byte_s: float | None


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """One instance as both views show it."""

    name: str
    url: str
    # Its breaker: state, when it last changed (event-loop time), times isolated, the isolation
    # left (inf while forced) and whether an operator forced it.
    state: str
    state_changed_at: float
    isolations: int
    isolation_remaining_s: float
    forced: bool
    in_flight: int
    # None where its pool has no admission control (no limiter) or counts no tokens.
    concurrency_limit: int | None
    room: int | None  # what it may have in flight now (`InstanceState.room`)
    kv_tokens_in_use: int | None
    kv_tokens_budget: int | None
    # What its engine's gauges last said: whether it exports them (None: not read yet, or the
    # read failed), saturated, requests waiting, KV-cache usage; its slots while saturated and
    # the batch it was seen running (None: none yet).
    engine_gauges: bool | None
    saturated: bool
    engine_waiting: float | None
    engine_cache_usage: float | None
    engine_slots: int | None
    engine_batch: int | None
    requests: int
    failures: int
    streaming: int
    capacity_seen: int
    prefill_holds: int
    stats: InstanceStats  # attempts by outcome, probes by result, timeouts by phase and blame
    peak_ewma_s: float  # the balancer's price
    penalty_s: float | None
    retry_after_remaining_s: float
    healthy: bool | None
    health_reason: str
    cold_start_s: float | None
    estimates: Estimates
    timeouts: Timeouts


@dataclass(frozen=True, slots=True)
class DiscoverySnapshot:
    """Where a pool's instances come from, and what its source last said (event-loop times;
    None: not yet, or not since the last answer)."""

    source: str
    target: str
    instances: tuple[str, ...]
    refreshed_at: float | None
    last_error: str | None
    failed_at: float | None
    errors: int
    changes: int
    empty_since: float | None  # an empty answer not believed yet: since when answers are empty
    shadowed: tuple[str, ...]  # found names a listed instance has already


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A pool as both views show it: its retry state, counters, discovery and instances."""

    name: str
    models: tuple[str, ...]
    # Where its upstream credential comes from, as (header, source); never its value.
    credentials: tuple[str, str] | None
    failure_rate: float
    tier: Tier  # the one the failure rate selects
    retry_budget: tuple[int, int]  # (requests, retries) in its window
    stats: PoolStats
    discovery: DiscoverySnapshot | None  # None: its instances are only the policy's
    instances: tuple[InstanceSnapshot, ...]


def pool_snapshot(pool: PoolState, now: float) -> PoolSnapshot:
    """The pool, its discovery and every instance of it, at `now` (event-loop time)."""
    rate = pool.failure.rate
    tier = pool.tiers.choose(rate)
    credentials = pool.policy.credentials
    return PoolSnapshot(
        name=pool.name,
        models=tuple(pool.policy.models),
        credentials=((credentials.header, credentials.source) if credentials is not None else None),
        failure_rate=rate,
        tier=tier,
        retry_budget=pool.budget.counts(now),
        stats=pool.stats,
        discovery=discovery_snapshot(pool),
        instances=tuple(instance_snapshot(pool, inst, tier.k, now) for inst in pool.instances),
    )


def discovery_snapshot(pool: PoolState) -> DiscoverySnapshot | None:
    """What the pool's discovery source last said; None when it has none."""
    policy, found = pool.declared.discovery, pool.found
    if policy is None or found is None:
        return None
    if policy.dns is not None:
        target = f"{policy.dns.type} {policy.dns.name}"
    else:
        assert policy.kubernetes is not None
        k8s = policy.kubernetes
        target = f"{k8s.namespace or '(own namespace)'}/{k8s.service or k8s.selector}"
    return DiscoverySnapshot(
        source=policy.source,
        target=target,
        instances=tuple(e.name for e in found.endpoints),
        refreshed_at=found.refreshed_at,
        last_error=found.last_error,
        failed_at=found.failed_at,
        errors=found.errors,
        changes=found.changes,
        empty_since=found.empty_since,
        shadowed=tuple(found.shadowed),
    )


def instance_snapshot(
    pool: PoolState, inst: InstanceState, k: float, now: float
) -> InstanceSnapshot:
    """One instance of `pool` at `now`; `k`: the width of the timeouts its pool's tier sets."""
    breaker, engine, budget, limiter = inst.breaker, inst.engine, inst.budget, inst.limiter
    latency, health = inst.latency, inst.health
    penalty = inst.price.penalty
    stream = pool.timing.timeouts_for(inst, k, now, stream=True, max_tokens=None)
    whole = pool.timing.timeouts_for(inst, k, now, stream=False, max_tokens=None)
    return InstanceSnapshot(
        name=inst.name,
        url=inst.base_url,
        state=breaker.state,
        state_changed_at=breaker.changed_at,
        isolations=breaker.isolations,
        isolation_remaining_s=breaker.remaining_s(now),
        forced=breaker.forced,
        in_flight=inst.in_flight,
        concurrency_limit=limiter.limit if limiter is not None else None,
        room=inst.room() if limiter is not None else None,
        kv_tokens_in_use=budget.used if budget is not None else None,
        kv_tokens_budget=budget.budget if budget is not None else None,
        engine_gauges=engine.gauges,
        saturated=engine.saturated,
        engine_waiting=engine.waiting,
        engine_cache_usage=engine.cache_usage,
        engine_slots=engine.slots if engine.saturated else None,
        engine_batch=engine.batch or None,
        requests=inst.requests,
        failures=inst.failures,
        streaming=inst.streaming,
        capacity_seen=inst.capacity_seen,
        prefill_holds=inst.holds,
        stats=inst.stats,
        peak_ewma_s=inst.price.peak.peek(now),
        penalty_s=penalty.peek(now) if penalty is not None else None,
        retry_after_remaining_s=max(0.0, inst.not_before - now),
        healthy=health.healthy,
        health_reason=health.last_reason,
        cold_start_s=health.cold_start_s,
        estimates=Estimates(
            _estimate(latency.ttfb),
            _estimate(latency.gap),
            _estimate(latency.per_token),
            _estimate(latency.prefill),
            _estimate(latency.service),
        ),
        timeouts=Timeouts(stream.connect_s, stream.first_byte_s, stream.idle_s, whole.first_byte_s),
    )


def _estimate(ewma: Ewma) -> Estimate:
    return Estimate(ewma.mean, ewma.deviation, ewma.samples)


class ConnectionCounter(Protocol):
    """The HTTP client the attempts go through, as far as its connections are read
    (`H1Client`): those open to an address now, and what happened to them since it started."""

    def connection_use(self, url: URL) -> ConnectionUse: ...

    def connection_counts(self, url: URL) -> ConnectionCounts | None: ...


class ConnectionSnapshot(NamedTuple):
    """The connections to one instance's address: now (busy, idle, opening), and since the
    client started (opened, reused, resent, waited, refused; all 0 before any request)."""

    busy: int
    idle: int
    opening: int
    opened: int
    reused: int
    resent: int
    waited: int
    refused: int


def connection_snapshot(client: ConnectionCounter, url: str) -> ConnectionSnapshot:
    """The connections `client` has to the address of `url` (an instance's base URL)."""
    address = URL(url)
    use = client.connection_use(address)
    counts = client.connection_counts(address)
    if counts is None:  # no request went there yet
        return ConnectionSnapshot(use.busy, use.idle, use.opening, 0, 0, 0, 0, 0)
    return ConnectionSnapshot(
        use.busy,
        use.idle,
        use.opening,
        counts.opened,
        counts.reused,
        counts.resent,
        counts.waited,
        counts.refused,
    )
