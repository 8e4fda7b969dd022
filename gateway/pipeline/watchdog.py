"""Coarse deadlines for many requests, enforced by one periodic task.

A timer per request, and aiohttp's read timeout re-armed on every chunk, cost more than relaying
the chunk itself. Instead each attempt holds a `Deadline` whose `at` it moves as it progresses
(an attribute write), and one sweep every `tick_s` cancels the tasks whose deadline has passed.
The owner turns that cancellation into an `UpstreamTimeout` for the phase that ran out.
Deadlines fire up to one tick late; LLM timeouts are hundreds of milliseconds and up.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.tasks import cancel_and_wait


class Deadline:
    __slots__ = ("at", "fired", "phase", "task")

    def __init__(self, task: asyncio.Task[Any], at: float, phase: str) -> None:
        self.task = task
        self.at = at  # event-loop time; moved forward by the owner as the attempt progresses
        self.phase = phase  # what the attempt is waiting for: first_byte, body, idle, total
        self.fired = False

    def move(self, at: float, phase: str) -> None:
        self.at = at
        self.phase = phase


class Watchdog:
    def __init__(self, tick_s: float = 0.025) -> None:
        self._tick_s = tick_s
        self._live: set[Deadline] = set()
        self._task: asyncio.Task[None] | None = None
        self._armed = asyncio.Event()  # lets an idle process sleep instead of ticking

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sweep())

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    def arm(self, task: asyncio.Task[Any], at: float, phase: str) -> Deadline:
        deadline = Deadline(task, at, phase)
        if not self._live:
            self._armed.set()
        self._live.add(deadline)
        return deadline

    def disarm(self, deadline: Deadline) -> None:
        self._live.discard(deadline)

    def sweep(self, now: float) -> int:
        """Cancel the task of every deadline past `now`; returns how many fired."""
        expired = [d for d in self._live if d.at <= now]
        for deadline in expired:
            self._live.discard(deadline)
            deadline.fired = True
            deadline.task.cancel()
        return len(expired)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._live:
                self._armed.clear()
                await self._armed.wait()
            await asyncio.sleep(self._tick_s)
            self.sweep(loop.time())


def expired(deadline: Deadline) -> bool:
    """After a CancelledError: True if this deadline caused it (the cancel is then consumed)."""
    if deadline.fired and deadline.task.cancelling() > 0:
        deadline.fired = False
        deadline.task.uncancel()
        return True
    return False
