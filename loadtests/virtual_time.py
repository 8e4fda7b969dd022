"""An event loop on virtual time: its clock moves only when nothing is ready to run, and then
straight to the next timer. Sleeps, timeouts and the watchdog's sweeps take no wall-clock
time, and a run is the same on a loaded machine as on an idle one: tests assert the order
and the virtual times of events, never how long they took for real."""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class WouldHang(RuntimeError):
    """Nothing is ready and no timer is set: a real loop would wait forever."""


class _InstantSelector(selectors.DefaultSelector):
    """Looks for I/O without waiting; where a real loop would wait for the next timer, moves
    the virtual clock to it. With nothing to run and no timer set, waits `patience_s` of real
    time for I/O (a thread's result reaches the loop that way) before it calls it a hang."""

    def __init__(self, loop: VirtualTimeLoop, patience_s: float) -> None:
        super().__init__()
        self._loop = loop
        self._patience_s = patience_s

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            ready = super().select(self._patience_s) if self._patience_s > 0 else []
            if ready:
                return ready
            raise WouldHang("nothing to run and no timer set: the code under test would hang")
        self._loop.advance(timeout)
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """`patience_s`: how long, in real time, to wait for a thread's result (or other I/O) when
    nothing else could ever happen; 0: a hang is reported at once."""

    def __init__(self, patience_s: float = 0.0) -> None:
        self._now = 0.0
        super().__init__(selector=_InstantSelector(self, patience_s))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds


def run(coroutine: Any) -> Any:
    """Run `coroutine` to its end on a fresh virtual-time loop."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coroutine)
