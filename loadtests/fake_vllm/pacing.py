"""When a fake stream's tokens leave: the first after the time to first token, each next one
`per_token` later, scheduled from the first so sleep overshoot does not accumulate."""

from __future__ import annotations

import asyncio


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
