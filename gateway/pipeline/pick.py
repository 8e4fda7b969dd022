"""The layer that chooses an instance for each attempt."""

from __future__ import annotations

from gateway.core.picker import round_robin
from gateway.pipeline.call import Call, Handler
from gateway.upstream.response import UpstreamResponse


async def pick(call: Call, next_handler: Handler) -> UpstreamResponse:
    pool = call.pool
    instance, pool.next_index = round_robin(pool.instances, pool.next_index, call.tried)
    call.instance = instance
    call.tried.append(instance)
    call.attempts += 1
    return await next_handler(call)
