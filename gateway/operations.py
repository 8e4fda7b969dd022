"""What an operator does and sees: an instance isolated or restored by hand (shared with the
other replicas like any breaker transition), and the state view served as /admin/state."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from gateway.core.balancer import DEFAULT_RTT_S
from gateway.core.breaker import ADMITTING, Transition
from gateway.ingress.refusals import IngressRefusals
from gateway.pipeline.admission_snapshot import AdmissionSnapshot, admission_snapshot
from gateway.pipeline.admit import PoolAdmission
from gateway.reload import ReloadStats
from gateway.upstream.pool import PoolState
from gateway.upstream.snapshot import (
    DiscoverySnapshot,
    InstanceSnapshot,
    PoolSnapshot,
    pool_snapshot,
)

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
            # the operator's word for it: costed as the quickest of the others in traffic
            # that answered, with no slow start. With none, a guess: held as an answer,
            # another's guess would be priced above the others' first answers until it
            # faded, and the instance passed over.
            peers = state.peer_latencies(instance, now, answered=True)
            if peers:
                instance.price.start_afresh(now, min(peers), vouched=True)
            else:
                instance.price.start_afresh(now, DEFAULT_RTT_S)
        if transition is None and action == "restore":
            # Already admitting here, perhaps not elsewhere: the restore is shared all the same.
            transition = Transition(name, ADMITTING, ADMITTING, "operator")
        if transition is not None:
            self._on_transition(pool, transition, True)
        return {"pool": pool, "instance": name, "state": breaker.state}

    def state(self) -> dict[str, Any]:
        """The operator's view, served as /admin/state."""
        now = self._clock()
        clocks = _Clocks(now, self._wall())
        decided_by = self._decisions.decided_by
        pools: dict[str, Any] = {}
        for name, pool in self._pools.items():
            admission = self._admissions.get(name)
            pools[name] = _pool_state(
                pool_snapshot(pool, now),
                admission_snapshot(admission, now) if admission is not None else None,
                clocks,
                decided_by,
            )
        return {
            "pools": pools,
            "shared_state": self._decisions.status(),
            "policy": self._reloads.state(),
            "draining": self._draining(),
            "ingress": {"refusals": dict(self._refusals.counts)},
        }


class _Clocks(NamedTuple):
    """The event-loop time of a view (the snapshots' times) and the wall-clock time it shows
    them in."""

    now: float
    wall: float

    def wall_time(self, moment: float) -> float:
        """Event-loop time `moment` as wall-clock time."""
        return self.wall - (self.now - moment)


def _pool_state(
    pool: PoolSnapshot,
    admission: AdmissionSnapshot | None,
    clocks: _Clocks,
    decided_by: Callable[[str, str], str | None],
) -> dict[str, Any]:
    tier = pool.tier
    requests, retries = pool.retry_budget
    stats = pool.stats
    return {
        "models": list(pool.models),
        # Where the pool's upstream credential comes from, never its value.
        "credentials": (
            {"header": pool.credentials[0], "source": pool.credentials[1]}
            if pool.credentials is not None
            else None
        ),
        "failure_rate": pool.failure_rate,
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
            for (instance, reason), count in sorted(stats.resumes.items())
        ],
        "resume_refusals": dict(stats.resume_refusals),
        "hedges": dict(stats.hedges),
        # Requests handed over to other pools, and fallbacks passed over, by pool and reason.
        "fallbacks": [
            {"to": to, "reason": reason, "count": count}
            for (to, reason), count in sorted(stats.fallbacks.items())
        ],
        "fallback_skips": [
            {"to": to, "reason": why, "count": count}
            for (to, why), count in sorted(stats.fallback_skips.items())
        ],
        "admission": _admission_state(admission) if admission is not None else None,
        "discovery": _discovery_state(pool.discovery, clocks),
        "instances": [
            _instance_state(inst, clocks, decided_by(pool.name, inst.name))
            for inst in pool.instances
        ],
    }


def _admission_state(admission: AdmissionSnapshot) -> dict[str, Any]:
    return {
        "running": admission.running,
        "over": admission.over,
        "room": admission.room,
        "queued": admission.queued,
        "shed": admission.shed,
        "overflow": admission.overflow,
        "flood": admission.flood,
        "engine_refused": admission.engine_refused,
        "weights": admission.weights,
        "tenants": {
            "queued": admission.tenants_queued,
            "shed": dict(admission.tenants_shed),
        },
    }


def _discovery_state(found: DiscoverySnapshot | None, clocks: _Clocks) -> dict[str, Any] | None:
    """Where the pool's instances come from, what was last found and when, the last error."""
    if found is None:
        return None

    def at(moment: float | None) -> float | None:
        return None if moment is None else clocks.wall_time(moment)

    return {
        "source": found.source,
        "target": found.target,
        "instances": list(found.instances),
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


def _instance_state(
    inst: InstanceSnapshot, clocks: _Clocks, decided_by: str | None
) -> dict[str, Any]:
    return {
        "name": inst.name,
        "url": inst.url,
        "state": inst.state,
        # Wall-clock time of the last change of state; who decided an isolation shared with us.
        "state_since": _finite(clocks.wall_time(inst.state_changed_at)),
        "decided_by": decided_by,
        "isolations": inst.isolations,
        "isolation_remaining_s": _finite(inst.isolation_remaining_s),
        "forced": inst.forced,
        "in_flight": inst.in_flight,
        "concurrency_limit": inst.concurrency_limit,
        # What it may have in flight now: its engine's pace, or the limit (`InstanceState.room`).
        "room": inst.room,
        "kv_tokens": (
            {"in_use": inst.kv_tokens_in_use, "budget": inst.kv_tokens_budget}
            if inst.kv_tokens_budget is not None
            else None
        ),
        "vllm": {
            # Whether its engine exports load gauges (null: not read yet, or the read failed).
            "gauges": inst.engine_gauges,
            "saturated": inst.saturated,
            "waiting": inst.engine_waiting,
            "cache_usage": inst.engine_cache_usage,
            "engine_slots": inst.engine_slots,
            "engine_batch": inst.engine_batch,
        },
        "requests": inst.requests,
        "failures": inst.failures,
        "streaming": inst.streaming,
        "capacity_seen": inst.capacity_seen,
        "prefill_holds": inst.prefill_holds,
        "timeouts_by_phase": [
            {"phase": phase, "blamed": blamed, "count": count}
            for (phase, blamed), count in sorted(inst.stats.timeouts.items())
        ],
        "peak_ewma_s": inst.peak_ewma_s,
        "penalty_s": inst.penalty_s,
        "retry_after_remaining_s": inst.retry_after_remaining_s,
        "health": {
            "healthy": inst.healthy,
            "reason": inst.health_reason,
            "cold_start_s": inst.cold_start_s,
        },
        "ewma": {name: estimate._asdict() for name, estimate in inst.estimates._asdict().items()},
        # The stream's first byte and idle gap; a whole answer's at assumed_max_tokens.
        "timeouts": inst.timeouts._asdict(),
    }
