"""The layer that counts an attempt against its instance and pool, once, when it has ended.

An answer read whole ends with the transport; a stream ends when its relay does, so its
accounting runs from the response's finish hook (latency, outcome and in-flight count are only
known then). Only successful attempts teach the latency estimators: a failed one says nothing
about how long a healthy answer takes.
"""

from __future__ import annotations

import asyncio

from gateway.core.outcome import Outcome
from gateway.errors import UpstreamError
from gateway.pipeline.call import Call, Handler
from gateway.upstream.registry import InstanceState, PoolState
from gateway.upstream.response import UpstreamResponse

_USAGE_KEY = b'"completion_tokens":'


def completion_tokens(data: bytes) -> int | None:
    """`usage.completion_tokens` from the end of a JSON body or stream, without parsing it."""
    at = data.rfind(_USAGE_KEY)
    if at < 0:
        return None
    digits = data[at + len(_USAGE_KEY) : at + len(_USAGE_KEY) + 12].lstrip()
    end = 0
    while end < len(digits) and 48 <= digits[end] <= 57:
        end += 1
    return int(digits[:end]) if end else None


def _record(pool: PoolState, instance: InstanceState, outcome: Outcome) -> None:
    failed = outcome.counts_as_failure
    pool.failure.observe(failed)
    if failed:
        instance.failures += 1


class Account:
    def __init__(self, pools: dict[str, PoolState]) -> None:
        self._pools = pools

    def _stream_finished(self, response: UpstreamResponse, error: UpstreamError | None) -> None:
        instance = response.instance
        instance.in_flight -= 1
        outcome = error.outcome if error is not None else response.outcome
        _record(self._pools[instance.pool_name], instance, outcome)
        if outcome.kind == "ok" and error is None:
            instance.latency.observe_stream(
                response.first_at - response.started_at,
                response.max_gap_s,
                response.last_at - response.started_at,
                completion_tokens(response.tail),
            )

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        instance = call.instance
        assert instance is not None, "the pick layer runs first"
        instance.in_flight += 1
        instance.requests += 1
        try:
            response = await next_handler(call)
        except UpstreamError as error:
            instance.in_flight -= 1
            _record(call.pool, instance, error.outcome)
            raise
        except asyncio.CancelledError:
            instance.in_flight -= 1  # the client left: nobody's fault
            raise
        if response.body is None:
            response.on_finish = self._stream_finished
            return response
        instance.in_flight -= 1
        outcome = response.outcome
        _record(call.pool, instance, outcome)
        if outcome.kind == "ok":
            instance.latency.observe_whole(
                response.first_at - response.started_at, completion_tokens(response.body)
            )
        return response
