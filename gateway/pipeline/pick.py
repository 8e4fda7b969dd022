"""The layer that chooses an instance for each attempt: the balancer, as a layer."""

from __future__ import annotations

import asyncio

from gateway.core.balancer import choose, load_cost, slow_start_weight
from gateway.core.breaker import ADMITTING
from gateway.errors import NoInstanceAvailable
from gateway.pipeline.call import Call, Handler
from gateway.upstream.registry import InstanceState, PoolState
from gateway.upstream.response import UpstreamResponse


class Pick:
    """Power of two choices over the instances that may take this attempt, by peak-EWMA
    latency x (in-flight + 1), so a slow-but-alive instance gets less traffic before any breaker
    trips (as tower, Finagle and Linkerd balance).

    May take it: healthy, breaker ADMITTING, not tried by this request yet, not waiting out a
    Retry-After; in pools with admission control also below its concurrency limit, with room
    in its KV-token budget for the request, and not saturated by vLLM's account. An isolated
    instance whose isolation ran out takes the attempt as its one probe (a real request)
    first. When every healthy instance was tried, is paused or is full, one of those
    is used rather than failing; when none is healthy and admitting, the client is
    told at once (503 + Retry-After): no waiting on a dead pool; unless the pool's policy says
    `breaker.when_none_available: panic`, and then every instance is a candidate again.
    """

    def __init__(self) -> None:
        self._clock = asyncio.get_running_loop().time

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        pool = call.pool
        now = self._clock()
        tried = call.tried
        tokens = call.tokens
        reserved = call.reserved  # holds this request's tokens already
        # One pass: a due probe wins; else the admitting instances this request may use.
        fresh: list[InstanceState] = []
        admitting: list[InstanceState] = []
        probe = None
        for inst in pool.routable:
            breaker = inst.breaker
            if breaker.state == ADMITTING:
                admitting.append(inst)
                limiter = inst.limiter
                budget = inst.budget
                if (
                    inst.not_before <= now
                    and inst not in tried
                    and not inst.saturated
                    and (limiter is None or inst.in_flight < limiter.limit)
                    and (budget is None or inst is reserved or budget.fits(tokens))
                ):
                    fresh.append(inst)
            elif probe is None and breaker.try_admit(now):
                probe = inst
        if probe is not None:
            instance = probe
        elif admitting:
            instance = _balance(pool, fresh or admitting, now)
        elif pool.policy.breaker.when_none_available == "panic":
            untried = [i for i in pool.instances if i not in tried]
            instance = _balance(pool, untried or pool.instances, now)
        else:
            raise NoInstanceAvailable(
                f"no instance of pool {pool.name!r} is available",
                retry_after_s=_retry_after_s(pool, now),
            )
        call.probe = probe is not None
        call.instance = instance
        tried.append(instance)
        call.attempts += 1
        return await next_handler(call)


def _balance(pool: PoolState, candidates: list[InstanceState], now: float) -> InstanceState:
    slow_start_s = pool.policy.health.slow_start

    def cost(inst: InstanceState) -> float:
        weight = 1.0
        if slow_start_s and inst.health.healthy_since is not None:
            weight = slow_start_weight(now, inst.health.healthy_since, slow_start_s)
        if inst.requests > inst.in_flight:
            latency = inst.peak.get(now)
        else:
            # No finished attempt yet, so no latency of its own: costed at its peers' average,
            # neither shunned (a made-up high guess) nor flooded (a guess of zero).
            measured = [i.peak.get(now) for i in candidates if i.requests > i.in_flight]
            latency = sum(measured) / len(measured) if measured else 0.0
        return load_cost(latency, inst.in_flight, weight)

    chosen = choose(candidates, cost, pool.rng)
    assert chosen is not None
    return chosen


def _retry_after_s(pool: PoolState, now: float) -> float:
    """When to come back: the nearest end of an isolation, else the next health check."""
    ends = [i.breaker.remaining_s(now) for i in pool.routable]
    finite = [e for e in ends if 0 < e < float("inf")]
    return min(finite) if finite else pool.policy.health.interval
