"""Plays a scenario's fault steps against a cluster on the run's clock, each logged as an Event.

Steps on the reserved target `redis` act on the cluster's Redis process (and `pause` on its
commands); they are logged like the others, with `redis` as the target.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from loadtests.chaos.cluster import Cluster, Standby
from loadtests.chaos.scenario import REDIS, FaultStep
from loadtests.ledger import Event, JsonlWriter

# How long past three times the planned run a replacement booted ahead waits to serve.
STANDBY_SLACK_S = 120.0
BOOT_POLL_S = 0.05
# How long a fake backend's graceful stop may take (uvicorn's 1 s grace for the requests it
# is serving, and its exit): a stopped instance comes back this much after its `for:` ends.
STOP_BOUND_S = 1.5


class SentCounter(Protocol):
    """What the timeline needs from the load generator: wait until N requests were sent."""

    def wait_sent(self, count: int) -> Awaitable[None]: ...


class Timeline:
    def __init__(
        self,
        cluster: Cluster,
        steps: list[FaultStep],
        *,
        planned_s: float,
        clock: Callable[[], float],
        events: JsonlWriter,
    ) -> None:
        self.cluster = cluster
        self.steps = steps
        self.planned_s = planned_s
        self.clock = clock  # seconds since the run started (the ledger's clock)
        self.events = events
        self.errors: list[str] = []
        self._standbys: dict[int, Standby] = {}  # by step: `boot_ahead`

    def boot_ahead(self) -> None:
        """Boot now the replacement of each fake backend a step kills or stops for a while
        (`for:`), to serve when that step's `for:` ends (`Cluster.boot_standby`): booted when
        the step is carried out instead, under load, it took 5 to 10 s to serve again on two
        CPUs for a kill of 0.8 s, and longer beside the gateway than in the direct run. The
        runner calls this before the load starts (see `booted`); `run` does if nobody has."""
        if self._standbys:
            return  # booted already (with no step to boot for, looking again finds none)
        # Bounds a replacement's wait to be told to serve: a step may come late on a busy
        # machine, or wait for a request count rather than a time.
        wait_s = 3.0 * self.planned_s + STANDBY_SLACK_S
        for index, step in enumerate(self.steps):
            if (
                step.action in ("kill", "stop")
                and step.target != REDIS
                and step.duration() is not None
                and self.cluster.boots_ahead(step.target)
            ):
                self._standbys[index] = self.cluster.boot_standby(step.target, wait_s)

    async def booted(self, timeout_s: float) -> bool:
        """Wait until every replacement `boot_ahead` started has booted (at most `timeout_s`)."""
        self.boot_ahead()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not all(standby.booted for standby in self._standbys.values()):
            if loop.time() >= end:
                return False
            await asyncio.sleep(BOOT_POLL_S)
        return True

    async def run(self, progress: SentCounter) -> None:
        """Every step, each at its moment; returns when all (and their reverts) are done."""
        self.boot_ahead()
        await asyncio.gather(
            *(self._play(index, step, progress) for index, step in enumerate(self.steps))
        )

    async def _play(self, index: int, step: FaultStep, progress: SentCounter) -> None:
        at = step.when().resolve(self.planned_s)
        if at is None:
            assert step.at_request is not None
            await progress.wait_sent(step.at_request)
        else:
            await asyncio.sleep(max(0.0, at - self.clock()))
        try:
            revert = await self._apply(index, step)
        except Exception as exc:  # a failed action is reported, never fatal to the run
            self.errors.append(f"{step.action} {step.target}: {exc!r}")
            self._log(f"{step.action}-failed", step.target, {"error": repr(exc)})
            return
        duration = step.duration()
        if duration is None or revert is None:
            return
        length = duration.resolve(self.planned_s) or 0.0
        await asyncio.sleep(length)
        try:
            await revert()
        except Exception as exc:
            self.errors.append(f"revert {step.action} {step.target}: {exc!r}")

    async def _apply(self, index: int, step: FaultStep) -> Callable[[], Awaitable[None]] | None:
        """Carry out one step; returns how to undo it (for `for:`)."""
        cluster, name = self.cluster, step.target
        until = self._until(step)
        detail: dict[str, Any] = {"note": step.note} if step.note else {}
        if until is not None:
            detail["until"] = until
        action = step.action
        if name == REDIS:
            return await self._apply_redis(step, detail)
        if action == "set":
            previous = await cluster.set_faults(name, step.set)
            self._log("set", name, {**detail, **step.set})

            async def unset() -> None:
                await cluster.set_faults(name, previous)
                self._log("unset", name, previous)

            return unset
        if action == "network":
            previous = await cluster.set_network(name, step.network)
            self._log("network", name, {**detail, **step.network})

            async def restore_network() -> None:
                await cluster.set_network(name, previous)
                self._log("network", name, previous)

            return restore_network
        if action == "clear":
            await cluster.clear_faults(name)
        elif action == "freeze":
            cluster.signal(name, signal.SIGSTOP)
        elif action == "thaw":
            cluster.signal(name, signal.SIGCONT)
        elif action in ("kill", "stop"):
            await cluster.stop(name, kill=action == "kill")
            standby = self._standbys.get(index)
            if until is not None and standby is not None:
                # Booted ahead, serving at a planned moment: `until`, after a stop's bound on
                # its graceful shutdown (it lasts as long as the streams it waits for, which
                # differs between the two runs).
                back = until + (STOP_BOUND_S if action == "stop" else 0.0)
                self._log(action, name, detail)

                async def serving_again() -> None:
                    await asyncio.sleep(max(0.0, back - self.clock()))
                    await cluster.serve_standby(standby, back)
                    self._log("start", name, {})

                return serving_again
        elif action in ("start", "restart"):
            self._log(action, name, detail)
            await cluster.start(name, self.clock())
            if step.set:
                await cluster.set_faults(name, step.set)
            return None
        self._log(action, name, detail)
        if action == "freeze":

            async def thaw() -> None:
                cluster.signal(name, signal.SIGCONT)
                self._log("thaw", name, {})

            return thaw
        if action in ("kill", "stop"):

            async def start_again() -> None:
                self._log("start", name, {})
                await cluster.start(name, self.clock())

            return start_again
        return None

    async def _apply_redis(
        self, step: FaultStep, detail: dict[str, Any]
    ) -> Callable[[], Awaitable[None]] | None:
        """The same process actions as on an instance, plus `pause`, on the cluster's Redis."""
        cluster, action = self.cluster, step.action
        if action == "pause":
            duration = step.duration()
            seconds = None if duration is None else duration.resolve(self.planned_s)
            if not seconds or seconds <= 0:
                raise ValueError("a pause needs a positive duration")
            await cluster.pause_redis(seconds)
            self._log("pause", REDIS, detail)
            return None  # Redis ends the pause by itself
        if action in ("start", "restart"):
            self._log(action, REDIS, detail)
            await cluster.start_redis(self.clock())
            return None
        if action == "freeze":
            cluster.signal_redis(signal.SIGSTOP)
        elif action == "thaw":
            cluster.signal_redis(signal.SIGCONT)
        elif action in ("kill", "stop"):
            await cluster.stop_redis(kill=action == "kill")
        else:
            raise ValueError(f"action {action!r} does not apply to redis")
        self._log(action, REDIS, detail)
        if action == "freeze":

            async def thaw() -> None:
                cluster.signal_redis(signal.SIGCONT)
                self._log("thaw", REDIS, {})

            return thaw
        if action in ("kill", "stop"):

            async def start_again() -> None:
                self._log("start", REDIS, {})
                await cluster.start_redis(self.clock())

            return start_again
        return None

    def _until(self, step: FaultStep) -> float | None:
        duration = step.duration()
        if duration is None:
            return None
        length = duration.resolve(self.planned_s)
        return None if length is None else round(self.clock() + length, 3)

    def _log(self, action: str, target: str, detail: dict[str, Any]) -> None:
        self.events.write(Event(round(self.clock(), 3), action, target, detail))
