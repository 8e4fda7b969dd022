"""Runtime state of pools and instances, built once from a policy."""

from __future__ import annotations

import random
from collections.abc import Callable
from urllib.parse import urlsplit

from yarl import URL

from gateway.config import InstancePolicy, Policy, PoolPolicy
from gateway.core.balancer import PeakEwma
from gateway.core.breaker import BreakerState, PoolBreakers
from gateway.core.budget import RetryBudget
from gateway.core.concurrency import Limiter, TokenBudget, limiter_for
from gateway.core.failure_rate import FailureRateState
from gateway.core.health import HealthState
from gateway.core.latency import LatencyState
from gateway.core.tiers import TierTable
from gateway.ingress.routes import PROXY_ROUTES
from gateway.upstream.stats import InstanceStats, PoolStats


class InstanceState:
    """One backend instance: identity, precomputed URLs, and live counters."""

    __slots__ = (
        "base_url",
        "breaker",
        "budget",
        "failures",
        "health",
        "in_flight",
        "latency",
        "limiter",
        "name",
        "name_header",
        "not_before",
        "peak",
        "pool_name",
        "requests",
        "saturated",
        "stats",
        "urls",
        "vllm_cache_usage",
        "vllm_waiting",
    )

    def __init__(
        self,
        pool_name: str,
        policy: InstancePolicy,
        smoothing: float,
        health: HealthState,
        breaker: BreakerState,
        now: float,
        limiter: Limiter | None = None,
        budget: TokenBudget | None = None,
    ) -> None:
        self.pool_name = pool_name
        self.name = policy.name
        self.base_url = policy.url
        self.name_header = policy.name.encode()
        base_path = urlsplit(policy.url).path.rstrip("/")
        # The upstream target comes from the policy and a fixed route table only, never from
        # the client's request target, so no request can reach another host or path.
        self.urls: dict[str, URL] = {
            path: URL(policy.url).with_path(base_path + path) for path in PROXY_ROUTES
        }
        self.in_flight = 0
        self.requests = 0  # attempts sent
        self.failures = 0  # attempts that failed through the instance's fault
        self.latency = LatencyState(smoothing)
        self.health = health
        self.breaker = breaker
        # Peak-EWMA of attempt durations: the balancer's latency, quick to see a slowdown.
        self.peak = PeakEwma(now)
        # Event-loop time before which it gets no new attempt (a Retry-After it asked for).
        self.not_before = 0.0
        self.stats = InstanceStats()
        # Its concurrency limit, when its pool has admission control (None: no cap).
        self.limiter = limiter
        # The KV-cache tokens of the requests it has in flight, when its pool counts them.
        self.budget = budget
        # vLLM's own gauges (None: not scraped, or the last scrape failed) and their verdict.
        self.vllm_waiting: float | None = None
        self.vllm_cache_usage: float | None = None
        self.saturated = False


class PoolState:
    """A pool's instances and the decisions it keeps about them as a whole."""

    __slots__ = (
        "breakers",
        "budget",
        "capacity_listeners",
        "failure",
        "instances",
        "name",
        "next_index",
        "policy",
        "retry_on",
        "rng",
        "routable",
        "stats",
        "tiers",
    )

    def __init__(self, name: str, policy: PoolPolicy, rng: random.Random, now: float) -> None:
        self.name = name
        self.policy = policy
        smoothing = policy.timeouts.smoothing
        health = policy.health
        admission = policy.admission
        self.breakers = PoolBreakers(policy.breaker, [inst.name for inst in policy.instances])
        self.instances = [
            InstanceState(
                name,
                inst,
                smoothing,
                HealthState(now, health.healthy_threshold, health.unhealthy_threshold)
                if health.enabled
                else HealthState.assumed_healthy(now),
                self.breakers[inst.name],
                now,
                limiter_for(admission.concurrency) if admission else None,
                TokenBudget(admission.tokens.capacity, admission.tokens.overcommit)
                if admission and admission.tokens
                else None,
            )
            for inst in policy.instances
        ]
        self.next_index = 0
        self.failure = FailureRateState(policy.retries.failure_smoothing)
        self.tiers = TierTable(policy.retries.tiers)
        self.budget = RetryBudget.from_policy(policy.retries.budget)
        self.retry_on: frozenset[str | int] = frozenset(policy.retries.on)
        self.rng = rng  # jitter and backoff draws
        self.stats = PoolStats(list(policy.models))
        self.routable: list[InstanceState] = []  # healthy instances, kept by `refresh_routable`
        # Told when the pool may take more work than before (admission lets waiters through).
        self.capacity_listeners: list[Callable[[], None]] = []
        self.refresh_routable()

    def refresh_routable(self) -> None:
        """Recompute the healthy instances (on every change of a health verdict)."""
        self.routable = [inst for inst in self.instances if inst.health.healthy]
        self.capacity_changed()

    def capacity_changed(self) -> None:
        """An instance came back, got unsaturated or was restored: tell whoever waits."""
        for listener in self.capacity_listeners:
            listener()


class Registry:
    """Pools by name and by the models they serve."""

    def __init__(self, policy: Policy, now: float, rng: random.Random | None = None) -> None:
        rng = rng or random.Random()
        self.pools = {name: PoolState(name, pool, rng, now) for name, pool in policy.pools.items()}
        self.by_model = {
            model: self.pools[name] for name, pool in policy.pools.items() for model in pool.models
        }
