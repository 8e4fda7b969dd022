"""The retry loop: re-sends a failed attempt, before the commit point only.

Per client request: the pool's failure rate picks the tier (max retries, backoff base, `k`); an
attempt whose outcome `retries.on` lists is retried on another instance when one is left, after
exponential backoff with full jitter, if the retry budget and the request's deadline allow (a
refused connection is sent elsewhere without spending the budget: it cost no instance any work; a
retry that is answered gives its budget back: the budget bounds retries that fail again, the load
that serves no one; a request the gateway's own connection limit refused is answered at once when no
other instance has room). A lone instance (a pool of one, or one whose other instances cannot take
traffic) is retried itself after a transient failure (an error status, an OOM, a reset before the
first byte), up to the most retries any tier allows: the tiers hold retries back when a high failure
rate says failing over would land on other failing instances, but a transient failure of the only
instance left is best met by asking it again (never by giving up while going direct would have
worked). So is one while an instance the request has not tried is sound (it fails less often than
the most generous tier's bound): a pool's rate is high when one of three instances fails half its
requests, and its tier's one retry may land on a second failing instance while the third answers
everything. A request allowed those retries keeps them: its later attempts were timed as not its
last (a learned first-byte timeout, not a last attempt's longer one), so one that times out is
followed by the retry it was timed for rather than ending in a 504. An instance that let the
request's first byte time out is not asked again for it while it has sent nothing to anyone since:
when nothing else is left, the timeout is the answer. A Retry-After from a backend (or, on a 429
without one, a backoff that grows with the 429s in a row: `upstream.feedback.asked_to_wait`) keeps
every attempt off that instance until it passes: a retry that would have to wait longer than the
request's deadline allows is not made, and the backend's answer goes back at once; one that may
waits for the first instance free of its pause, as does a request whose every instance is paused as
it starts (`InstancesPaused`). The upstream's own error answer is relayed unchanged when no retry is
allowed. A request that could do something twice (`Call.acts`: a route the gateway does not know, a
Responses API request running in the background or with the server's own tools) is sent again only
after a refused connection, when it never left. Everything here happens before a byte reaches the
client: the transport returns at the first byte, and the relay (the commit point) starts only after
this loop has returned.
"""

from __future__ import annotations

import asyncio

from opentelemetry import trace

from gateway.core.backoff import backoff_s
from gateway.core.outcome import Outcome, Phase
from gateway.core.tiers import Tier
from gateway.errors import InstancesPaused, UpstreamError
from gateway.pipeline.call import Call, Handler
from gateway.runtime import Clock
from gateway.upstream.pool import PoolState
from gateway.upstream.response import Owned, UpstreamResponse
from gateway.upstream.stats import outcome_label

# What a lone instance is asked again for: it answered, or reset before the first byte, and may
# well answer the next time (503, 429 after its Retry-After, an OOM, a restart). A refusal or a
# hang is not met with more of the same.
_TRANSIENT = frozenset(("status", "oom", "reset"))


# An instance that refused the connection or dropped it before answering is likely down or
# going down (killed, restarting), and one that let it time out is likely hung or swamped: a
# retry goes elsewhere while anything else can take it, an isolated instance included.
_AVOID_AFTER = frozenset(("connect_failure", "reset", "timeout"))


class Retry:
    """The retry layer. `traced`: events on the request's span."""

    def __init__(self, clock: Clock, traced: bool = False) -> None:
        self._clock = clock
        self._traced = traced  # events on the request's span: retries, budget refusals

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        clock = self._clock
        pool = call.pool
        pool.budget.record_request(clock())
        tier = pool.tiers.choose(pool.failure.rate)
        call.k = tier.k
        call.last_attempt = tier.max_retries + 1
        retries_policy = pool.policy.retries
        spent_at: float | None = None  # when the retry under way spent the budget
        while True:
            response: UpstreamResponse | None = None
            failure: UpstreamError | None = None
            try:
                response = await next_handler(call)
                outcome = response.outcome
                if outcome.kind == "ok":
                    if spent_at is not None:
                        pool.budget.refund(spent_at, clock())
                    return response
            except UpstreamError as error:
                failure = error
                outcome = error.outcome
                if outcome.kind in _AVOID_AFTER and call.attempt.instance is not None:
                    _avoid_instance(call, outcome, clock)
            except InstancesPaused as paused:
                await self._wait_out(call, paused, tier)
                continue
            # The failed attempt's answer: handed back when no retry is allowed, else closed
            # before the next attempt starts.
            with Owned(response) as failed:
                now = clock()
                wait_s = 0.0
                if response is not None and response.instance.not_before > now:
                    wait_s = _pause_left_s(pool, now)
                max_retries = _max_retries(call, outcome, now)
                # Every instance asked for a pause: a request that fallback pools may answer
                # goes to them now rather than waiting it out (`Call.handover`).
                allowed = not (wait_s and call.handover) and _may_retry(
                    call, outcome, failure, max_retries, now
                )
                if allowed:
                    delay = backoff_s(
                        max(1, call.attempts - call.hedges),
                        tier.backoff_s,
                        retries_policy.max_backoff,
                        pool.rng,
                    )
                    delay = max(delay, wait_s)
                    allowed = now + delay < call.deadline
                    # A refused connection did no work anywhere: sending the request elsewhere
                    # adds no load (Finagle's requeues), and each instance refuses it once at
                    # most.
                    requeue = outcome.kind == "connect_failure"
                    spent_at = None
                    if allowed and not requeue:
                        if pool.budget.try_spend(now):
                            spent_at = now  # given back if this retry is answered
                        else:
                            allowed = False
                            self._budget_exhausted(call)
                if not allowed:
                    if response is not None:
                        return failed.hand_over()  # the backend's own answer, unchanged
                    assert failure is not None
                    raise failure
                self._scheduled(call, outcome, delay)
            if delay > 0:
                await asyncio.sleep(delay)

    async def _wait_out(self, call: Call, paused: InstancesPaused, tier: Tier) -> None:
        """Every instance the request could go to asked for a pause: the request waits for
        the first to end it (plus a draw of the tier's backoff, so that requests that waited
        together do not all arrive at once) when its deadline allows and no fallback pool may
        answer it; else the 503 goes on at once, with its Retry-After (to the client, rather
        than after a wait that could only end in a timeout; or to the fallbacks). No attempt
        was made: nothing is counted or spent."""
        wait_s = (paused.retry_after_s or 0.0) + call.pool.rng.uniform(0.0, tier.backoff_s)
        if call.handover or self._clock() + wait_s >= call.deadline:
            raise paused  # to the client, or to the fallback pools that may answer it now
        await asyncio.sleep(wait_s)

    def _budget_exhausted(self, call: Call) -> None:
        """A retry the retry budget refused: counted, and an event on the request's span."""
        call.pool.stats.budget_exhausted += 1
        if self._traced:
            trace.get_current_span().add_event(
                "retry budget exhausted", {"gateway.attempt": call.attempts}
            )

    def _scheduled(self, call: Call, outcome: Outcome, delay: float) -> None:
        """A retry is going ahead after `delay`: counted by its reason, and on the span."""
        call.pool.stats.retry(outcome)
        if self._traced:
            trace.get_current_span().add_event(
                "retry scheduled",
                {
                    "gateway.attempt": call.attempts,
                    "gateway.retry.reason": outcome_label(outcome),
                    "gateway.retry.backoff_s": delay,
                },
            )


def _avoid_instance(call: Call, outcome: Outcome, clock: Clock) -> None:
    """Keep the request's next attempts off an instance that refused, dropped or let it time
    out (`_AVOID_AFTER`), and note when it went silent if its wait proves it so."""
    instance = call.attempt.instance
    assert instance is not None
    call.avoid.append(instance)
    waited = _waited_in_vain(call, outcome)
    if waited is not None:
        # Silent from when it was asked: bytes it sent anyone since say it is busy, not gone.
        call.timed_out.append((instance, clock() - waited))


def _max_retries(call: Call, outcome: Outcome, now: float) -> int:
    """The retries the request may make: its tier's (`Call.last_attempt` starts there), or,
    after a transient failure, the most any tier allows (raising `Call.last_attempt` to
    match) when the instance is alone or a sound instance is left untried (see the module
    docstring). Once raised, they stay raised: the attempts that followed were timed as not
    the last (a learned first-byte timeout, not a last attempt's longer one), and one of
    those that times out is owed its retry."""
    pool = call.pool
    max_retries = call.last_attempt - 1
    if (
        max_retries < pool.tiers.most_retries
        and outcome.kind in _TRANSIENT
        and call.attempt.instance is not None
        and (
            # A lone instance: retrying it is the only way to an answer.
            pool.alone(call.attempt.instance, now, call.avoid)
            # A pool whose failures sit on some instances (its rate high, its tier's
            # retries few) with a sound one left untried: a retry there is no storm.
            or pool.sound_elsewhere(call.tried, now)
        )
    ):
        max_retries = pool.tiers.most_retries
        call.last_attempt = max_retries + 1
    return max_retries


def _may_retry(
    call: Call, outcome: Outcome, failure: UpstreamError | None, max_retries: int, now: float
) -> bool:
    """Whether the attempt's outcome may be retried at all, before backoff and budget: the
    pool retries it, the request may be sent twice, retries and time are left, and another
    attempt is not bound to meet the same full or silent instances."""
    return (
        outcome.retryable(call.pool.retry_on)
        # What could act twice is sent again only if it was never sent.
        and (not call.acts or outcome.kind == "connect_failure")
        and call.attempts - call.hedges - 1 < max_retries
        and now < call.deadline
        and not _full_everywhere(failure, call, now)
        and not _only_silent_left(call)
    )


def _full_everywhere(failure: UpstreamError | None, call: Call, now: float) -> bool:
    """Whether `failure` is the gateway's own connection limit (every connection it allows to
    the instance stayed busy for the connect timeout) with no other instance free to take the
    request: another attempt would wait out the same busy connections again. Answered at once
    (503 + Retry-After) instead of after one connect timeout per retry."""
    instance = call.attempt.instance
    return (
        failure is not None
        and failure.local
        and instance is not None
        and not call.pool.has_room(instance, now, call.avoid)
    )


def _waited_in_vain(call: Call, outcome: Outcome) -> float | None:
    """How long the attempt waited for a first byte that never came, when that proves the
    instance silent: all the patience an instance with nothing learned gets
    (`timeouts.initial`), or all a streamed generation may get anywhere (the pool's
    `timeouts.first_token_max`, when the attempt waited that long), or any wait on an instance
    whose last health check got no answer either. A shorter, learned wait proves less: a retry
    there waits longer (the last attempt is stretched, the more after timeouts in a row), up
    to that same allowance. A wait cut by the limit is all a retry there would get too:
    asking an instance that has sent nothing to anyone since only repeats it, while one that
    sends on other attempts is busy, not silent (`Call.silent`), and may be asked again. None:
    not such a timeout."""
    instance, timeouts = call.attempt.instance, call.attempt.timeouts
    if outcome.kind != "timeout" or outcome.phase is not Phase.FIRST_BYTE or instance is None:
        return None
    waited = timeouts.first_byte_s if timeouts is not None else 0.0
    if (
        waited >= call.pool.policy.timeouts.initial
        or (timeouts is not None and timeouts.capped)
        or not instance.health.answered
    ):
        return waited
    return None


def _only_silent_left(call: Call) -> bool:
    """Whether every instance of the pool would be asked again (each one refused, dropped or
    let this request time out) and none of those may be but silent ones: the request's own
    timeout is the answer (504), not one more whole wait on an instance that answered nothing
    since (a hung lone instance costs one first-byte timeout, not one per retry)."""
    if not call.timed_out:
        return False
    avoid = call.avoid
    instances = call.pool.instances
    if any(inst not in avoid for inst in instances):
        return False  # someone else may take it: the pick layer chooses
    return all(call.silent(inst) or inst.health.healthy is False for inst in avoid)


def _pause_left_s(pool: PoolState, now: float) -> float:
    """How long a retry must wait after an answer that paused its instance (a Retry-After, a
    429's backoff: `upstream.feedback.asked_to_wait`): until the first of the pool's instances
    is free of its pause, nothing while one is (the pick layer chooses among those)."""
    first_free = min((inst.not_before for inst in pool.instances), default=now)
    return first_free - now if first_free > now else 0.0
