"""Coarse deadlines for many requests, enforced by one periodic task.

A timer per request, and aiohttp's read timeout re-armed on every chunk, cost more than relaying
the chunk itself. Instead each attempt holds a `Deadline` whose `at` it moves as it progresses
(an attribute write), and one sweep every `tick_s` cancels the tasks whose deadline has passed.
The owner turns that cancellation into an `UpstreamTimeout` for the phase that ran out.

A sweep fires only the deadlines that had passed by the sweep before it (`Watchdog.tick`), so
deadlines fire up to two ticks late; LLM timeouts are hundreds of milliseconds and up. Between
two sweeps the event loop always reads its sockets once, so what an upstream sent before a
deadline ran out has reached its attempt by then. A gateway process that falls behind (CPU
taken by its neighbours or throttled by its cgroup quota, a long garbage collection) would
otherwise wake its sweep after the pause and before reading what arrived meanwhile: every
attempt waiting then would be cut at once, and the instances behind them taken for stalled.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Protocol

from gateway.core.outcome import Phase
from gateway.runtime import DEADLINE, Cancellation, cancel_and_wait

# A stall that the whole instance shares (none of its streams got a byte since this one's wait
# began) is the engine pausing, not this stream failing: a prefill, a long batch step, a CPU
# taken by something else. It may last this many idle timeouts before the stream is cut.
INSTANCE_STALL_GRACE = 8.0


class Holder(Protocol):
    """The instance an attempt runs on, as far as its pauses go (see `InstanceState`): `holds`
    prompts in flight whose prefill will pause everything on it, the latest time they should
    be done by, when the first of the current ones was sent and when the last one was done,
    when it last sent a byte on any attempt, and how many attempts it has in flight."""

    holds: int
    hold_until: float
    hold_started_at: float
    hold_released_at: float
    progress_at: float
    in_flight: int

    @property
    def idle_stretch(self) -> float:
        """How far its streams' idle timeouts are backed off now (1: not at all)."""
        ...


class Deadline:
    __slots__ = (
        "at",
        "base_at",
        "cancellation",
        "credit_s",
        "fired",
        "holder",
        "holding",
        "idle_s",
        "limit_at",
        "patience",
        "phase",
        "waiting_since",
    )

    def __init__(
        self,
        cancellation: Cancellation,
        at: float,
        phase: Phase,
        holder: Holder | None = None,
        since: float = 0.0,
    ) -> None:
        self.cancellation = cancellation  # of the request whose attempt this bounds
        self.at = at  # event-loop time; moved forward by the owner as the attempt progresses
        self.base_at = at  # where the owner put it, before any pause of its instance
        self.credit_s = 0.0  # pauses of its instance credited to its first-byte wait
        self.phase = phase  # what the attempt is waiting for now
        self.fired = False
        self.holder = holder
        self.holding = False  # its own prompt is one of the holder's holds
        self.idle_s = 0.0  # the idle timeout, while phase is "idle"
        self.waiting_since = since  # since when it waits for its first byte or next chunk
        # Asked when a first-byte wait runs out: until when the attempt should wait on all the
        # same (queued behind an engine that works, nowhere better to go), or None.
        self.patience: Callable[[float], float | None] | None = None
        # When a limit on the first byte (`timeouts.first_token_max`) runs out: the first-byte
        # wait ends then, whatever its instance's pauses and its patience say.
        self.limit_at = math.inf

    def move(self, at: float, phase: Phase) -> None:
        self.at = self.base_at = at
        self.phase = phase

    def held_until(self, now: float, tick_s: float) -> float:
        """When an expired deadline may really fire, given the pauses of its instance.

        Waiting for a first byte: not while a prompt sent to the same instance is being
        prefilled (the engine runs nothing else meanwhile), and later by as long as such
        prefills took during this wait (unless its own prompt is the one being prefilled: its
        deadline already counts that); and then not before what its `patience` says (queued is
        not stalled: the owner's rule, asked again each time it comes due). Never past its
        `limit_at` (`timeouts.first_token_max`), whatever those say.

        Waiting for the next chunk of a stream: not before its idle timeout times the instance's
        current `idle_stretch` (backed off after cuts of its other streams), not while such a
        prompt is being prefilled,
        not before a whole idle timeout after the last one got its first byte, and not before
        `INSTANCE_STALL_GRACE` idle timeouts while the instance, busy with other attempts, has
        sent nothing on any of them for half an idle timeout or more (a stall of every stream
        is the engine's pause; one stream stalling while the others go on is that stream's
        failure, and so is the stall of a stream that has the instance to itself).
        """
        at = self.at
        holder = self.holder
        if holder is None:
            return at
        phase = self.phase
        if phase == Phase.FIRST_BYTE:
            held = self._first_byte_held(now, tick_s, holder)
            limit = self.limit_at
            return held if held < limit else limit
        if phase != Phase.IDLE:
            return at
        if holder.holds > 0:
            at = max(at, holder.hold_until, now + tick_s)
        idle_s = self.idle_s
        stretch = holder.idle_stretch
        if stretch > 1.0:
            # Streams on the instance were cut since this wait began: it turned slower, and
            # the waits already running get the backed-off timeout too.
            at = max(at, self.waiting_since + idle_s * stretch)
        at = max(at, holder.hold_released_at + idle_s)
        quiet_since = max(holder.progress_at, self.waiting_since)
        if holder.in_flight > 1 and now - quiet_since >= idle_s / 2:
            # The instance has been quiet on every attempt for a while, not just on this one.
            at = max(at, quiet_since + INSTANCE_STALL_GRACE * idle_s)
        return at

    def _first_byte_held(self, now: float, tick_s: float, holder: Holder) -> float:
        """`held_until` of a first-byte wait, before its limit: the pauses of its instance
        credited, then its patience asked."""
        if self.holding:
            return self.at
        released = holder.hold_released_at
        paused = released - max(holder.hold_started_at, self.waiting_since)
        if paused > 0:
            self.credit_s += paused
            self.waiting_since = released  # each pause is credited once
        due = self.base_at + self.credit_s
        if holder.holds > 0:
            return max(due, now + tick_s)
        patience = self.patience
        if due <= now and patience is not None:
            return patience(now) or due
        return due


class Watchdog:
    def __init__(self, tick_s: float = 0.025) -> None:
        self._tick_s = tick_s
        self._live: set[Deadline] = set()
        self._task: asyncio.Task[None] | None = None
        self._armed = asyncio.Event()  # lets an idle process sleep instead of ticking
        # When the last tick ran: what had expired by then is what the next tick fires.
        self._ticked_at = -math.inf

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sweep())

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    def arm(
        self,
        cancellation: Cancellation,
        at: float,
        phase: Phase,
        holder: Holder | None = None,
        since: float = 0.0,
    ) -> Deadline:
        deadline = Deadline(cancellation, at, phase, holder, since)
        if not self._live:
            self._armed.set()
        self._live.add(deadline)
        return deadline

    def disarm(self, deadline: Deadline) -> None:
        self._live.discard(deadline)

    def rebind(self, deadline: Deadline, cancellation: Cancellation, until: float) -> None:
        """The attempt goes on for another task (a hedge that won): its deadline cancels that
        one from now on. If it fired for the task it leaves (its first byte came just in
        time), it is live again, bounding the rest by `until` (the request's deadline) until
        the relay moves it."""
        deadline.cancellation = cancellation
        if deadline.fired:
            deadline.fired = False
            deadline.move(until, Phase.TOTAL)
            if not self._live:
                self._armed.set()
            self._live.add(deadline)

    def sweep(self, now: float) -> int:
        """Cancel the task of every deadline past `now`; returns how many fired."""
        expired = [d for d in self._live if d.at <= now]
        fired = 0
        for deadline in expired:
            held = deadline.held_until(now, self._tick_s)
            if held > now:
                deadline.at = held  # a prefill pause the gateway saw coming: wait it out
                continue
            fired += 1
            self._live.discard(deadline)
            deadline.fired = True
            deadline.cancellation.cancel(DEADLINE)
        return fired

    def tick(self, now: float) -> int:
        """One periodic sweep at `now`: fires the deadlines that had passed at the previous
        tick (see the module's docstring); returns how many fired."""
        fired = self.sweep(self._ticked_at)
        self._ticked_at = now
        return fired

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._live:
                self._armed.clear()
                await self._armed.wait()
                self._ticked_at = loop.time()  # nothing was live to expire while it slept
            await asyncio.sleep(self._tick_s)
            self.tick(loop.time())


def expired(deadline: Deadline) -> bool:
    """After a CancelledError: True if this deadline caused it (the cancel is then consumed;
    not while the request itself is ending: see `gateway.runtime`)."""
    if deadline.fired and deadline.cancellation.consume(DEADLINE):
        deadline.fired = False
        return True
    return False
