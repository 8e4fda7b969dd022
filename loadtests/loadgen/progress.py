"""How far a run has got, for whoever runs it alongside (a chaos timeline, a progress line).

Counters are plain attributes updated by the generator; `wait_sent(n)` wakes exactly when the
n-th request has been sent (a heap of waiters checked on each send: no polling). The clock is
`time.perf_counter()` seconds from the run's origin, the same clock as the ledger's `t`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable


class Progress:
    """One per run: pass it to `run_load` and watch it from other tasks of the same loop."""

    def __init__(self) -> None:
        self.sent = 0
        self.completed = 0  # records written
        self.ok = 0
        self.t0: float | None = None  # time.perf_counter() at the run's origin (t = 0)
        self.ended = False  # sending is over (the run may still be draining)
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._stop: Callable[[], None] | None = None
        self.stop_requested = False

    @property
    def in_flight(self) -> int:
        return self.sent - self.completed

    def start_clock(self) -> float:
        """Fix the run's origin now (if not yet fixed) and return it.

        `run_load` calls it when it starts. Call it yourself just before `run_load` if something
        (a fault timeline) needs the clock from the very start; arrivals are scheduled from this
        origin, so a late `run_load` sends its first requests late (and their lag shows it).
        """
        if self.t0 is None:
            self.t0 = time.perf_counter()
        return self.t0

    def elapsed(self) -> float:
        """Seconds since the run's origin: the ledger's clock (for Event.t)."""
        if self.t0 is None:
            raise RuntimeError("the run has not started: call start_clock() first")
        return time.perf_counter() - self.t0

    async def wait_sent(self, count: int) -> None:
        """Return once `count` requests have been sent, or sending ended before that
        (check `sent` if it matters)."""
        if self.sent >= count or self.ended:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (count, next(self._order), future))
        await future

    def stop(self) -> None:
        """Stop sending now; in-flight requests are drained as at the time limit."""
        self.stop_requested = True
        if self._stop is not None:
            self._stop()

    # --- used by the generator ------------------------------------------------------------

    def _attach(self, stop: Callable[[], None]) -> None:
        if self.sent:
            raise ValueError("a Progress serves one run: make a new one")
        self._stop = stop
        self.ended = False

    def _on_sent(self) -> None:
        self.sent += 1
        waiters = self._waiters
        while waiters and waiters[0][0] <= self.sent:
            _, _, future = heapq.heappop(waiters)
            if not future.done():
                future.set_result(None)

    def _on_completed(self, ok: bool) -> None:
        self.completed += 1
        if ok:
            self.ok += 1

    def _end_sending(self) -> None:
        self.ended = True
        self._stop = None
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)
