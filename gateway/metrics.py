"""Prometheus metrics, read from the gateway's live state when scraped.

A collector takes one snapshot of each pool, its instances and its admission at scrape time
(`gateway.upstream.snapshot`, `gateway.pipeline.admission_snapshot`: the figures the operator's
view shows too), so the request path pays only for plain counters on objects it already holds
(`gateway.upstream.stats`): no metric objects, label lookups or locks per request. Labels stay
bounded: pools, models and instances come from the policy, outcomes and phases from fixed sets;
never request ids or raw paths. A backend instance is the `backend` label: Prometheus keeps
`instance` for the scrape target.
"""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gateway import __version__
from gateway.core.admission import CLASSES
from gateway.core.breaker import ADMITTING, ISOLATED, PROBING
from gateway.core.histogram import Histogram
from gateway.ingress.refusals import IngressRefusals
from gateway.pipeline.admission_snapshot import AdmissionSnapshot, admission_snapshot
from gateway.pipeline.admit import PoolAdmission
from gateway.reload import ReloadStats
from gateway.upstream.pool import PoolState
from gateway.upstream.snapshot import (
    ConnectionCounter,
    Estimates,
    InstanceSnapshot,
    PoolSnapshot,
    Timeouts,
    connection_snapshot,
    pool_snapshot,
)
from gateway.upstream.stats import HEDGE_RESULTS


@dataclass(frozen=True)
class Observed:
    """What the metrics read, and only read: the gateway's long-lived state objects (a policy
    reload changes them in place, so they stay the ones to read)."""

    pools: Mapping[str, PoolState]
    admissions: Mapping[str, PoolAdmission]
    refusals: IngressRefusals  # the data plane's
    shared: Callable[[], dict[str, Any]]  # the decision store's status
    reloads: ReloadStats
    upstream: ConnectionCounter  # the HTTP client: its connection counts


_STATES = (ADMITTING, ISOLATED, PROBING)
_BACKEND = ["pool", "backend"]
# The label values of the snapshots' figures: `stream_first_byte` for `stream_first_byte_s`.
_TIMEOUT_PHASES = tuple(name.removesuffix("_s") for name in Timeouts._fields)
_ESTIMATES = Estimates._fields


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    return [
        ("+Inf" if bound == float("inf") else repr(bound), float(count))
        for bound, count in histogram.cumulative()
    ]


class GatewayCollector(Collector):
    def __init__(self, observed: Observed) -> None:
        self._observed = observed

    def collect(self) -> Iterator[Metric]:
        observed = self._observed
        now = asyncio.get_running_loop().time()
        pools = [pool_snapshot(pool, now) for pool in observed.pools.values()]
        # Each admission with the instances of its pool (`Gateway._sync_admissions` keeps an
        # admission only under its own pool's name).
        instances = {pool.name: pool.instances for pool in pools}
        admissions = [
            (name, admission_snapshot(admission, now), instances.get(name, ()))
            for name, admission in observed.admissions.items()
        ]
        yield from _requests(pools)
        yield from _streams_and_tokens(pools)
        yield from _fallbacks(pools)
        yield from _connections(pools, observed.upstream)
        yield from _instances(pools)
        yield from _latency(pools)
        yield from _pools(pools)
        yield from _admission(admissions)
        yield from _engines(admissions)
        yield from _tenants(admissions)
        yield from self._shared()
        yield from self._policy()
        yield from _discovery(pools)
        yield from self._ingress()

    def _ingress(self) -> Iterator[Metric]:
        refusals = CounterMetricFamily(
            "gateway_ingress_refusals",
            "Requests the data plane's ingress answered itself, by reason (slow or oversized "
            "heads and bodies, over the connection cap, no valid client API key)",
            labels=["reason"],
        )
        for reason, count in self._observed.refusals.counts.items():
            refusals.add_metric([reason], count)
        yield refusals

    def _policy(self) -> Iterator[Metric]:
        stats = self._observed.reloads
        reloads = CounterMetricFamily(
            "gateway_policy_reloads",
            "Policy reloads by result (error: invalid or restart-only; the old policy kept)",
            labels=["result"],
        )
        reloads.add_metric(["ok"], stats.ok)
        reloads.add_metric(["error"], stats.errors)
        yield reloads
        yield GaugeMetricFamily(
            "gateway_policy_last_reload_successful",
            "1 when the last reload was applied (or none was tried); 0 while the last one was "
            "refused: the policy file holds what the gateway does not serve",
            value=1.0 if stats.last_ok else 0.0,
        )
        yield GaugeMetricFamily(
            "gateway_policy_version",
            "Version of the policy served: 1 at startup, +1 per reload that changed something",
            value=stats.version,
        )
        yield GaugeMetricFamily(
            "gateway_policy_loaded_timestamp_seconds",
            "Unix time the policy served was loaded",
            value=stats.loaded_at,
        )

    def _shared(self) -> Iterator[Metric]:
        shared = self._observed.shared()
        if not shared.get("configured"):
            return  # no `shared`: nothing to be connected to (an alert on 0 would be noise)
        yield GaugeMetricFamily(
            "gateway_shared_state_connected",
            "1 while the replica shares decisions through Redis; 0 when it decides alone",
            value=1.0 if shared.get("connected") else 0.0,
        )
        events = CounterMetricFamily(
            "gateway_shared_decisions",
            "Shared-decision events by kind (published, adopted, lifted, suppressed, malformed...)",
            labels=["event"],
        )
        for event, count in shared.get("counters", {}).items():
            events.add_metric([event], count)
        yield events


def _requests(pools: Sequence[PoolSnapshot]) -> Iterator[Metric]:
    """Client requests and their latencies, retries and timeouts, by pool."""
    requests = CounterMetricFamily(
        "gateway_requests",
        "Client requests routed to a pool, by model and status class of the answer "
        "(499: the client left first)",
        labels=["pool", "model", "status_class"],
    )
    duration = HistogramMetricFamily(
        "gateway_request_duration_seconds",
        "Time from a request's arrival to the end of its answer (a stream's last byte)",
        labels=["pool", "model"],
    )
    ttfb = HistogramMetricFamily(
        "gateway_time_to_first_byte_seconds",
        "Time from a request's arrival to the backend's first byte, retries included",
        labels=["pool", "model"],
    )
    retries = CounterMetricFamily(
        "gateway_retries",
        "Attempts retried, by the outcome that caused the retry",
        labels=["pool", "reason"],
    )
    timeouts = CounterMetricFamily(
        "gateway_timeouts",
        "Attempts that timed out, by the phase that ran out (connect, first_byte, idle, deadline)",
        labels=["pool", "phase"],
    )
    exhausted = CounterMetricFamily(
        "gateway_retry_budget_exhausted",
        "Retries the pool's retry budget refused",
        labels=["pool"],
    )
    for pool in pools:
        name, stats = pool.name, pool.stats
        for (model, klass), count in stats.requests.items():
            requests.add_metric([name, model, klass], count)
        for model, histogram in stats.duration.items():
            duration.add_metric([name, model], _buckets(histogram), histogram.sum)
        for model, histogram in stats.ttfb.items():
            ttfb.add_metric([name, model], _buckets(histogram), histogram.sum)
        for reason, count in stats.retries.items():
            retries.add_metric([name, reason], count)
        for phase, count in stats.timeouts.items():
            timeouts.add_metric([name, phase], count)
        exhausted.add_metric([name], stats.budget_exhausted)
    yield from (requests, duration, ttfb, retries, timeouts, exhausted)


def _streams_and_tokens(pools: Sequence[PoolSnapshot]) -> Iterator[Metric]:
    """Streams resumed or not after their first byte, hedges, and the tokens answers used."""
    resumes = CounterMetricFamily(
        "gateway_stream_resumes",
        "Streams continued on another attempt after their first byte, by the instance "
        "that broke them and why (reset, eof, idle_timeout, error_event, protocol), or "
        "why the gateway moved them (isolated, slow)",
        labels=["pool", "backend", "reason"],
    )
    not_resumed = CounterMetricFamily(
        "gateway_stream_resume_refusals",
        "Streams that broke after their first byte and were not continued, by why not",
        labels=["pool", "reason"],
    )
    hedges = CounterMetricFamily(
        "gateway_hedges",
        "Hedged first attempts by how they ended: won (answered first), lost, failed "
        "(both attempts failed), no_budget (due, but the retry budget refused it)",
        labels=["pool", "result"],
    )
    tokens = CounterMetricFamily(
        "gateway_tokens",
        "Tokens the answers said they used (their `usage`), by model and type (input, "
        "output); answers that give none are not counted",
        labels=["pool", "model", "type"],
    )
    per_token = HistogramMetricFamily(
        "gateway_time_per_output_token_seconds",
        "A stream's time from its first to its last byte over its output tokens after the "
        "first (streams that say their usage)",
        labels=["pool", "model"],
    )
    for pool in pools:
        name, stats = pool.name, pool.stats
        for (model, kind), count in stats.tokens.items():
            tokens.add_metric([name, model, kind], count)
        for model, histogram in stats.per_output_token.items():
            per_token.add_metric([name, model], _buckets(histogram), histogram.sum)
        for (instance, reason), count in stats.resumes.items():
            resumes.add_metric([name, instance, reason], count)
        for reason, count in stats.resume_refusals.items():
            not_resumed.add_metric([name, reason], count)
        for result in HEDGE_RESULTS:
            hedges.add_metric([name, result], stats.hedges.get(result, 0))
    yield from (resumes, not_resumed, hedges, tokens, per_token)


def _fallbacks(pools: Sequence[PoolSnapshot]) -> Iterator[Metric]:
    """Requests handed over to a fallback pool, and fallbacks that could not take one."""
    fallbacks = CounterMetricFamily(
        "gateway_fallbacks",
        "Requests a pool could not answer, handed over to another before their first byte, "
        "by the pool they left, the pool they went to and why (unavailable, shed, "
        "retries_exhausted, rate_limited, server_error, context_length; refused: the "
        "fallback before refused it too)",
        labels=["from", "to", "reason"],
    )
    skips = CounterMetricFamily(
        "gateway_fallback_skips",
        "Fallback pools passed over for a request they could not take, by why (api: "
        "another API family, untranslatable; form: a multipart body; unknown_pool)",
        labels=["from", "to", "reason"],
    )
    for pool in pools:
        name, stats = pool.name, pool.stats
        for (to, reason), count in stats.fallbacks.items():
            fallbacks.add_metric([name, to, reason], count)
        for (to, why), count in stats.fallback_skips.items():
            skips.add_metric([name, to, why], count)
    yield from (fallbacks, skips)


def _connections(pools: Sequence[PoolSnapshot], client: ConnectionCounter) -> Iterator[Metric]:
    """The upstream connections to each instance's address."""
    connections = GaugeMetricFamily(
        "gateway_upstream_connections",
        "Connections to each instance's address, by state (busy, idle, opening)",
        labels=[*_BACKEND, "state"],
    )
    opened = CounterMetricFamily(
        "gateway_upstream_connections_opened",
        "Connections opened to each instance's address (TCP, and TLS for https)",
        labels=_BACKEND,
    )
    reused = CounterMetricFamily(
        "gateway_upstream_connection_reuses",
        "Requests written into a kept-alive connection",
        labels=_BACKEND,
    )
    resent = CounterMetricFamily(
        "gateway_upstream_stale_resends",
        "Requests sent once more on a fresh connection because the kept-alive one they "
        "went out on was being closed by the instance (not charged to it)",
        labels=_BACKEND,
    )
    waits = CounterMetricFamily(
        "gateway_upstream_connection_waits",
        "Requests that queued for a connection because connections.max were busy",
        labels=_BACKEND,
    )
    refusals = CounterMetricFamily(
        "gateway_upstream_connection_limit_refusals",
        "Requests no connection came free for within the connect timeout (a 503 "
        "upstream_connection_limit, tried elsewhere; not charged to the instance)",
        labels=_BACKEND,
    )
    for pool in pools:
        for inst in pool.instances:
            ids = [pool.name, inst.name]
            seen = connection_snapshot(client, inst.url)
            connections.add_metric([*ids, "busy"], seen.busy)
            connections.add_metric([*ids, "idle"], seen.idle)
            connections.add_metric([*ids, "opening"], seen.opening)
            opened.add_metric(ids, seen.opened)
            reused.add_metric(ids, seen.reused)
            resent.add_metric(ids, seen.resent)
            waits.add_metric(ids, seen.waited)
            refusals.add_metric(ids, seen.refused)
    yield from (connections, opened, reused, resent, waits, refusals)


def _instances(pools: Sequence[PoolSnapshot]) -> Iterator[Metric]:
    """Each instance's breaker, health, load and attempts."""
    state = GaugeMetricFamily(
        "gateway_instance_state",
        "1 for the breaker state each instance is in (ADMITTING, ISOLATED, PROBING)",
        labels=[*_BACKEND, "state"],
    )
    healthy = GaugeMetricFamily(
        "gateway_instance_healthy", "1 while health checks pass", labels=_BACKEND
    )
    in_flight = GaugeMetricFamily(
        "gateway_instance_in_flight", "Attempts in progress", labels=_BACKEND
    )
    attempts = CounterMetricFamily(
        "gateway_upstream_attempts",
        "Attempts sent to each instance, by outcome (ok, http_<status>, timeout, "
        "connect_failure, reset, protocol, oom)",
        labels=[*_BACKEND, "outcome"],
    )
    ooms = CounterMetricFamily(
        "gateway_backend_ooms",
        "Attempts the backend failed for lack of GPU memory (vLLM's CUDA out of memory)",
        labels=_BACKEND,
    )
    isolations = CounterMetricFamily(
        "gateway_isolations",
        "Times each instance was isolated here (its own trips, operators, shared decisions)",
        labels=_BACKEND,
    )
    probes = CounterMetricFamily(
        "gateway_probes",
        "Probes of isolated instances, by result",
        labels=[*_BACKEND, "result"],
    )
    timeouts = CounterMetricFamily(
        "gateway_instance_timeouts",
        "Attempts each instance timed out, by phase (connect, first_byte, idle, total) and "
        "whether it was blamed (false: it waited behind a busy instance that kept working)",
        labels=[*_BACKEND, "phase", "blamed"],
    )
    for pool in pools:
        for inst in pool.instances:
            ids = [pool.name, inst.name]
            for name in _STATES:
                state.add_metric([*ids, name], 1.0 if name == inst.state else 0.0)
            healthy.add_metric(ids, 1.0 if inst.healthy else 0.0)
            in_flight.add_metric(ids, inst.in_flight)
            stats = inst.stats
            for outcome, count in stats.attempts.items():
                attempts.add_metric([*ids, outcome], count)
            ooms.add_metric(ids, stats.attempts.get("oom", 0))
            isolations.add_metric(ids, inst.isolations)
            for result, count in stats.probes.items():
                probes.add_metric([*ids, result], count)
            for (phase, blamed), count in stats.timeouts.items():
                timeouts.add_metric([*ids, phase, "true" if blamed else "false"], count)
    yield from (state, healthy, in_flight, attempts, ooms, isolations, probes, timeouts)


def _latency(pools: Sequence[PoolSnapshot]) -> Iterator[Metric]:
    """What each instance's next attempt would be given, and what its latency is estimated at."""
    timeout = GaugeMetricFamily(
        "gateway_instance_timeout_seconds",
        "The timeout the next attempt would get, per phase (first byte and idle gap of a "
        "stream; first byte of a whole answer at the assumed max_tokens; connect)",
        labels=[*_BACKEND, "phase"],
    )
    ewma = GaugeMetricFamily(
        "gateway_instance_latency_ewma_seconds",
        "The latency predictor per instance: EWMA mean and deviation of time to first "
        "byte, gap between chunks, and time per token",
        labels=[*_BACKEND, "estimate", "stat"],
    )
    peak = GaugeMetricFamily(
        "gateway_instance_peak_ewma_seconds",
        "The balancer's peak-EWMA latency per instance",
        labels=_BACKEND,
    )
    for pool in pools:
        for inst in pool.instances:
            ids = [pool.name, inst.name]
            for phase, seconds in zip(_TIMEOUT_PHASES, inst.timeouts, strict=True):
                if seconds is not None:
                    timeout.add_metric([*ids, phase], seconds)
            for name, estimate in zip(_ESTIMATES, inst.estimates, strict=True):
                if estimate.samples:
                    ewma.add_metric([*ids, name, "mean"], estimate.mean_s)
                    ewma.add_metric([*ids, name, "deviation"], estimate.deviation_s)
            peak.add_metric(ids, inst.peak_ewma_s)
    yield from (timeout, ewma, peak)


def _pools(pools: Sequence[PoolSnapshot]) -> Iterator[Metric]:
    failure = GaugeMetricFamily(
        "gateway_pool_failure_rate",
        "EMA of the share of attempts that failed through an instance's fault",
        labels=["pool"],
    )
    tier = GaugeMetricFamily(
        "gateway_pool_tier",
        "The retry tier the failure rate selects (0: the healthiest)",
        labels=["pool"],
    )
    max_retries = GaugeMetricFamily(
        "gateway_pool_max_retries", "Retries the current tier allows", labels=["pool"]
    )
    panics = CounterMetricFamily(
        "gateway_pool_panic_attempts",
        "Attempts sent to the least bad instances because none of the pool was healthy and "
        "admitting (breaker.when_none_available: panic)",
        labels=["pool"],
    )
    for pool in pools:
        failure.add_metric([pool.name], pool.failure_rate)
        tier.add_metric([pool.name], pool.tier.index)
        max_retries.add_metric([pool.name], pool.tier.max_retries)
        panics.add_metric([pool.name], pool.stats.panics)
    yield from (failure, tier, max_retries, panics)


# A pool's admission, with the instances of its pool.
_Admitted = tuple[str, AdmissionSnapshot, tuple[InstanceSnapshot, ...]]


def _admission(admissions: Sequence[_Admitted]) -> Iterator[Metric]:
    """Each admission's queues, slots, and what it shed or sent on past a limit."""
    queued = GaugeMetricFamily(
        "gateway_admission_queued",
        "Requests waiting in each admission class's queue",
        labels=["pool", "class"],
    )
    shed = CounterMetricFamily(
        "gateway_shed_requests",
        "Requests answered 429 by admission control, by class (refused, evicted, timed out)",
        labels=["pool", "class"],
    )
    overflow = CounterMetricFamily(
        "gateway_admission_overflow",
        "Requests sent on past a learned concurrency limit (no engine gauges, fixed limit "
        "or token budget held them): while they did not flood the pool, or interactive ones "
        "that would have been shed, by class",
        labels=["pool", "class"],
    )
    running = GaugeMetricFamily(
        "gateway_admission_running",
        "Requests let through admission and not finished (slots of the pool, and requests "
        "sent on past a learned limit)",
        labels=["pool"],
    )
    room = GaugeMetricFamily(
        "gateway_admission_room",
        "Slots of the pool: the concurrency limits of its instances taking traffic",
        labels=["pool"],
    )
    wait = HistogramMetricFamily(
        "gateway_admission_queue_wait_seconds",
        "Time admitted requests waited for a slot, by class (0 for those that did not)",
        labels=["pool", "class"],
    )
    for name, admission, _ in admissions:
        for klass in CLASSES:
            queued.add_metric([name, klass], admission.queued[klass])
            shed.add_metric([name, klass], admission.shed[klass])
            overflow.add_metric([name, klass], admission.overflow[klass])
            histogram = admission.waits[klass]
            wait.add_metric([name, klass], _buckets(histogram), histogram.sum)
        running.add_metric([name], admission.running)
        room.add_metric([name], admission.room)
    yield from (queued, shed, overflow, running, room, wait)


def _engines(admissions: Sequence[_Admitted]) -> Iterator[Metric]:
    """What admission holds each instance to: its limit, KV-cache tokens, its engine's gauges."""
    limit = GaugeMetricFamily(
        "gateway_instance_concurrency_limit",
        "Attempts an instance may have in flight (fixed, or learned from its latency)",
        labels=_BACKEND,
    )
    tokens = GaugeMetricFamily(
        "gateway_instance_kv_tokens_in_use",
        "Estimated KV-cache tokens of the attempts in flight on the instance",
        labels=_BACKEND,
    )
    budget = GaugeMetricFamily(
        "gateway_instance_kv_tokens_budget",
        "The KV-cache tokens the instance may hold (its engine's size, or the policy's)",
        labels=_BACKEND,
    )
    saturated = GaugeMetricFamily(
        "gateway_instance_saturated",
        "1 while vLLM's own gauges say the instance should get no new work",
        labels=_BACKEND,
    )
    waiting = GaugeMetricFamily(
        "gateway_instance_vllm_waiting_requests",
        "Requests waiting in the instance's engine, as its gauges last said",
        labels=_BACKEND,
    )
    cache = GaugeMetricFamily(
        "gateway_instance_vllm_cache_usage_ratio",
        "The instance's KV-cache usage (0..1), as its engine's gauges last said",
        labels=_BACKEND,
    )
    for name, admission, instances in admissions:
        for inst in instances:
            ids = [name, inst.name]
            if inst.concurrency_limit is not None:
                limit.add_metric(ids, inst.concurrency_limit)
            if inst.kv_tokens_in_use is not None and inst.kv_tokens_budget is not None:
                tokens.add_metric(ids, inst.kv_tokens_in_use)
                budget.add_metric(ids, inst.kv_tokens_budget)
            if admission.engine_signals:
                saturated.add_metric(ids, 1.0 if inst.saturated else 0.0)
                if inst.engine_waiting is not None:
                    waiting.add_metric(ids, inst.engine_waiting)
                if inst.engine_cache_usage is not None:
                    cache.add_metric(ids, inst.engine_cache_usage)
    yield from (limit, tokens, budget, saturated, waiting, cache)


def _tenants(admissions: Sequence[_Admitted]) -> Iterator[Metric]:
    tenant_queued = GaugeMetricFamily(
        "gateway_admission_tenant_queued",
        "Requests waiting by tenant and class (the 20 tenants with the most waiting in "
        'each class; the rest as tenant="(other)")',
        labels=["pool", "class", "tenant"],
    )
    tenant_shed = CounterMetricFamily(
        "gateway_admission_tenant_shed",
        "Requests answered 429 by admission control, by tenant (the 100 tenants shed "
        'most recently; the rest as tenant="(other)")',
        labels=["pool", "tenant"],
    )
    for name, admission, _ in admissions:
        for tenant, count in admission.tenants_shed:
            tenant_shed.add_metric([name, tenant], count)
        for klass in CLASSES:
            for tenant, count in admission.tenants_queued[klass].items():
                tenant_queued.add_metric([name, klass, tenant], count)
    yield from (tenant_queued, tenant_shed)


def _discovery(pools: Sequence[PoolSnapshot]) -> Iterator[Metric]:
    errors = CounterMetricFamily(
        "gateway_discovery_errors",
        "Discovery refreshes that failed (resolver or API error: the last known instances "
        "stayed), by pool and source",
        labels=["pool", "source"],
    )
    changes = CounterMetricFamily(
        "gateway_discovery_changes",
        "Discovery answers that changed a pool's instances",
        labels=["pool", "source"],
    )
    found = GaugeMetricFamily(
        "gateway_discovery_instances",
        "Instances a pool's discovery source last gave",
        labels=["pool", "source"],
    )
    discovering = False
    for pool in pools:
        record = pool.discovery
        if record is None:
            continue
        discovering = True
        labels = [pool.name, record.source]
        errors.add_metric(labels, record.errors)
        changes.add_metric(labels, record.changes)
        found.add_metric(labels, len(record.instances))
    if discovering:  # no empty families where no pool discovers
        yield errors
        yield changes
        yield found


class BuildInfo(Collector):
    """`gateway_build_info{version, python}`: 1, for dashboards and alerts to tell releases."""

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "gateway_build_info",
            "The gateway's version and Python's (always 1)",
            labels=["version", "python"],
        )
        info.add_metric([__version__, platform.python_version()], 1.0)
        yield info


def build_registry(observed: Observed) -> CollectorRegistry:
    """The gateway's metrics, its build, and its process's (CPU, memory, file descriptors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(observed))
    registry.register(BuildInfo())
    ProcessCollector(registry=registry)
    return registry
