"""The layer that sets one attempt's timeouts from its instance's latency prediction.

Inside the retry loop, so each attempt gets the timeouts of the instance it goes to, with the
`k` of the pool's current tier (see `gateway.core.timeouts.attempt_timeouts` for the rule), and
with what the gateway knows of the load it put there: its other attempts on the instance
against what the instance was seen serving at once, and the prompt's size. An instance that
has not learned its own figures is timed from its pool's (a prior), never from the static
initial guess alone while its peers know better.
"""

from __future__ import annotations

from dataclasses import replace

from gateway.core.concurrency import prompt_tokens
from gateway.core.timeouts import AttemptTimeouts, Load
from gateway.pipeline.call import Call, Handler
from gateway.runtime import Clock
from gateway.upstream.response import UpstreamResponse


class DeadlineLayer:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        attempt = call.attempt
        instance = attempt.instance
        assert instance is not None, "the pick layer runs first"
        pool = call.pool
        policy = pool.policy.timeouts
        facts = call.facts
        now = self._clock()
        route = call.route
        if not route.modelled:
            # Nothing predicts it: it may take as long as the request may, as it would going
            # direct (a stream's gaps too).
            left = max(0.0, call.deadline - now)
            attempt.timeouts = AttemptTimeouts(
                first_byte_s=left,
                idle_s=left if call.facts.stream else None,
                connect_s=min(policy.connect, left),
            )
            return await next_handler(call)
        if not call.prompt_tokens:
            call.prompt_tokens = prompt_tokens(call.prompt_bytes())
        attempt.timeouts = pool.timing.timeouts_for(
            instance,
            call.k,
            now,
            stream=facts.stream,
            # A pooling route generates nothing: only the prefill counts.
            max_tokens=facts.max_tokens if route.generates else 0,
            jitter_s=pool.rng.uniform(0.0, policy.jitter) if policy.jitter else 0.0,
            # The account layer counted this attempt in already; attempts given up on may still
            # hold the engine's slots.
            load=Load(
                instance.in_flight - 1 + instance.ghosts_at(now),
                instance.capacity_seen,
                call.prompt_tokens,
                now - instance.progress_at,
            ),
            # No retry may follow, or none could go anywhere else: giving up early on a slow
            # answer only turns it into an error. Unless its last health check got no answer
            # at all (frozen, dead): what does not answer a check will not answer this later.
            final=(
                call.attempts - call.hedges >= call.last_attempt
                or pool.alone(instance, now, call.avoid)
            )
            and instance.health.answered,
        )
        if attempt.probe and instance.breaker.spare_until is not None:
            # A spare probe (`BreakerState.try_admit(spare=True)`) asks whether an instance is
            # back, for a request that has a fallback: a hung instance must not hold it for a
            # whole first-byte timeout. Too short for a slow answer, it only fails: the
            # isolation goes on as it was, and its own probe comes when it ends.
            cap = max(policy.floor, 2 * policy.connect)
            if attempt.timeouts.first_byte_s > cap:
                attempt.timeouts = replace(attempt.timeouts, first_byte_s=cap)
        return await next_handler(call)
