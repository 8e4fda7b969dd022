"""What an instance's engine says of its own load, read from its gauges, and the room it gives.

Owned by one `InstanceState` (its `engine`): only `gateway.upstream.vllm_load`'s reads change
it, through the instance's methods, and only this module assigns its fields.
"""

from __future__ import annotations

from gateway.core.vllm_metrics import EngineLoad

# What an engine whose gauges are read is given before it has shown what it runs, and how much
# more than the most it was seen running until it has been seen queueing (a read every 500 ms:
# from 16 to 1024 in 1.5 s).
ENGINE_START = 16
SLOW_START_GROWTH = 4


class EnginePacing:
    """An engine's gauges as last read, and what they have shown it runs."""

    __slots__ = ("batch", "cache_usage", "gauges", "paced", "peak", "saturated", "slots", "waiting")

    def __init__(self) -> None:
        # Its own queue and KV-cache use (None: not read, or the last read failed), and their
        # verdict.
        self.waiting: float | None = None
        self.cache_usage: float | None = None
        self.saturated = False
        # While saturated, the attempts it may have in flight: what it had at the read less
        # the requests beyond the engine's room, at least one (so a queue that other clients
        # keep full still lets this gateway's requests through, as they would go directly).
        self.slots = 1
        # The most requests it was seen running at once, and the same counted from the first
        # read that found requests waiting there (0: none yet): its batch, as far as it has
        # shown.
        self.peak = 0
        self.batch = 0
        # Whether it exports load gauges (None: not read yet, or the read failed).
        self.gauges: bool | None = None
        # Paced by its gauges (`limit`): since a read found them, until one finds none. A read
        # that fails changes nothing: a faulty network is no reason to fall back to a limit
        # learned from the same faults.
        self.paced = False

    def limit(self) -> int:
        """The attempts it may have in flight while paced: its batch plus a quarter (at least
        2) once it has queued, else `SLOW_START_GROWTH` times the most it was seen running (at
        least `ENGINE_START`), as a slow start does (`InstanceState.room` says why)."""
        batch = self.batch
        if batch:
            return batch + max(2, -(-batch // 4))
        return max(ENGINE_START, SLOW_START_GROWTH * self.peak)

    def found(self, gauges: bool) -> None:
        """A read of its page found load gauges, or none (not an engine the gateway can read:
        nothing caps it by them any more)."""
        if not gauges:
            self.batch = self.peak = 0
        self.gauges = self.paced = gauges

    def unread(self) -> None:
        """A read of its page failed: its pacing stays as it was."""
        self.gauges = None

    def read(self, load: EngineLoad, saturated: bool, max_waiting: float, in_flight: int) -> bool:
        """What a read says it runs and queues (`saturated`: the verdict on that), with
        `in_flight` of this gateway's attempts there; True when it just stopped being
        saturated."""
        waiting, running = load.waiting, load.running
        if running:
            self.peak = max(self.peak, int(running))
            if waiting or self.batch:
                self.batch = max(self.batch, int(running))
        was = self.saturated
        self.waiting = waiting
        self.cache_usage = load.cache_usage
        self.saturated = saturated
        if saturated:
            # The requests beyond the engine's room, this gateway's share of them (other
            # replicas and clients have theirs in its queue too).
            excess = max(0.0, (waiting or 0.0) - max_waiting)
            queued = (running or 0.0) + (waiting or 0.0)
            if queued > 0:
                excess *= min(1.0, in_flight / queued)
            self.slots = max(1, in_flight - round(excess))
        return was and not saturated

    def forget(self) -> None:
        """Nobody reads its gauges any more (a reload turned the reads off)."""
        self.saturated = False
        self.waiting = self.cache_usage = self.gauges = None
        self.batch = self.peak = 0
        self.paced = False
