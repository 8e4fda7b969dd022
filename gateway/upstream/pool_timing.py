"""What a pool's latency figures say an attempt on one of its instances may take: its timeouts
and when it gets a hedge (`gateway.core.timeouts`), from the instance's own figures or, while
they are young, the pool's prior: what its learned instances say of one that has not learned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.core.latency import LatencyState, pool_prior
from gateway.core.timeouts import NO_LOAD, AttemptTimeouts, Load, attempt_timeouts, hedge_delay
from gateway.upstream.instance import InstanceState

if TYPE_CHECKING:
    from gateway.upstream.pool import PoolState


class PoolTiming:
    """A pool's timeouts and hedge delays, and the prior they fall back on (`PoolState.timing`).

    Reads the pool's current policy and instances, so a reload needs nothing here but
    `forget_prior`."""

    __slots__ = ("_pool", "_prior", "_prior_at")

    def __init__(self, pool: PoolState) -> None:
        self._pool = pool
        # The pool's latency figures for instances that have not learned their own, and when
        # they were last worked out (they move slowly: once a second is plenty).
        self._prior: LatencyState | None = None
        self._prior_at = -1.0

    def latency_prior(self, now: float) -> LatencyState:
        """What the pool's learned instances say about one that has not learned (cached 1 s)."""
        prior = self._prior
        if prior is None or now - self._prior_at >= 1.0:
            pool = self._pool
            policy = pool.policy.timeouts
            prior = pool_prior(
                (inst.latency for inst in pool.instances), policy.min_samples, policy.smoothing
            )
            self._prior = prior
            self._prior_at = now
        return prior

    def forget_prior(self) -> None:
        """An instance's estimate just became learned, or the instances or settings changed:
        the prior is worked out again."""
        self._prior = None

    def timeouts_for(
        self,
        inst: InstanceState,
        k: float,
        now: float,
        *,
        stream: bool,
        max_tokens: int | None,
        jitter_s: float = 0.0,
        load: Load = NO_LOAD,
        final: bool = False,
    ) -> AttemptTimeouts:
        """The timeouts an attempt on `inst` gets (`attempt_timeouts`), from its own figures or,
        while they are young, its pool's prior."""
        policy = self._pool.policy.timeouts
        latency = inst.latency
        prior = self.latency_prior(now) if latency.young(policy.min_samples) else None
        return attempt_timeouts(
            latency,
            policy,
            k,
            stream=stream,
            max_tokens=max_tokens,
            jitter_s=jitter_s,
            prior=prior,
            load=load,
            final=final,
        )

    def hedge_delay(
        self, inst: InstanceState, now: float, *, stream: bool, max_tokens: int | None
    ) -> float | None:
        """When an attempt about to be sent to `inst` gets a hedge if it has no first byte
        (`hedge_delay`), counting the attempts the gateway already has there."""
        pool_policy = self._pool.policy
        policy = pool_policy.timeouts
        latency = inst.latency
        prior = self.latency_prior(now) if latency.young(policy.min_samples) else None
        load = Load(
            inst.in_flight + inst.ghosts_at(now),
            inst.capacity_seen,
            0,
            now - inst.progress_at,
        )
        return hedge_delay(
            latency,
            policy,
            pool_policy.hedging.k,
            stream=stream,
            max_tokens=max_tokens,
            prior=prior,
            load=load,
        )
