"""The layer that chooses an instance for each attempt: the balancer, as a layer."""

from __future__ import annotations

from gateway.core.balancer import DEFAULT_RTT_S, choose, load_cost
from gateway.core.breaker import ADMITTING
from gateway.core.panic import least_bad
from gateway.errors import InstancesPaused, NoInstanceAvailable
from gateway.pipeline.call import Call, Handler
from gateway.runtime import Clock
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.response import UpstreamResponse


class Pick:
    """Power of two choices over the instances that may take this attempt, by peak-EWMA
        latency x (in-flight + 1), so a slow-but-alive instance gets less traffic before any breaker
        trips (as tower, Finagle and Linkerd balance).

        May take it: healthy, breaker ADMITTING, not tried by this request yet, not waiting out a
        Retry-After; in pools with admission control also below its concurrency limit, with room in
        its KV-token budget for the request, and, while its engine reports it saturated, below what
        the engine has room for (and only when no unsaturated one may take it); past its limit only
        where that limit is a learned guess (`room_guessed`: admission sends requests past it unless
        they flood the pool) and nothing else may take it. An isolated instance whose isolation ran
        out takes the attempt as its one probe (a real request) first; so does one isolated for
    failures it answered, before its isolation ends, while every admitting instance holds more than
    it was seen serving at once (`BreakerState.try_admit(early=True)`): an isolation must not queue
    its share on the others for longer than the fault needs it. An instance that refused this
        request's connection, dropped it or let it time out is not asked again while any other one
        could take it. When every healthy instance was tried or is full, one of those is used
        rather than failing. No attempt goes to an instance paused by its Retry-After (or by the
        backoff after a 429 without one) before the pause ends, on any of these paths: when every
        one that could take it is paused, the request waits for the first pause to end (the
        retry loop, `InstancesPaused`). When none is healthy and admitting, the pool panics (the
        default, `breaker.when_none_available: panic`, as Envoy's panic threshold): the attempt
        goes to the least bad instance not paused that still answers (healthy but isolated
        first, then unhealthy ones whose health check got an answer, then any:
        `gateway.core.panic`), untried ones first; once every instance refused the request's
        connection or let it time out, the client is told at once
        (503 + Retry-After). With `fail_fast`, nothing healthy and admitting is a 503 at once;
        so it is for a request whose pool has fallbacks to answer it first (`Call.handover`).

        An instance back in traffic (`PoolState.rejoined`: `breaker.slow_start` after a fault,
        `health.slow_start` once its checks pass) is weighed down by its slow start: its cost is
        divided by a weight rising from 10 % to 1 over that window, as Envoy's slow start
        does. (Its room is not: where requests queue for room, what its engine can run is the
        bound, and a room held back there would leave a restarted engine idle while the
        backlog grows.)
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        pool = call.pool
        now = self._clock()
        tried = call.tried
        attempt = call.attempt
        tokens = attempt.tokens
        reserved = attempt.reserved  # holds this request's tokens already
        # One pass: a due probe wins; else the admitting instances this request may use.
        fresh: list[InstanceState] = []
        queueing: list[InstanceState] = []  # saturated, but with room for this one
        over: list[InstanceState] = []  # past its limit, which is only a learned guess
        admitting: list[InstanceState] = []
        held_out: list[InstanceState] = []  # isolated, not due for a probe yet
        paused: list[InstanceState] = []  # asked for a pause: no attempt before it ends
        probe = None
        avoid = call.avoid
        # Whose limit a pause is: the operator's key, which every request spends (a pool with
        # `credentials`), holds every request off the instance; otherwise each client's own
        # key may be the one limited, and a paused instance is only the last choice.
        hard = pool.policy.credentials is not None
        for inst in pool.routable:
            if avoid and inst in avoid:
                continue  # it refused, dropped or sat on this request a moment ago
            waits = inst.not_before > now
            breaker = inst.breaker
            if waits and hard:
                if breaker.state == ADMITTING and inst.health.healthy is not False:
                    paused.append(inst)
                continue
            if breaker.state == ADMITTING:
                admitting.append(inst)
                budget = inst.budget
                if (
                    not waits
                    and inst not in tried
                    and (budget is None or inst is reserved or budget.fits(tokens))
                ):
                    if inst.in_flight < inst.room():
                        (queueing if inst.engine.saturated else fresh).append(inst)
                    elif inst.room_guessed:
                        over.append(inst)
            elif probe is None:
                if breaker.try_admit(now):
                    probe = inst
                else:
                    held_out.append(inst)
        if probe is None and held_out and admitting and _all_full(admitting, now):
            for inst in held_out:
                if inst.health.healthy is not False and inst.breaker.try_admit(now, early=True):
                    probe = inst
                    break
        elif probe is None and held_out and not admitting and call.handover:
            # Nothing admits and fallbacks answer meanwhile: a spare probe a second, so the
            # pool is back within a second of its instances' return (`try_admit(spare=True)`).
            for inst in held_out:
                if inst.health.healthy is not False and inst.breaker.try_admit(now, spare=True):
                    probe = inst
                    break
        if probe is not None:
            instance = probe
        elif admitting:
            instance = _balance(pool, fresh or queueing or over or admitting, now)
        elif paused:
            # Healthy instances that will take it once their pause ends: the request waits for
            # them (the retry loop), rather than panicking onto worse ones.
            raise _all_paused(pool, now)
        else:
            instance = _last_resort(pool, call, now)
        attempt.probe = probe is not None
        attempt.instance = instance
        tried.append(instance)
        call.attempts += 1
        return await next_handler(call)


def _last_resort(pool: PoolState, call: Call, now: float) -> InstanceState:
    """Where the attempt goes when no healthy instance admits it, none paused: the pool
    panics (`breaker.when_none_available: panic`) to the least bad instance not paused, or,
    with nothing else at all, to one it avoided that may be restarting. Raises
    `InstancesPaused` when only paused instances are left, else `NoInstanceAvailable`."""
    tried, avoid = call.tried, call.avoid
    hard = pool.policy.credentials is not None  # pauses hold every request off (`Pick`)
    paused = _paused(pool.instances, now) if hard else []
    panic = None
    if not call.handover and pool.policy.breaker.when_none_available == "panic":
        panic = _least_bad(pool, tried, [*avoid, *paused])
        if panic is not None and not any(i.breaker.state == ADMITTING for i in pool.routable):
            # A panic: nothing healthy admits at all (not only this request's avoided).
            pool.stats.panics += 1
    if panic is None and avoid:
        # Nothing else at all: those instances again (they may be restarting), but
        # not one that let this request time out and has answered nothing since.
        panic = [
            i for i in avoid if i.health.healthy and not call.silent(i) and i not in paused
        ] or None
    if panic is None and paused:
        raise _all_paused(pool, now)
    if panic is None:
        raise NoInstanceAvailable(
            f"no instance of pool {pool.name!r} is available",
            retry_after_s=_retry_after_s(pool, now),
        )
    return _balance(pool, panic, now)


def _paused(instances: list[InstanceState], now: float) -> list[InstanceState]:
    """Those of `instances` that asked for a pause still running at `now`."""
    return [inst for inst in instances if inst.not_before > now]


def _all_paused(pool: PoolState, now: float) -> InstancesPaused:
    """The answer when every instance that could take the request is paused: when to come
    back is when the first of the pool's pauses ends."""
    first_free = min((inst.not_before for inst in _paused(pool.instances, now)), default=now)
    return InstancesPaused(
        f"every instance of pool {pool.name!r} that could take the request asked for a pause",
        retry_after_s=first_free - now,
    )


def _all_full(admitting: list[InstanceState], now: float) -> bool:
    """Whether every admitting instance holds more attempts than it was seen serving at once
    (and was seen serving some: a pool that has not learned it says nothing of being full)."""
    return all(i.capacity_seen > 0 and i.over_capacity(now) for i in admitting)


def _balance(pool: PoolState, candidates: list[InstanceState], now: float) -> InstanceState:
    def cost(inst: InstanceState) -> float:
        weight = inst.price.ramp(now)  # its slow start (`PoolState.rejoined`)
        if inst.price.penalty is not None:
            latency = inst.price.cost_latency(now)
        elif inst.price.peak.learned:
            latency = inst.price.peak.get(now)
        else:
            # No answer timed yet, so no latency of its own: costed at its peers' average,
            # neither shunned (a made-up high guess) nor flooded (a guess of zero).
            # With none to go by, one guess for all: their loads and weights still count.
            measured = [i.price.peak.get(now) for i in candidates if i.price.peak.learned]
            latency = sum(measured) / len(measured) if measured else DEFAULT_RTT_S
        return load_cost(latency, inst.in_flight, weight)

    chosen = choose(candidates, cost, pool.rng)
    assert chosen is not None
    return chosen


def _least_bad(
    pool: PoolState, tried: list[InstanceState], avoid: list[InstanceState]
) -> list[InstanceState] | None:
    return least_bad(pool.instances, _healthy, _answered, tried, avoid)


def _healthy(inst: InstanceState) -> bool | None:
    return inst.health.healthy


def _answered(inst: InstanceState) -> bool:
    return inst.health.answered


def _retry_after_s(pool: PoolState, now: float) -> float:
    """When to come back: the nearest end of an isolation, else the next health check."""
    ends = [i.breaker.remaining_s(now) for i in pool.routable]
    finite = [e for e in ends if 0 < e < float("inf")]
    return min(finite) if finite else pool.policy.health.interval
