"""The layer that sets one attempt's timeouts from its instance's latency prediction.

Inside the retry loop, so each attempt gets the timeouts of the instance it goes to, with the
`k` of the pool's current tier (see `gateway.core.timeouts.attempt_timeouts` for the rule).
"""

from __future__ import annotations

from gateway.core.timeouts import attempt_timeouts
from gateway.pipeline.call import Call, Handler
from gateway.upstream.response import UpstreamResponse

_NO_GENERATION = "/v1/embeddings"  # nothing is generated: only the prefill counts


async def deadline(call: Call, next_handler: Handler) -> UpstreamResponse:
    instance = call.instance
    assert instance is not None, "the pick layer runs first"
    policy = call.pool.policy.timeouts
    facts = call.facts
    call.timeouts = attempt_timeouts(
        instance.latency,
        policy,
        call.k,
        stream=facts.stream,
        max_tokens=0 if call.path == _NO_GENERATION else facts.max_tokens,
        jitter_s=call.pool.rng.uniform(0.0, policy.jitter) if policy.jitter else 0.0,
    )
    return await next_handler(call)
