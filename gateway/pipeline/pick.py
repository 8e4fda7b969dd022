"""The layer that chooses an instance for each attempt."""

from __future__ import annotations

import asyncio

from gateway.core.picker import round_robin
from gateway.errors import NoInstanceAvailable
from gateway.pipeline.call import Call, Handler
from gateway.upstream.response import UpstreamResponse


async def pick(call: Call, next_handler: Handler) -> UpstreamResponse:
    """Round robin over the pool's routable (healthy) instances, avoiding those this request
    already tried and those waiting out a Retry-After (unless nothing else is left). With no
    routable instance at all, the client is told at once (503 + Retry-After): no waiting on a
    dead pool."""
    pool = call.pool
    candidates = pool.routable
    if not candidates:
        raise NoInstanceAvailable(
            f"no instance of pool {pool.name!r} is available",
            retry_after_s=pool.policy.health.interval,
        )
    exclude = call.tried
    if pool.blocked_until > 0.0:
        now = asyncio.get_running_loop().time()
        if pool.blocked_until > now:
            exclude = exclude + [i for i in candidates if i.not_before > now]
        else:
            pool.blocked_until = 0.0
    instance, pool.next_index = round_robin(candidates, pool.next_index, exclude)
    call.instance = instance
    call.tried.append(instance)
    call.attempts += 1
    return await next_handler(call)
