"""What an operator does and sees: an instance isolated or restored by hand (shared with the
other replicas like any breaker transition), and the state view served as /admin/state."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gateway.core.breaker import ADMITTING, Transition
from gateway.core.ewma import Ewma
from gateway.ingress.refusals import IngressRefusals
from gateway.pipeline.admit import PoolAdmission
from gateway.reload import ReloadStats
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState

# Shares a transition with the other replicas; True: an operator's (it overrides theirs).
ShareTransition = Callable[[str, Transition, bool], None]


class Decisions(Protocol):
    """The decision store, as far as the state view reads it."""

    def decided_by(self, pool: str, instance: str) -> str | None: ...

    def status(self) -> dict[str, Any]: ...


class Operations:
    """Operator actions and the state view, over the gateway's long-lived state objects (a
    reload changes them in place). `clock`: event-loop time; `wall`: wall-clock time."""

    def __init__(
        self,
        pools: Mapping[str, PoolState],
        admissions: Mapping[str, PoolAdmission],
        decisions: Decisions,
        reloads: ReloadStats,
        refusals: IngressRefusals,
        on_transition: ShareTransition,
        draining: Callable[[], bool],
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._pools = pools
        self._admissions = admissions
        self._decisions = decisions
        self._reloads = reloads
        self._refusals = refusals
        self._on_transition = on_transition
        self._draining = draining
        self._clock = clock
        self._wall = wall

    def operator(self, pool: str, name: str, action: str) -> dict[str, Any] | None:
        """Isolate or restore an instance by hand; None when there is no such instance."""
        state = self._pools.get(pool)
        instance = state.instance_named(name) if state else None
        if state is None or instance is None:
            return None
        now = self._clock()
        breaker = instance.breaker
        if action == "isolate":
            transition = breaker.isolate(now, state.rng, reason="operator")
        else:
            transition = breaker.restore(now, reason="operator")
            # "It is fine now": forget the slowness the balancer remembers of it too, and take
            # the operator's word for it: costed as the quickest of the others.
            peers = [i.price.peak.get(now) for i in state.instances if i is not instance]
            instance.price.start_afresh(now, min(peers, default=0.0), vouched=True)  # no ramp
        if transition is None and action == "restore":
            # Already admitting here, perhaps not elsewhere: the restore is shared all the same.
            transition = Transition(name, ADMITTING, ADMITTING, "operator")
        if transition is not None:
            self._on_transition(pool, transition, True)
        return {"pool": pool, "instance": name, "state": breaker.state}

    def state(self) -> dict[str, Any]:
        """The operator's view, served as /admin/state."""
        now = self._clock()
        wall = self._wall()
        pools: dict[str, Any] = {}
        for name, pool in self._pools.items():
            rate = pool.failure.rate
            tier = pool.tiers.choose(rate)
            requests, retries = pool.budget.counts(now)
            pools[name] = {
                "models": list(pool.policy.models),
                # Where the pool's upstream credential comes from, never its value.
                "credentials": (
                    {"header": creds.header, "source": creds.source}
                    if (creds := pool.policy.credentials) is not None
                    else None
                ),
                "failure_rate": rate,
                "tier": {
                    "index": tier.index,
                    "max_retries": tier.max_retries,
                    "backoff_s": tier.backoff_s,
                    "k": tier.k,
                },
                "retry_budget": {"requests": requests, "retries": retries},
                # Streams continued after their first byte, by instance and reason, those that
                # broke and could not be, and hedged first attempts by result.
                "resumes": [
                    {"instance": instance, "reason": reason, "count": count}
                    for (instance, reason), count in sorted(pool.stats.resumes.items())
                ],
                "resume_refusals": dict(pool.stats.resume_refusals),
                "hedges": dict(pool.stats.hedges),
                "admission": self._admissions[name].state(now)
                if name in self._admissions
                else None,
                "discovery": _discovery_state(pool, now, wall),
                "instances": [
                    _instance_state(pool, inst, tier.k, now, wall, self._decisions.decided_by)
                    for inst in pool.instances
                ],
            }
        return {
            "pools": pools,
            "shared_state": self._decisions.status(),
            "policy": self._reloads.state(),
            "draining": self._draining(),
            "ingress": {"refusals": dict(self._refusals.counts)},
        }


def _discovery_state(pool: PoolState, now: float, wall: float) -> dict[str, Any] | None:
    """Where the pool's instances come from, what was last found and when, the last error."""
    policy, found = pool.declared.discovery, pool.found
    if policy is None or found is None:
        return None
    if policy.dns is not None:
        target = f"{policy.dns.type} {policy.dns.name}"
    else:
        assert policy.kubernetes is not None
        k8s = policy.kubernetes
        target = f"{k8s.namespace or '(own namespace)'}/{k8s.service or k8s.selector}"

    def at(moment: float | None) -> float | None:
        return None if moment is None else wall - (now - moment)

    return {
        "source": policy.source,
        "target": target,
        "instances": [e.name for e in found.endpoints],
        "refreshed_at": at(found.refreshed_at),  # wall clock of the last answer
        "last_error": found.last_error,  # since the last answer (null: none)
        "failed_at": at(found.failed_at),
        "errors": found.errors,
        "changes": found.changes,
        # An empty answer not believed yet: since when answers have been empty.
        "empty_since": at(found.empty_since),
        "shadowed": list(found.shadowed),  # found names a listed instance has already
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
    stream = pool.timeouts_for(inst, k, now, stream=True, max_tokens=None)
    whole = pool.timeouts_for(inst, k, now, stream=False, max_tokens=None)
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
        # What it may have in flight now: its engine's pace, or the limit (`InstanceState.room`).
        "room": inst.room() if inst.limiter is not None else None,
        "kv_tokens": (
            {"in_use": inst.budget.used, "budget": inst.budget.budget}
            if inst.budget is not None
            else None
        ),
        "vllm": {
            # Whether its engine exports load gauges (null: not read yet, or the read failed).
            "gauges": inst.engine.gauges,
            "saturated": inst.engine.saturated,
            "waiting": inst.engine.waiting,
            "cache_usage": inst.engine.cache_usage,
            "engine_slots": inst.engine.slots if inst.engine.saturated else None,
            "engine_batch": inst.engine.batch or None,
        },
        "requests": inst.requests,
        "failures": inst.failures,
        "streaming": inst.streaming,
        "capacity_seen": inst.capacity_seen,
        "prefill_holds": inst.holds,
        "timeouts_by_phase": [
            {"phase": phase, "blamed": blamed, "count": count}
            for (phase, blamed), count in sorted(inst.stats.timeouts.items())
        ],
        "peak_ewma_s": inst.price.peak.peek(now),
        "penalty_s": inst.price.penalty.peek(now) if inst.price.penalty is not None else None,
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
            "prefill_per_token": _estimate(inst.latency.prefill),
            "service": _estimate(inst.latency.service),
        },
        "timeouts": {
            "connect_s": stream.connect_s,
            "stream_first_byte_s": stream.first_byte_s,
            "stream_idle_s": stream.idle_s,
            "whole_first_byte_s": whole.first_byte_s,  # at assumed_max_tokens
        },
    }
