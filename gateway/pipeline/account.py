"""The layer that counts an attempt against its instance and pool, once, when it has ended.

An answer read whole ends with the transport; a stream ends when its relay does, so its
accounting runs from the response's finish hook (latency, outcome and in-flight count are only
known then). Each finished attempt feeds: the pool's failure rate, the instance's breaker (a
transition is logged, one line, with its reason), and, for successes only, the balancer's
peak-EWMA and the latency estimators behind the timeouts; a failure the breaker would isolate
the instance for, had the pool's isolation cap not held, prices it out of the balancer
instead (`failure_penalty_s`). A client's own 4xx is nobody's
fault: the breaker does not count it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.core.balancer import failure_penalty_s
from gateway.core.breaker import ADMITTING, Transition
from gateway.core.outcome import Outcome, Phase
from gateway.core.usage import EDGE_BYTES, usage_of
from gateway.errors import UpstreamConnectError, UpstreamError
from gateway.pipeline.call import Call, Handler
from gateway.runtime import SUPERSEDED, Clock
from gateway.telemetry.logs import LogThrottle
from gateway.upstream.health import log_health_change
from gateway.upstream.registry import InstanceState, PoolState
from gateway.upstream.response import UpstreamResponse

log = logging.getLogger("gateway.account")
# One line per (pool, instance, phase) per interval: a hung instance times out by the hundred.

# How Anthropic ends a stream that failed: an `error` event, after which nothing comes.
_STREAM_ERROR_EVENT = b"event: error"


# Where a breaker's transitions go: logged, and shared with other replicas if so configured.
OnTransition = Callable[[str, Transition], None]


_OVERLOAD = frozenset(("timeout", "oom"))
# Failures that may mean the instance is down, not just busy or wrong: a health check tells.
_SIGNS_OF_DOWN = frozenset(("timeout", "connect_failure", "reset"))
# Statuses that say "too busy": 529 is Anthropic's overloaded_error.
_BUSY = frozenset((429, 503, 529))
_STREAM_ERROR = Outcome.from_error("protocol")
# A whole answer teaches the limiter its time per output token only from this many tokens:
# a shorter one's latency is mostly its prompt's prefill.
MIN_RATED_TOKENS = 16
_LOST_RACE = Outcome.from_error("timeout", Phase.FIRST_BYTE)


def _timed_out(
    log_throttle: LogThrottle,
    pool: PoolState,
    instance: InstanceState,
    outcome: Outcome,
    now: float,
    queueing: bool,
    backoff: int,
    modelled: bool,
) -> None:
    """Count and log a timeout, per instance and phase (one line per 10 s per pair)."""
    phase = outcome.phase or "deadline"
    pool.stats.timeout(phase)
    instance.stats.timeout(phase, blamed=not queueing)
    held_back = log_throttle.admit((pool.name, instance.name, phase, queueing), now)
    if held_back is not None:
        fields = {
            "pool": pool.name,
            "instance": instance.name,
            "phase": phase,
            "queueing": queueing,
            "in_flight": instance.in_flight,
            "capacity_seen": instance.capacity_seen,
            "repeats": held_back,
        }
        log.warning("upstream timeout", extra={"fields": fields})
    if not modelled:
        return  # waited for up to the deadline, not for a prediction: nothing to back off
    if phase == Phase.FIRST_BYTE and not queueing:
        instance.latency.timed_out(backoff)  # the next attempt there waits longer
    elif phase == Phase.IDLE:
        instance.latency.idle_timeouts_in_row += 1  # and its next streams' gaps


def _record(
    timeout_log: LogThrottle,
    pool: PoolState,
    instance: InstanceState,
    outcome: Outcome,
    now: float,
    elapsed_s: float,
    probe: bool,
    on_transition: OnTransition,
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
        _timed_out(timeout_log, pool, instance, outcome, now, queueing, backoff, modelled)
        if queueing and not probe:
            return
    if outcome.kind == "ok":
        instance.races_lost = 0
        # The balancer weighs how fast an instance answers well; failing (fast or by timing
        # out) is the breaker's business, which needs those attempts to reach it. A stream was
        # priced at its first byte already; at its end it is priced again at the pace it had,
        # when its length is known (priced on its whole time, its length would be the price).
        if modelled and (first_byte_s is None or tokens is not None):
            instance.price_answer(now, elapsed_s, tokens, first_byte_s)
        if instance.health.healthy is not True:
            instance.health_wanted.set()  # answering while held down: its checker looks now
    if failed:
        instance.failures += 1
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
    _to_breaker(pool, instance, now, failed, silent, probe, elapsed_s, on_transition)


def _to_breaker(
    pool: PoolState,
    instance: InstanceState,
    now: float,
    failed: bool,
    timeout: bool,
    probe: bool,
    elapsed_s: float,
    on_transition: OnTransition,
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
        instance.penalize(now, failure_penalty_s(elapsed_s, peers, share))
    elif transition.to == ADMITTING:
        pool.rejoined(instance, now)  # its probe answered well
    if transition.displaced is not None:
        displaced = transition.displaced
        back = pool.instance_named(displaced.instance)
        if back is not None:
            pool.rejoined(back, now)  # let back for a worse one
        on_transition(pool.name, displaced)
    on_transition(pool.name, transition)


def _abandoned(instance: InstanceState, outcome: Outcome, now: float, waited_s: float) -> None:
    """A first-byte timeout of an attempt that waited in the engine's queue leaves it there
    until the engine notices (llama.cpp: once a slot takes it): count it as in flight for about
    as long as an exchange takes there (or as long as it was waited on). One that had a slot is
    dropped by the engine at once."""
    if outcome.phase == Phase.FIRST_BYTE:
        service = instance.latency.service
        instance.abandoned(now, service.mean + service.deviation if service.samples else waited_s)


def _queueing(instance: InstanceState, queued: bool, started: float, now: float) -> bool:
    """Whether a first-byte timeout was queueing: the attempt was sent to an instance already
    serving all it was seen to serve at once, or the instance is that full now, and it sent
    bytes on other attempts since (it works; it is busy). An instance with room to spare, or
    one that went silent, is blamed."""
    # (Its own attempt has already left `in_flight`.)
    load = instance.in_flight + 1 + instance.ghosts_at(now)
    busy = queued or load >= max(1, instance.capacity_seen)
    return busy and instance.progress_at > started


def _learning(pool: PoolState, instance: InstanceState) -> None:
    """An instance's estimate just became learned: its pool's prior is out of date."""
    if instance.latency.just_learned(pool.policy.timeouts.min_samples):
        pool.prior = None


def _end(instance: InstanceState, tokens: int) -> None:
    """The attempt no longer occupies the instance."""
    instance.in_flight -= 1
    instance.tokens_held -= tokens
    if instance.budget is not None:
        instance.budget.release(tokens)


class Account:
    def __init__(
        self, pools: dict[str, PoolState], on_transition: OnTransition, clock: Clock
    ) -> None:
        self._pools = pools
        self._on_transition = on_transition
        self._clock = clock
        # Timeouts logged one line per 10 s per (pool, instance, phase, queueing).
        self._timeout_log = LogThrottle(10.0)

    def _stream_finished(self, response: UpstreamResponse, error: UpstreamError | None) -> None:
        instance = response.instance
        _end(instance, response.tokens)
        instance.streaming -= 1
        if error is not None and not error.counted:
            return  # moved elsewhere by the gateway: neither a success nor a failure
        outcome = error.outcome if error is not None else response.outcome
        if outcome.kind == "ok" and _STREAM_ERROR_EVENT in response.tail:
            # The backend reported a failure inside the stream (Anthropic's `error` event):
            # passed through to the client as it came, counted against the instance.
            outcome = _STREAM_ERROR
        now = self._clock()
        usage = None
        if outcome.kind == "ok" and error is None and response.route.modelled:
            end = response.before_tail + response.tail
            usage = usage_of(end, response.first_chunk, response.route.protocol)
        _record(
            self._timeout_log,
            self._pools[instance.pool_name],
            instance,
            outcome,
            now,
            now - response.started_at,
            False,  # a probe that streams was settled at its first byte
            self._on_transition,
            response.first_at - response.started_at,
            tokens=usage.output_tokens if usage is not None else None,
            sent_with=response.sent_with,
            modelled=response.route.modelled,
            # A stream cut for its silence while the instance went on sending on its other
            # streams (in the later half of that silence: an instance that froze sent its
            # last bytes around when this stream did): a stall of its own, or a burst of
            # prefills there, not a frozen instance.
            others_flowing=instance.progress_at > (response.last_at + now) / 2,
        )
        if usage is not None:
            pool = self._pools[instance.pool_name]
            instance.latency.observe_stream(
                response.first_at - response.started_at,
                response.max_gap_s,
                response.last_at - response.started_at,
                usage.output_tokens,
                response.prompt_tokens,
                response.queued,
            )
            _learning(pool, instance)

    def _probe_streamed(self, pool: PoolState, instance: InstanceState, waited_s: float) -> None:
        """A probe that is a stream is settled by its first byte: the instance answered, and
        takes traffic again now rather than once the answer ends (a long generation would
        keep it out of rotation for its whole length). How the stream goes on counts as any
        other attempt's: one that breaks later is a failure while admitting."""
        now = self._clock()
        instance.stats.probe_settled(succeeded=True)
        _to_breaker(pool, instance, now, False, False, True, waited_s, self._on_transition)

    def _refused(self, pool: PoolState, instance: InstanceState, now: float, reason: str) -> None:
        """Nothing listens on the instance's port (stopped, crashed, restarting): it leaves
        rotation now, whatever the pool's isolation cap, which bounds the breakers' guesses
        from failure counts (down is not an outlier, as Envoy caps outlier ejection but not
        failed health checks). With health checks it is unhealthy until a check passes; without,
        its breaker isolates it until a probe answers, except in a pool of one, where the
        breaker never isolates. With nothing left in rotation, the pool panics as always:
        new requests still try it (a restart ends with it listening), this one is answered."""
        if pool.policy.health.enabled:
            change = pool.refused(instance, reason)
            if change is not None:
                log_health_change(pool, instance, change)
            return
        if len(pool.instances) > 1:
            transition = instance.breaker.isolate(
                now, pool.rng, "connection refused", forced=False, capped=False
            )
            if transition is not None:
                self._on_transition(pool.name, transition)

    def _lost_race(self, call: Call, instance: InstanceState, now: float, waited_s: float) -> None:
        """A hedge answered first and this attempt was given up: not a failure once, but an
        instance that loses as many races in a row as it may time out (with no answer in
        between) is not answering: each further loss counts as a first-byte timeout."""
        instance.races_lost += 1
        if instance.races_lost < call.pool.policy.breaker.consecutive_timeouts:
            return
        _record(
            self._timeout_log,
            call.pool,
            instance,
            _LOST_RACE,
            now,
            waited_s,
            call.attempt.probe,
            self._on_transition,
        )

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        instance = call.attempt.instance
        assert instance is not None, "the pick layer runs first"
        tokens = call.attempt.tokens
        instance.in_flight += 1
        instance.tokens_held += tokens
        sent_with = instance.in_flight
        reserved = call.attempt.reserved
        if reserved is not None:  # admission held the tokens; this attempt takes them over
            call.attempt.reserved = None
            if reserved.budget is not None:
                reserved.budget.release(tokens)
        if instance.budget is not None:
            instance.budget.acquire(tokens)
        instance.requests += 1
        # Sent behind as many attempts as the instance was ever seen serving at once: it
        # waits for a slot, and its first byte is no measure of the instance's speed.
        started = self._clock()
        queued = instance.over_capacity(started)
        try:
            response = await next_handler(call)
        except UpstreamError as error:
            _end(instance, tokens)
            now = self._clock()
            if error.local:
                # The gateway's own limit (all connections to it busy): the request never
                # reached the instance, so it says nothing of it (a probe did not happen).
                if call.attempt.probe:
                    instance.breaker.release_probe(now)
                raise
            outcome = error.outcome
            queueing = outcome.phase == Phase.FIRST_BYTE and _queueing(
                instance, queued, started, now
            )
            if outcome.kind == "timeout" and queued:
                _abandoned(instance, outcome, now, now - started)
            # A refused connection says the instance is down: with health checks, they take
            # it out and bring it back (`_refused`); as the breaker's failure it would also be
            # isolated, for seconds after its checks passed again.
            refused = isinstance(error, UpstreamConnectError) and error.refused
            judged = not (refused and call.pool.policy.health.enabled)
            _record(
                self._timeout_log,
                call.pool,
                instance,
                outcome,
                now,
                now - started,
                call.attempt.probe,
                self._on_transition,
                queueing=queueing,
                backoff=call.attempt.timeouts.backoff if call.attempt.timeouts is not None else 0,
                sent_with=sent_with,
                modelled=call.route.modelled,
                judged=judged,
            )
            if refused:
                self._refused(call.pool, instance, now, error.message)
            raise
        except asyncio.CancelledError:
            _end(instance, tokens)  # the client left: nobody's fault, but a probe is lost
            now = self._clock()
            if call.attempt.probe:
                instance.breaker.release_probe(now)
            if call.cancellation.pending(SUPERSEDED):
                if queued:  # left in the engine's queue until it notices: a ghost meanwhile
                    _abandoned(instance, _LOST_RACE, now, now - started)
                self._lost_race(call, instance, now, now - started)
            raise
        route = call.route
        if response.body is None:
            if route.modelled and response.outcome.kind == "ok":
                waited_s = response.first_at - response.started_at
                pace = call.pool.latency_prior(response.first_at).per_token.mean
                instance.price_first_byte(response.first_at, waited_s, pace)
            if call.attempt.probe:
                self._probe_streamed(call.pool, instance, response.first_at - started)
            response.tokens = tokens
            response.queued = queued
            response.sent_with = sent_with
            response.prompt_tokens = call.prompt_tokens  # worked out by the deadline layer
            streaming = instance.streaming + 1
            instance.streaming = streaming
            if streaming > instance.capacity_seen:
                instance.capacity_seen = streaming
            response.after(self._stream_finished)
            return response
        _end(instance, tokens)
        outcome = response.outcome
        now = self._clock()
        output_tokens = None
        if outcome.kind == "ok" and route.modelled:
            end = response.body[-EDGE_BYTES:]
            output_tokens = usage_of(end, protocol=route.protocol).output_tokens
        generated = output_tokens
        if generated is None and route.generates:
            generated = call.facts.max_tokens
        if generated is not None and generated < MIN_RATED_TOKENS:
            generated = None  # its prefill, not its decoding, would be the measure
        _record(
            self._timeout_log,
            call.pool,
            instance,
            outcome,
            now,
            now - started,
            call.attempt.probe,
            self._on_transition,
            tokens=generated,
            sent_with=sent_with,
            modelled=route.modelled,
        )
        if outcome.kind == "ok" and route.modelled:
            instance.latency.observe_whole(response.first_at - response.started_at, output_tokens)
            _learning(call.pool, instance)
        return response
