"""Tests waiting, without polling, until a count reaches a value (requests ended, queued)."""

from __future__ import annotations

import asyncio


class CountWaiters:
    def __init__(self) -> None:
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def __bool__(self) -> bool:
        return bool(self._waiters)

    async def wait(self, count: int, current: int, timeout_s: float) -> bool:
        """Until `wake` sees at least `count` (now `current`); False if `timeout_s` passed."""
        if current >= count:
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (count, future)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def wake(self, current: int) -> None:
        for count, future in self._waiters:
            if current >= count and not future.done():
                future.set_result(None)
