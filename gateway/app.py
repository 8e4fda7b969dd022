"""The gateway's runtime: state built from a policy, the request pipeline, and the two ASGI apps."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from starlette.types import ASGIApp

from gateway.cluster import build_store
from gateway.config import Policy
from gateway.core.balancer import PeakEwma
from gateway.core.breaker import ADMITTING, Transition
from gateway.core.ewma import Ewma
from gateway.core.timeouts import attempt_timeouts
from gateway.ingress.asgi import DataPlane
from gateway.pipeline.account import Account, OnTransition
from gateway.pipeline.admit import Admit, PoolAdmission
from gateway.pipeline.attempt_span import AttemptSpans
from gateway.pipeline.call import Layer
from gateway.pipeline.chain import compose
from gateway.pipeline.deadline import deadline
from gateway.pipeline.pick import Pick
from gateway.pipeline.retry import Retry
from gateway.pipeline.watchdog import Watchdog
from gateway.telemetry.logs import access_log
from gateway.telemetry.tracing import setup_tracing, traced_transitions
from gateway.upstream.health import HealthChecker
from gateway.upstream.registry import InstanceState, PoolState, Registry
from gateway.upstream.transport import Transport, new_session
from gateway.upstream.vllm_load import VllmLoadScraper


class Gateway:
    """Everything one gateway process serves from. Create it inside the running event loop."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.tracing = setup_tracing(policy.telemetry)  # first: it may refuse the environment
        self.registry = Registry(policy, now=asyncio.get_running_loop().time())
        self.session: aiohttp.ClientSession = new_session()
        self.health = HealthChecker(self.registry, self.session)
        self.vllm_load = VllmLoadScraper(self.registry, self.session)
        self.decisions = build_store(policy, self.registry)
        self.watchdog = Watchdog()
        self.watchdog.start()
        on_transition: OnTransition = self._on_transition
        if self.tracing is not None:
            on_transition = traced_transitions(on_transition)
        # Outermost first. Admission (pools that have it) holds a slot for the whole exchange;
        # the retry loop wraps the attempts: each picks an instance,
        # is accounted against it, and gets its own timeouts (the deadline layer) before it
        # is sent; traced, each attempt is a CLIENT span around the transport.
        self.admissions = {
            name: PoolAdmission(pool, pool.policy.admission)
            for name, pool in self.registry.pools.items()
            if pool.policy.admission is not None
        }
        layers: list[Layer] = [Admit(self.admissions)] if self.admissions else []
        layers += [
            Retry(traced=self.tracing is not None),
            Pick(),
            Account(self.registry.pools, on_transition),
            deadline,
        ]
        if self.tracing is not None:
            layers.append(AttemptSpans(self.tracing))
        handler = compose(layers, Transport(self.session, self.watchdog))
        self.data_app = DataPlane(
            self.registry,
            handler,
            max_request_bytes=policy.limits.max_request_bytes,
            readiness=self.readiness,
            tracing=self.tracing,
        )
        from gateway.admin import build_admin_app  # the admin plane depends on Gateway

        self.admin_app: ASGIApp = build_admin_app(self)

    def _on_transition(self, pool: str, transition: Transition, operator: bool = False) -> None:
        """Share a breaker's transition; one back to ADMITTING makes room for waiting requests."""
        self.decisions.record(pool, transition, operator)
        if transition.to == ADMITTING and transition.state_from != ADMITTING:
            self.registry.pools[pool].capacity_changed()

    async def start(self) -> None:
        """Know which instances are healthy, and what other replicas decided (bounded: Redis
        being down must not keep us from serving), before serving; then keep checking."""
        await asyncio.gather(self.health.first_round(), self.decisions.start())
        self.health.start()
        self.vllm_load.start()

    async def close(self) -> None:
        await self.health.close()
        await self.vllm_load.close()
        await self.decisions.close()
        await self.watchdog.close()
        await self.session.close()
        if self.tracing is not None:
            await self.tracing.close()
        log = access_log()
        if log is not None:
            log.flush()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when the policy is loaded and every pool has an instance that takes traffic:
        healthy and not isolated (a sidecar's pod leaves its Service while its vLLM is out)."""
        pools = {
            name: any(i.breaker.state == ADMITTING for i in pool.routable)
            for name, pool in self.registry.pools.items()
        }
        ready = all(pools.values())
        return ready, {"ready": ready, "pools": pools}

    def operator(self, pool: str, name: str, action: str) -> dict[str, Any] | None:
        """Isolate or restore an instance by hand; None when there is no such instance."""
        state = self.registry.pools.get(pool)
        instance = next((i for i in state.instances if i.name == name), None) if state else None
        if state is None or instance is None:
            return None
        now = asyncio.get_running_loop().time()
        breaker = instance.breaker
        if action == "isolate":
            transition = breaker.isolate(now, state.rng, reason="operator")
        else:
            transition = breaker.restore(now, reason="operator")
            # "It is fine now": forget the slowness the balancer remembers of it too.
            peers = [i.peak.get(now) for i in state.instances if i is not instance]
            instance.peak = PeakEwma(now, initial_s=min(peers, default=0.0))
        if transition is None and action == "restore":
            # Already admitting here, perhaps not elsewhere: the restore is shared all the same.
            transition = Transition(name, ADMITTING, ADMITTING, "operator")
        if transition is not None:
            self._on_transition(pool, transition, operator=True)
        return {"pool": pool, "instance": name, "state": breaker.state}

    def state(self) -> dict[str, Any]:
        """The operator's view, served as /admin/state."""
        now = asyncio.get_running_loop().time()
        wall = time.time()
        pools: dict[str, Any] = {}
        for name, pool in self.registry.pools.items():
            rate = pool.failure.rate
            tier = pool.tiers.choose(rate)
            requests, retries = pool.budget.counts(now)
            pools[name] = {
                "models": list(pool.policy.models),
                "failure_rate": rate,
                "tier": {
                    "index": tier.index,
                    "max_retries": tier.max_retries,
                    "backoff_s": tier.backoff_s,
                    "k": tier.k,
                },
                "retry_budget": {"requests": requests, "retries": retries},
                "admission": self.admissions[name].state(now) if name in self.admissions else None,
                "instances": [
                    _instance_state(pool, inst, tier.k, now, wall, self.decisions.decided_by)
                    for inst in pool.instances
                ],
            }
        return {
            "pools": pools,
            "shared_state": self.decisions.status(),
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _estimate(ewma: Ewma) -> dict[str, float | int]:
    return {"mean_s": ewma.mean, "deviation_s": ewma.deviation, "samples": ewma.samples}


def _instance_state(
    pool: PoolState,
    inst: InstanceState,
    k: float,
    now: float,
    wall: float,
    decided_by: Callable[[str, str], str | None],
) -> dict[str, Any]:
    policy = pool.policy.timeouts
    stream = attempt_timeouts(inst.latency, policy, k, stream=True, max_tokens=None, jitter_s=0.0)
    whole = attempt_timeouts(inst.latency, policy, k, stream=False, max_tokens=None, jitter_s=0.0)
    return {
        "name": inst.name,
        "url": inst.base_url,
        "state": inst.breaker.state,
        # Wall-clock time of the last change of state; who decided an isolation shared with us.
        "state_since": _finite(wall - (now - inst.breaker.changed_at)),
        "decided_by": decided_by(pool.name, inst.name),
        "isolations": inst.breaker.isolations,
        "isolation_remaining_s": _finite(inst.breaker.remaining_s(now)),
        "forced": inst.breaker.forced,
        "in_flight": inst.in_flight,
        "concurrency_limit": inst.limiter.limit if inst.limiter is not None else None,
        "kv_tokens": (
            {"in_use": inst.budget.used, "budget": inst.budget.budget}
            if inst.budget is not None
            else None
        ),
        "vllm": {
            "saturated": inst.saturated,
            "waiting": inst.vllm_waiting,
            "cache_usage": inst.vllm_cache_usage,
        },
        "requests": inst.requests,
        "failures": inst.failures,
        "peak_ewma_s": inst.peak.peek(now),
        "retry_after_remaining_s": max(0.0, inst.not_before - now),
        "health": {
            "healthy": inst.health.healthy,
            "reason": inst.health.last_reason,
            "cold_start_s": inst.health.cold_start_s,
        },
        "ewma": {
            "ttfb": _estimate(inst.latency.ttfb),
            "gap": _estimate(inst.latency.gap),
            "per_token": _estimate(inst.latency.per_token),
        },
        "timeouts": {
            "connect_s": stream.connect_s,
            "stream_first_byte_s": stream.first_byte_s,
            "stream_idle_s": stream.idle_s,
            "whole_first_byte_s": whole.first_byte_s,  # at assumed_max_tokens
        },
    }
