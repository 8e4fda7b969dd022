"""When a fake stream's tokens leave: the first after the time to first token, each next one
`per_token` later, scheduled from the first so sleep overshoot does not accumulate."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from . import responses as r
from .asgi import Send, body_message
from .config import DIE, STALL, STREAM_ERROR, Faults


async def pause(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


class Pacer:
    def __init__(self, ttft: float, per_token: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._first = self._loop.time() + ttft
        self._ttft = ttft
        self._per_token = per_token

    async def first_token(self) -> None:
        await pause(self._ttft)

    async def token(self, k: int) -> None:
        """Until token `k` (counted from 1 after the first) is due."""
        if self._per_token > 0:
            await pause(self._first + self._per_token * k - self._loop.time())


def cut_point(n: int, stop_after: int | None) -> int:
    """Tokens a stream delivers before a fault cuts it (-1: not cut)."""
    return -1 if stop_after is None else min(stop_after, n)


async def send_tokens(
    send: Send,
    pacer: Pacer,
    n: int,
    step: int,
    cut: int,
    event: Callable[[int, int], bytes],
) -> None:
    """Send tokens [0, n), or only the first `cut` when a fault cuts the stream (`cut` >= 0),
    in events of `step` (vLLM's stream interval) made by `event(start, end)`: an event leaves
    when its last token is due, and a cut falls on an event boundary, so exactly `cut` tokens
    are delivered whatever the step. After a cut, returns when the next token would have been
    due: that is when the fault strikes."""
    end_at = n if cut < 0 else cut
    start = 0
    while start < end_at:
        end = min(start + step, end_at)
        await pacer.token(end)
        await send(body_message(event(start, end), more=True))
        start = end
    if 0 <= cut < n:
        await pacer.token(cut + 1)


async def cut_short(fault: str | None, faults: Faults) -> str | None:
    """How a stream cut by `fault` ends, once its tokens are out: "died" (returning mid-body
    makes uvicorn close the connection), "stalled" (after hanging `faults.hang_s`), or None
    when the fault does not end it this way."""
    if fault == DIE:
        return "died"
    if fault == STALL:
        await asyncio.sleep(faults.hang_s)
        return "stalled"
    return None


async def end_stream(send: Send, fault: str | None, faults: Faults, usage: bytes | None) -> str:
    """How an OpenAI-format stream ends once its tokens are out: cut by `fault`, with vLLM's
    error event, or with its `usage` chunk (when asked) and `[DONE]`; the outcome."""
    ended = await cut_short(fault, faults)
    if ended is not None:
        return ended
    if fault == STREAM_ERROR:
        await send(body_message(r.STREAM_ERROR_EVENT + r.DONE, more=False))
        return "stream_error"
    if usage is not None:
        await send(body_message(usage, more=True))
    await send(body_message(r.DONE, more=False))
    return "ok"
