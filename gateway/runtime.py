"""The event loop's services every layer shares: its clock, why a request's task is cancelled,
and how background tasks end.

Several parties may cancel a request's task while it waits: the watchdog when an attempt's
deadline passes (`DEADLINE`), a hedged attempt that answered first (`SUPERSEDED`), the data
plane when the client disconnects (`CLIENT_GONE`), and the drain when its deadline ends the
open streams (`DRAIN`). Each says why
through the request's `Cancellation`, and the code that catches the CancelledError asks it
whether the reason it handles is the one (`consume`), so no place guesses from flags of the
others.

A deadline (or a hedge) only ends the attempt (the retry layer may go on); a client gone or a
drain ends the request. So an attempt's reason is consumed only when nothing else is pending:
when the client left (or the drain came) meanwhile, the CancelledError goes on up to where that
is handled, which takes back every cancel at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal

# Event-loop time (seconds, monotonic): the one clock of the request path, handed to every
# layer by the composition (`gateway.request_path`), so a test can run them all on another.
Clock = Callable[[], float]

CancelReason = Literal["deadline", "superseded", "client_gone", "drain"]
DEADLINE: Final = "deadline"
# A hedged attempt answered first: the attempt still waiting is given up (`pipeline.hedge`).
SUPERSEDED: Final = "superseded"
CLIENT_GONE: Final = "client_gone"
DRAIN: Final = "drain"
# Reasons that end one attempt; the others end the request.
_ATTEMPT_REASONS: Final = frozenset((DEADLINE, SUPERSEDED))


class Cancellation:
    """The reasons a task was cancelled for, not yet handled (one per `cancel`)."""

    __slots__ = ("_pending", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self._pending: list[CancelReason] = []

    def cancel(self, reason: CancelReason) -> None:
        self._pending.append(reason)
        self.task.cancel(reason)

    def pending(self, reason: CancelReason) -> bool:
        return reason in self._pending

    def consume(self, reason: CancelReason) -> bool:
        """After a CancelledError: True if `reason` is what it stands for, and the cancel is
        then taken back (for a client gone or a drain: every cancel still pending, the
        request ends here). False: not this reason's to handle; let the error go on. A client
        gone outranks a drain: nobody is left to read a drained stream's ending, and the
        request ends where a client gone is handled (its access line says so, and the answer
        it did not take whole counts no usage)."""
        pending = self._pending
        if reason not in pending or (reason == DRAIN and CLIENT_GONE in pending):
            return False
        if reason in _ATTEMPT_REASONS:
            if any(other not in _ATTEMPT_REASONS for other in pending):
                return False  # the request itself is ending: its handler takes them all
            pending.remove(reason)
            self.task.uncancel()
            return True
        for _ in pending:
            self.task.uncancel()
        pending.clear()
        return True


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Background tasks' end: cancelled and awaited, so none outlives the gateway."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
