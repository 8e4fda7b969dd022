"""The SSE streams a data plane is relaying, so a graceful shutdown can end them properly
(`gateway.drain`)."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.errors import ShuttingDown, shutting_down


class OpenStreams:
    """The SSE streams being relayed (their tasks), so the drain can end them properly.

    A stream registers when its relay starts and leaves when it ends: one set operation each.
    """

    __slots__ = ("_ended", "_tasks", "ending")

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ended: set[asyncio.Task[Any]] = set()
        self.ending = False  # past the drain's deadline: a stream starting now ends at once

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)

    def discard(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)

    def end_all(self) -> int:
        """Cancel every open stream's task; its relay ends it with `ended_by_drain`."""
        self.ending = True
        tasks = list(self._tasks)
        for task in tasks:
            self._ended.add(task)
            task.cancel()
        return len(tasks)

    def ended_by_drain(self, task: asyncio.Task[Any]) -> ShuttingDown | None:
        """After a CancelledError in a relay: the error to end the stream with, if the drain's
        deadline caused it (the cancel is then consumed)."""
        if task not in self._ended:
            return None
        self._ended.discard(task)
        task.uncancel()
        return shutting_down()
