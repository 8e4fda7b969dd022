"""The layer that counts an attempt against its instance and pool, once, when it has ended.

An answer read whole ends with the transport; a stream ends when its relay does, so its
accounting runs from the response's finish hook (latency, outcome and in-flight count are only
known then). What a finished attempt teaches its instance and pool is
`gateway.upstream.feedback`'s to say.
"""

from __future__ import annotations

import asyncio

from gateway.core.outcome import Outcome, Phase
from gateway.core.usage import EDGE_BYTES, usage_of
from gateway.errors import UpstreamConnectError, UpstreamError
from gateway.pipeline.call import Call, Handler
from gateway.runtime import SUPERSEDED, Clock
from gateway.upstream.feedback import (
    Feedback,
    OnTransition,
    abandoned,
    asked_to_wait,
    learning,
    waited_in_queue,
)
from gateway.upstream.health import log_health_change
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.response import UpstreamResponse

# How Anthropic ends a stream that failed: an `error` event, after which nothing comes.
_STREAM_ERROR_EVENT = b"event: error"

_STREAM_ERROR = Outcome.from_error("protocol")
# A whole answer teaches the limiter its time per output token only from this many tokens:
# a shorter one's latency is mostly its prompt's prefill.
MIN_RATED_TOKENS = 16
_LOST_RACE = Outcome.from_error("timeout", Phase.FIRST_BYTE)


class Account:
    def __init__(
        self, pools: dict[str, PoolState], on_transition: OnTransition, clock: Clock
    ) -> None:
        self._pools = pools
        self._on_transition = on_transition
        self._clock = clock
        self._feedback = Feedback(on_transition)

    def _stream_finished(self, response: UpstreamResponse, error: UpstreamError | None) -> None:
        instance = response.instance
        instance.attempt_ended(response.tokens)
        instance.stream_ended()
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
        self._feedback.attempt_finished(
            self._pools[instance.pool_name],
            instance,
            outcome,
            now,
            now - response.started_at,
            False,  # a probe that streams was settled at its first byte
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
            learning(pool, instance)

    def _probe_streamed(self, pool: PoolState, instance: InstanceState, waited_s: float) -> None:
        """A probe that is a stream is settled by its first byte: the instance answered, and
        takes traffic again now rather than once the answer ends (a long generation would
        keep it out of rotation for its whole length). How the stream goes on counts as any
        other attempt's: one that breaks later is a failure while admitting."""
        now = self._clock()
        instance.stats.probe_settled(succeeded=True)
        self._feedback.to_breaker(pool, instance, now, False, False, True, waited_s)

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

    def _lost_race(
        self,
        call: Call,
        instance: InstanceState,
        now: float,
        started: float,
        queued: bool,
        sent_with: int,
    ) -> None:
        """A hedge answered first and this attempt was given up: not a failure once, but an
        instance that loses as many races in a row as it may time out (with no answer in
        between) is not answering: each further loss counts as a first-byte timeout. One
        that waited its turn in the queue of an instance that kept working (as a first-byte
        timeout is not blamed then: `waited_in_queue`) lost for the queue, not for the
        instance: not counted."""
        if waited_in_queue(instance, queued, started, now):
            return
        if instance.lost_race() < call.pool.policy.breaker.consecutive_timeouts:
            return
        self._feedback.attempt_finished(
            call.pool,
            instance,
            _LOST_RACE,
            now,
            now - started,
            call.attempt.probe,
            sent_with=sent_with,
        )

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        instance = call.attempt.instance
        assert instance is not None, "the pick layer runs first"
        tokens = call.attempt.tokens
        reserved = call.attempt.reserved
        if reserved is not None:  # admission held the tokens; this attempt takes them over
            call.attempt.reserved = None
            reserved.unreserve(tokens)
        sent_with = instance.attempt_started(tokens)
        # Sent behind as many attempts as the instance was ever seen serving at once: it
        # waits for a slot, and its first byte is no measure of the instance's speed.
        started = self._clock()
        queued = instance.over_capacity(started)
        try:
            response = await next_handler(call)
        except UpstreamError as error:
            self._failed(call, instance, error, tokens, started, queued, sent_with)
            raise
        except asyncio.CancelledError:
            self._cancelled(call, instance, tokens, started, queued, sent_with)
            raise
        except Exception:
            # An error of no kind this layer knows (a defect under it): the attempt ends,
            # neither the instance's failure nor its success; its slot is not held for good.
            self._unjudged(call, instance, tokens)
            raise
        if response.body is None:
            self._streaming(call, instance, response, tokens, started, queued, sent_with)
        else:
            self._answered_whole(call, instance, response, tokens, started, sent_with)
        return response

    def _failed(
        self,
        call: Call,
        instance: InstanceState,
        error: UpstreamError,
        tokens: int,
        started: float,
        queued: bool,
        sent_with: int,
    ) -> None:
        """The attempt failed before its answer reached the client (the error goes on up)."""
        instance.attempt_ended(tokens)
        now = self._clock()
        if error.local:
            # The gateway's own limit (all connections to it busy): the request never
            # reached the instance, so it says nothing of it (a probe did not happen).
            if call.attempt.probe:
                instance.breaker.release_probe(now)
            return
        outcome = error.outcome
        queueing = outcome.phase == Phase.FIRST_BYTE and waited_in_queue(
            instance, queued, started, now
        )
        if outcome.kind == "timeout" and queued:
            abandoned(instance, outcome, now, now - started)
        # A refused connection says the instance is down: with health checks, they take
        # it out and bring it back (`_refused`); as the breaker's failure it would also be
        # isolated, for seconds after its checks passed again.
        refused = isinstance(error, UpstreamConnectError) and error.refused
        judged = not (refused and call.pool.policy.health.enabled)
        self._feedback.attempt_finished(
            call.pool,
            instance,
            outcome,
            now,
            now - started,
            call.attempt.probe,
            queueing=queueing,
            backoff=call.attempt.timeouts.backoff if call.attempt.timeouts is not None else 0,
            sent_with=sent_with,
            modelled=call.route.modelled,
            judged=judged,
        )
        if refused:
            self._refused(call.pool, instance, now, error.message)

    def _unjudged(self, call: Call, instance: InstanceState, tokens: int) -> float:
        """The attempt ended with no result to count for or against its instance: it no
        longer occupies it, and a probe it was is lost (the next request probes). The time."""
        instance.attempt_ended(tokens)
        now = self._clock()
        if call.attempt.probe:
            instance.breaker.release_probe(now)
        return now

    def _cancelled(
        self,
        call: Call,
        instance: InstanceState,
        tokens: int,
        started: float,
        queued: bool,
        sent_with: int,
    ) -> None:
        """The attempt was cancelled from above: the client left, or a hedge answered first."""
        now = self._unjudged(call, instance, tokens)  # the client left: nobody's fault
        if call.cancellation.pending(SUPERSEDED):
            if queued:  # left in the engine's queue until it notices: a ghost meanwhile
                abandoned(instance, _LOST_RACE, now, now - started)
            self._lost_race(call, instance, now, started, queued, sent_with)

    def _streaming(
        self,
        call: Call,
        instance: InstanceState,
        response: UpstreamResponse,
        tokens: int,
        started: float,
        queued: bool,
        sent_with: int,
    ) -> None:
        """A stream reached its first byte: priced by it now, counted when it ends
        (`_stream_finished`, from the response's finish hook)."""
        status = response.status
        if status == 429 or status == 503:  # with a body not read whole: as `_answered_whole`
            asked_to_wait(call.pool, response, response.first_at)
        elif instance.rate_limits_in_row:
            instance.not_rate_limited()
        if call.route.modelled and response.outcome.kind == "ok":
            # Not what a stall of the whole engine took of the wait (`unstalled_wait_s`).
            waited_s = instance.stall.unstalled_wait_s(
                response.started_at, response.first_at, instance.latency.ttfb.mean
            )
            pace = call.pool.timing.latency_prior(response.first_at).per_token.mean
            instance.price.first_byte(response.first_at, waited_s, instance.latency, pace)
        if call.attempt.probe:
            self._probe_streamed(call.pool, instance, response.first_at - started)
        response.tokens = tokens
        response.queued = queued
        response.sent_with = sent_with
        response.prompt_tokens = call.prompt_tokens  # worked out by the deadline layer
        instance.stream_started()
        response.after(self._stream_finished)

    def _answered_whole(
        self,
        call: Call,
        instance: InstanceState,
        response: UpstreamResponse,
        tokens: int,
        started: float,
        sent_with: int,
    ) -> None:
        """An answer read whole: its attempt ends here, counted with its output tokens."""
        instance.attempt_ended(tokens)
        route = call.route
        outcome = response.outcome
        now = self._clock()
        status = outcome.status
        if status == 429 or status == 503:
            # Asked to come back later (or rate-limited without a word on when): no attempt
            # of any request, hedges and continuations included, goes to it until then.
            asked_to_wait(call.pool, response, now)
        elif instance.rate_limits_in_row:
            instance.not_rate_limited()  # an answer other than a 429 ends a run of them
        output_tokens = None
        body = response.body
        if outcome.kind == "ok" and route.modelled and body is not None:
            output_tokens = usage_of(body[-EDGE_BYTES:], protocol=route.protocol).output_tokens
        generated = output_tokens
        if generated is None and route.generates:
            generated = call.facts.max_tokens
        if generated is not None and generated < MIN_RATED_TOKENS:
            generated = None  # its prefill, not its decoding, would be the measure
        self._feedback.attempt_finished(
            call.pool,
            instance,
            outcome,
            now,
            now - started,
            call.attempt.probe,
            tokens=generated,
            sent_with=sent_with,
            modelled=route.modelled,
        )
        if outcome.kind == "ok" and route.modelled:
            instance.latency.observe_whole(response.first_at - response.started_at, output_tokens)
            learning(call.pool, instance)
