"""A simulated vLLM engine: a bounded batch, a FIFO of waiting requests and a KV-cache budget.

It models the three things a real vLLM does under overload, so a benchmark can drive the fake
past its capacity: at most `max_running` requests generate at once (vLLM's `max_num_seqs`) and
the rest wait in arrival order; a request that starts while the KV cache cannot hold it fails as
vLLM does on a GPU out-of-memory error; and decoding slows down as the batch grows.

`submit` and `finish` are synchronous, so the state changes at a definite point (tests can drive
them step by step); `run` wraps them for a request handler. Waiting costs no polling: a waiting
request awaits a future that `finish` resolves when it hands the freed place on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from .waiters import CountWaiters

# A slot's life: QUEUED -> RUNNING -> DONE, or QUEUED -> FAILED (no room in the KV cache), or
# QUEUED -> DONE when its request leaves before it ran.
QUEUED = "queued"
RUNNING = "running"
FAILED = "failed"
DONE = "done"

# The batch size `batch_slowdown` is relative to when `max_running` is unlimited.
UNLIMITED_BATCH = 16


class EngineOOM(Exception):
    """The request did not fit in the KV cache when it was about to start."""


class Slot:
    """One request's place in the engine."""

    __slots__ = ("factor", "failure", "need", "started", "state")

    def __init__(self, need: int) -> None:
        self.need = need
        self.state = QUEUED
        # The per-token time multiplier, fixed when the request starts.
        self.factor = 1.0
        self.failure = ""  # why it could not start (FAILED), for the OOM message
        # Resolved when the slot leaves the queue (to run or to fail); `state` says which.
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class Engine:
    """One engine per fake process, shared by every model it serves. 0 means unlimited."""

    def __init__(
        self,
        max_running: int = 0,
        kv_tokens: int = 0,
        batch_slowdown: float = 0.0,
        oom_above: int = 0,
    ) -> None:
        self.max_running = max_running
        self.kv_tokens = kv_tokens
        # An engine with no batch bound of its own that runs out of GPU memory past this many
        # requests at once: the one that would start beyond it fails (0: never).
        self.oom_above = oom_above
        self.batch_slowdown = batch_slowdown
        self.running = 0
        self.kv_used = 0
        self.ooms = 0  # cumulative; with the peaks, the counters `reset` clears
        # The most requests running, and waiting, at once (what a client put on the engine).
        self.peak_running = 0
        self.peak_waiting = 0
        self._queue: deque[Slot] = deque()
        # (waiting count to reach, future to resolve), for `wait_waiting`.
        self._waiters = CountWaiters()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def cache_usage(self) -> float | None:
        """KV-cache usage 0..1, or None when the cache is unlimited."""
        return self.kv_used / self.kv_tokens if self.kv_tokens > 0 else None

    def slowdown(self, running: int) -> float:
        """The per-token time multiplier of a request starting as the `running`-th in the batch
        (a full batch: `max_running`, else `oom_above`, else `UNLIMITED_BATCH`)."""
        full = self.max_running or self.oom_above or UNLIMITED_BATCH
        return 1.0 + self.batch_slowdown * running / full

    def submit(self, need: int) -> Slot:
        """Start a request needing `need` KV tokens now if there is room, else queue it."""
        slot = Slot(need)
        # Only an empty queue lets a newcomer start: those already waiting go first.
        if not self._queue and self._has_room():
            self._start(slot)
        else:
            self._queue.append(slot)
            self.peak_waiting = max(self.peak_waiting, len(self._queue))
            self._wake()
        return slot

    async def wait_started(self, slot: Slot) -> float:
        """Wait for `slot` to start; its per-token multiplier, or EngineOOM if it failed."""
        await slot.started
        if slot.state == FAILED:
            raise EngineOOM(slot.failure)
        return slot.factor

    def finish(self, slot: Slot) -> None:
        """Give back what `slot` holds, whatever its state; the freed place goes to the queue."""
        if slot.state == RUNNING:
            self.running -= 1
            self.kv_used -= slot.need
            self._admit()
        elif slot.state == QUEUED:
            # Its request left while waiting (the owner's task was cancelled).
            self._queue.remove(slot)
        slot.state = DONE

    @contextlib.asynccontextmanager
    async def run(self, need: int) -> AsyncIterator[float]:
        """Hold a place in the engine for a block; yields the per-token multiplier.

        Raises EngineOOM when the request does not fit as it starts. The place is given back
        however the block ends, including when the request is cancelled while it waits.
        """
        slot = self.submit(need)
        try:
            yield await self.wait_started(slot)
        finally:
            self.finish(slot)

    def reset(self) -> None:
        """Clear cumulative counters; requests in flight keep their places."""
        self.ooms = 0
        self.peak_running = self.running
        self.peak_waiting = self.waiting

    async def wait_waiting(self, count: int, timeout_s: float) -> bool:
        """Wait until at least `count` requests are queued; False if `timeout_s` passed first."""
        return await self._waiters.wait(count, self.waiting, timeout_s)

    def _has_room(self) -> bool:
        return self.max_running <= 0 or self.running < self.max_running

    def _start(self, slot: Slot) -> None:
        # As vLLM on a GPU out-of-memory error: the request fails rather than waits for room.
        if self.kv_tokens > 0 and self.kv_used + slot.need > self.kv_tokens:
            slot.failure = f"needed {slot.need} of {self.kv_tokens} KV tokens"
        elif self.oom_above > 0 and self.running >= self.oom_above:
            slot.failure = f"{self.running} requests already running"
        if slot.failure:
            slot.state = FAILED
            self.ooms += 1
        else:
            slot.state = RUNNING
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            self.kv_used += slot.need
            slot.factor = self.slowdown(self.running)
        slot.started.set_result(None)

    def _admit(self) -> None:
        while self._queue and self._has_room():
            slot = self._queue.popleft()
            if slot.started.cancelled():
                slot.state = DONE  # its owner was cancelled and has not run `finish` yet
                continue
            self._start(slot)

    def _wake(self) -> None:
        self._waiters.wake(self.waiting)
