"""How the outcome of an attempt reaches its instance and pool: the one way it does.

Each finished attempt feeds its pool's failure rate and its instance's concurrency limiter,
counters and breaker (a transition is logged, one line, with its reason), and, for successes
only, the balancer's price and the latency estimators behind the timeouts; a failure the
breaker would isolate the instance for, had the pool's isolation cap not held, prices it out of
the balancer instead (`failure_penalty_s`). A client's own 4xx is nobody's fault: the breaker
does not count it. (As Envoy's outlier detector has one `putResult`.) The pipeline's
`Account` layer says when an attempt started and ended; this module says what that teaches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gateway.core.backoff import rate_limit_pause_s, retry_after_s
from gateway.core.balancer import failure_penalty_s
from gateway.core.breaker import ADMITTING, Transition
from gateway.core.outcome import Outcome, Phase
from gateway.telemetry.logs import LogThrottle
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.response import UpstreamResponse

log = logging.getLogger("gateway.account")

# Where a breaker's transitions go: logged, and shared with other replicas if so configured.
OnTransition = Callable[[str, Transition], None]

_OVERLOAD = frozenset(("timeout", "oom"))
# Failures that may mean the instance is down, not just busy or wrong: a health check tells.
_SIGNS_OF_DOWN = frozenset(("timeout", "connect_failure", "reset"))
# Statuses that say "too busy": 529 is Anthropic's overloaded_error.
_BUSY = frozenset((429, 503, 529))


class Feedback:
    """The one way an attempt's outcome reaches its instance and pool (`attempt_finished`), with
    what that needs besides: where breaker transitions go, and the throttle of timeout log
    lines (one per (pool, instance, phase, queueing) per 10 s: a hung instance times out by
    the hundred)."""

    def __init__(self, on_transition: OnTransition) -> None:
        self._on_transition = on_transition
        self._timeout_log = LogThrottle(10.0)

    def _timed_out(
        self,
        pool: PoolState,
        instance: InstanceState,
        outcome: Outcome,
        now: float,
        queueing: bool,
        backoff: int,
        modelled: bool,
        waited_s: float,
        sent_with: int,
    ) -> None:
        """Count and log a timeout, per instance and phase (one line per 10 s per pair). The line
        says what the blame rests on: the load the attempt was sent into (`sent_with`) and
        meets now, how long it waited, and how long the instance has sent nothing on any
        attempt (`quiet_s` at least `waited_s`: silent all along, as a stopped engine is)."""
        phase = outcome.phase or "deadline"
        pool.stats.timeout(phase)
        instance.stats.timeout(phase, blamed=not queueing)
        held_back = self._timeout_log.admit((pool.name, instance.name, phase, queueing), now)
        if held_back is not None:
            fields = {
                "pool": pool.name,
                "instance": instance.name,
                "phase": phase,
                "queueing": queueing,
                "in_flight": instance.in_flight,
                "sent_with": sent_with,
                "capacity_seen": instance.capacity_seen,
                "waited_s": round(waited_s, 3),
                "quiet_s": round(now - instance.progress_at, 3),
                "repeats": held_back,
            }
            log.warning("upstream timeout", extra={"fields": fields})
        if not modelled:
            return  # waited for up to the deadline, not for a prediction: nothing to back off
        if phase == Phase.FIRST_BYTE and not queueing:
            instance.latency.timed_out(backoff)  # the next attempt there waits longer
        elif phase == Phase.IDLE:
            instance.latency.idle_timed_out()  # and its next streams' gaps

    def attempt_finished(
        self,
        pool: PoolState,
        instance: InstanceState,
        outcome: Outcome,
        now: float,
        elapsed_s: float,
        probe: bool,
        first_byte_s: float | None = None,  # of a stream
        tokens: int | None = None,  # its output tokens, when known
        queueing: bool = False,
        backoff: int = 0,  # the attempt's AttemptTimeouts.backoff
        sent_with: int = 0,  # attempts in flight on the instance when it was sent, itself too
        modelled: bool = True,  # its route's latency is the latency model's (`Route.modelled`)
        others_flowing: bool = False,  # the instance sent on other attempts while this one waited
        judged: bool = True,  # its breaker counts it (not a refusal its health checks judge)
    ) -> None:
        """`queueing`: a timeout of an attempt that waited behind a full instance which kept
        working meanwhile: counted and logged as a timeout, retried, but not the instance's
        failure (its breaker and the pool's failure rate do not see it). An attempt on a route
        whose latency is not modelled counts as a success or failure like any other, but its
        time teaches neither the limiter nor the balancer."""
        failed = outcome.counts_as_failure and not queueing
        pool.failure.observe(failed)
        limiter = instance.limiter
        if limiter is not None:
            # A stream's time to first token is what grows when the engine queues; a whole
            # answer's time per output token grows with it too (and with a fuller batch: the
            # limiter gives that signal more room). Timeouts, OOMs, 429, 503 and 529 say it is
            # overloaded, streamed or not.
            # The load it saw: as many as were in flight when it was sent or are now (its own
            # attempt has left `in_flight` already), whichever is more; a stream's first token
            # tells of the load it was sent into, long before the stream ends.
            load = max(sent_with, instance.in_flight + 1)
            if outcome.kind in _OVERLOAD or outcome.status in _BUSY:
                # Refused by the engine itself (out of memory, 429, 503, 529), not timed out: a
                # frozen instance times out too, but only a working one says it is full.
                refused = outcome.kind == "oom" or outcome.status in _BUSY
                limiter.record(now, elapsed_s, load, overloaded=True, refused=refused)
            elif outcome.kind == "ok" and modelled:
                # A whole answer's latency over its output tokens; a stream's first byte instead.
                per_token_s = elapsed_s / tokens if first_byte_s is None and tokens else None
                limiter.record(now, first_byte_s, load, per_token_s=per_token_s)
        instance.stats.attempt(outcome, probe)
        if outcome.kind == "timeout":
            self._timed_out(
                pool, instance, outcome, now, queueing, backoff, modelled, elapsed_s, sent_with
            )
            if queueing and not probe:
                return
        if outcome.kind == "ok":
            instance.answered_well()
            # The balancer weighs how fast an instance answers well; failing (fast or by timing
            # out) is the breaker's business, which needs those attempts to reach it. A stream was
            # priced at its first byte already; at its end it is priced again at the pace it had,
            # when its length is known (priced on its whole time, its length would be the price).
            if modelled and (first_byte_s is None or tokens is not None):
                _price_answer(instance, now, elapsed_s, first_byte_s, tokens)
            if instance.health.healthy is not True:
                instance.health_wanted.set()  # answering while held down: its checker looks now
        if failed:
            instance.failed()
            if outcome.kind in _SIGNS_OF_DOWN:
                instance.health_wanted.set()  # its checker looks at once, not at the next round
        elif outcome.kind != "ok" and not probe:
            return  # the client's 4xx: says nothing about the instance (but a probe got an answer)
        if not judged:
            if probe:
                instance.breaker.release_probe(now)  # it did not happen: the next one may
            return
        # A timeout is the breaker's sign of an instance that stopped answering (a few in a row
        # isolate it at once, and move its streams): not when it kept sending on its other
        # attempts meanwhile, which is this attempt's failure alone (counted in its error rate).
        silent = outcome.kind == "timeout" and not others_flowing
        self.to_breaker(pool, instance, now, failed, silent, probe, elapsed_s)

    def to_breaker(
        self,
        pool: PoolState,
        instance: InstanceState,
        now: float,
        failed: bool,
        timeout: bool,
        probe: bool,
        elapsed_s: float,
    ) -> None:
        """One result for the instance's breaker (`BreakerState.record`), after an attempt that
        took `elapsed_s`, and what follows when it changes the breaker's state."""
        transition = instance.breaker.record(now, failed, timeout, pool.rng, probe=probe)
        if transition is None:
            return
        if transition.suppressed:
            # The cap keeps it admitting: the balancer steers around it instead.
            peers = pool.peer_latencies(instance, now)
            share = instance.breaker.failure_share(now)
            instance.price.penalize(now, failure_penalty_s(elapsed_s, peers, share))
        elif transition.to == ADMITTING:
            pool.rejoined(instance, now)  # its probe answered well
        if transition.displaced is not None:
            displaced = transition.displaced
            back = pool.instance_named(displaced.instance)
            if back is not None:
                pool.rejoined(back, now)  # let back for a worse one
            self._on_transition(pool.name, displaced)
        self._on_transition(pool.name, transition)


def asked_to_wait(pool: PoolState, response: UpstreamResponse, now: float) -> None:
    """An answer that asks for no new attempt for a while (429, 503) pauses its instance: for
    its `Retry-After` or `retry-after-ms` (capped at `retries.max_retry_after`), or, for a 429
    without a usable one, for a backoff that grows with the 429s in a row
    (`retries.rate_limit_backoff`, `rate_limit_pause_s`; `InstanceState.rate_limited` counts
    them, a burst of answers once). No attempt of any request goes to a paused instance (the
    pick layer), so a backend that rate-limits without saying for how long is not asked again
    within milliseconds by every retry. A 503 without either header pauses nothing."""
    instance = response.instance
    retries = pool.policy.retries
    pause = retry_after_s(
        response.header("retry-after"),
        response.header("retry-after-ms"),
        now_wall=time.time(),
        cap_s=retries.max_retry_after,
    )
    in_row = 0
    if response.status == 429:
        in_row = instance.rate_limited(now)
    else:
        instance.not_rate_limited()
    if pause:
        instance.pause_until(now + pause)
    elif in_row and pause is None:
        backoff = retries.rate_limit_backoff
        instance.pause_until(now + rate_limit_pause_s(in_row, backoff.base, backoff.max, pool.rng))


def abandoned(instance: InstanceState, outcome: Outcome, now: float, waited_s: float) -> None:
    """A first-byte timeout of an attempt that waited in the engine's queue leaves it there
    until the engine notices (llama.cpp: once a slot takes it): count it as in flight for about
    as long as an exchange takes there (or as long as it was waited on). One that had a slot is
    dropped by the engine at once."""
    if outcome.phase == Phase.FIRST_BYTE:
        service = instance.latency.service
        instance.abandoned(now, service.mean + service.deviation if service.samples else waited_s)


def _price_answer(
    instance: InstanceState,
    now: float,
    elapsed_s: float,
    first_byte_s: float | None,
    tokens: int | None,
) -> None:
    """Price an answer that took `elapsed_s` without the last stall of the whole engine it
    lived through: a stream's first byte, then its pace (`Stall.unstalled_wait_s`, `active_s`)."""
    stall = instance.stall
    start = now - elapsed_s
    usual = instance.latency.ttfb.mean
    first_s = None
    if first_byte_s is None:
        priced_s = stall.unstalled_wait_s(start, now, usual)
    else:
        first_at = start + first_byte_s
        first_s = stall.unstalled_wait_s(start, first_at, usual)
        priced_s = first_s + stall.active_s(first_at, now)
    instance.price.answer(now, priced_s, tokens, instance.latency, first_s)


def waited_in_queue(instance: InstanceState, queued: bool, started: float, now: float) -> bool:
    """Whether a first-byte timeout was queueing: the attempt was sent to an instance already
    serving all it was seen to serve at once, or the instance is that full now, and it sent
    bytes on other attempts since (it works; it is busy). An instance with room to spare, or
    one that went silent, is blamed."""
    # (Its own attempt has already left `in_flight`.)
    load = instance.in_flight + 1 + instance.ghosts_at(now)
    busy = queued or load >= max(1, instance.capacity_seen)
    return busy and instance.progress_at > started


def learning(pool: PoolState, instance: InstanceState) -> None:
    """An instance's estimate just became learned: its pool's prior is out of date."""
    if instance.latency.just_learned(pool.policy.timeouts.min_samples):
        pool.timing.forget_prior()
