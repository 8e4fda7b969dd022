"""The watchdog fires deadlines by the time it is given, not by sleeping."""

from __future__ import annotations

import asyncio

import pytest

from gateway.runtime import Cancellation
from gateway.upstream.watchdog import INSTANCE_STALL_GRACE, Watchdog, expired


async def test_sweep_fires_only_past_deadlines_and_names_the_phase() -> None:
    watchdog = Watchdog()
    waiting = asyncio.get_running_loop().create_future()

    async def attempt() -> str:
        deadline = watchdog.arm(Cancellation(task), 10.0, "first_byte")
        try:
            await waiting
        except asyncio.CancelledError:
            if expired(deadline):
                return f"timed out in {deadline.phase}"
            raise
        return "answered"

    task = asyncio.get_running_loop().create_task(attempt())
    await asyncio.sleep(0)  # let it arm
    assert watchdog.sweep(now=9.99) == 0
    assert watchdog.sweep(now=10.0) == 1
    assert await task == "timed out in first_byte"
    assert not task.cancelled() and task.cancelling() == 0  # the cancel was consumed


async def test_moved_deadline_and_disarm() -> None:
    watchdog = Watchdog()
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    deadline = watchdog.arm(Cancellation(task), 1.0, "first_byte")
    deadline.move(5.0, "idle")
    assert watchdog.sweep(now=2.0) == 0
    watchdog.disarm(deadline)
    assert watchdog.sweep(now=100.0) == 0
    assert not task.cancelled()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancel_from_elsewhere_is_not_taken_for_a_timeout() -> None:
    watchdog = Watchdog()
    started = asyncio.Event()

    async def attempt() -> None:
        deadline = watchdog.arm(Cancellation(task), 10.0, "idle")
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            assert not expired(deadline)
            raise

    task = asyncio.get_running_loop().create_task(attempt())
    await started.wait()
    task.cancel()  # e.g. the client disconnected
    with pytest.raises(asyncio.CancelledError):
        await task


class _Instance:
    """What the watchdog reads of an instance's prefill holds."""

    def __init__(self) -> None:
        self.holds = 0
        self.hold_until = 0.0
        self.hold_started_at = -1.0
        self.hold_released_at = -1.0
        self.progress_at = -1.0
        self.in_flight = 1
        self.idle_stretch = 1.0


async def test_an_idle_deadline_waits_out_a_prefill_the_gateway_sent() -> None:
    watchdog = Watchdog(tick_s=0.025)
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    instance = _Instance()
    deadline = watchdog.arm(Cancellation(task), 0.0, "first_byte", instance)
    deadline.move(1.0, "idle")
    deadline.idle_s = 0.3
    deadline.waiting_since = 0.7
    instance.progress_at = 5.5  # the prompt's first byte: the instance as a whole is not stalled
    # A long prompt went to the same instance: it should be prefilled by t=5.6.
    instance.holds, instance.hold_until = 1, 5.6
    assert watchdog.sweep(now=1.0) == 0 and deadline.at == 5.6
    assert watchdog.sweep(now=5.0) == 0
    # Its first byte came at t=5.5: the stream gets a whole idle timeout from there.
    instance.holds, instance.hold_until, instance.hold_released_at = 0, 0.0, 5.5
    assert watchdog.sweep(now=5.6) == 0 and deadline.at == pytest.approx(5.8)
    assert watchdog.sweep(now=5.8) == 1
    assert task.cancelling() == 1
    task.uncancel()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_hold_delays_neither_its_own_prompt_nor_other_instances() -> None:
    watchdog = Watchdog(tick_s=0.025)
    loop = asyncio.get_running_loop()
    held = _Instance()
    held.holds, held.hold_until = 1, 100.0
    own = watchdog.arm(Cancellation(loop.create_task(asyncio.sleep(3600))), 1.0, "first_byte", held)
    own.holding = True  # the long prompt itself: its deadline already counts its prefill
    other = _Instance()
    idle = watchdog.arm(Cancellation(loop.create_task(asyncio.sleep(3600))), 1.0, "idle", other)
    idle.idle_s = 0.3
    idle.waiting_since = 0.7
    other.progress_at = 0.9  # its other streams went on: this one alone stalled
    assert watchdog.sweep(now=1.0) == 2
    for deadline in (own, idle):
        deadline.cancellation.task.uncancel()
        deadline.cancellation.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await deadline.cancellation.task


async def test_a_first_byte_wait_is_credited_the_prefill_it_waited_behind() -> None:
    watchdog = Watchdog(tick_s=0.025)
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    instance = _Instance()
    # Sent at t=1 with 2 s for its first byte; a long prompt went there at t=1.5.
    deadline = watchdog.arm(Cancellation(task), 3.0, "first_byte", instance, since=1.0)
    instance.holds, instance.hold_until, instance.hold_started_at = 1, 9.0, 1.5
    assert watchdog.sweep(now=3.0) == 0
    assert watchdog.sweep(now=5.0) == 0
    # Prefilled by t=5.5: its four seconds are added to the deadline, once.
    instance.holds, instance.hold_released_at = 0, 5.5
    assert watchdog.sweep(now=5.6) == 0 and deadline.at == pytest.approx(7.0)
    assert watchdog.sweep(now=6.9) == 0
    assert watchdog.sweep(now=7.0) == 1
    task.uncancel()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_stall_the_whole_instance_shares_gets_a_longer_grace() -> None:
    watchdog = Watchdog(tick_s=0.025)
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    instance = _Instance()
    instance.progress_at = 0.7  # the last byte it sent was this stream's own
    instance.in_flight = 4  # while it had other attempts to serve
    deadline = watchdog.arm(Cancellation(task), 0.0, "first_byte", instance)
    deadline.move(1.0, "idle")
    deadline.idle_s, deadline.waiting_since = 0.3, 0.7
    grace = 0.7 + INSTANCE_STALL_GRACE * 0.3
    assert watchdog.sweep(now=1.0) == 0 and deadline.at == pytest.approx(grace)
    assert watchdog.sweep(now=grace - 0.01) == 0
    assert watchdog.sweep(now=grace) == 1  # a frozen instance is still given up on
    # A stream with the instance to itself gets no grace: its stall is its own.
    alone = _Instance()
    alone.progress_at = 0.7
    lone = watchdog.arm(
        Cancellation(asyncio.get_running_loop().create_task(asyncio.sleep(3600))),
        0.0,
        "idle",
        alone,
    )
    lone.move(1.0, "idle")
    lone.idle_s, lone.waiting_since = 0.3, 0.7
    assert watchdog.sweep(now=1.0) == 1
    lone.cancellation.task.uncancel()
    lone.cancellation.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await lone.cancellation.task
    task.uncancel()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cut_on_the_instance_backs_off_the_waits_already_running() -> None:
    watchdog = Watchdog(tick_s=0.025)
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    instance = _Instance()
    instance.progress_at = 0.95  # its other streams go on, slowly
    deadline = watchdog.arm(Cancellation(task), 0.0, "first_byte", instance)
    deadline.move(1.0, "idle")
    deadline.idle_s, deadline.waiting_since = 0.3, 0.7
    instance.idle_stretch = 4.0  # two of its streams were cut: it turned slower
    assert watchdog.sweep(now=1.0) == 0 and deadline.at == pytest.approx(0.7 + 1.2)
    assert watchdog.sweep(now=1.9) == 1
    task.uncancel()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class _Engine:
    """A holder with no prompt being prefilled (`Holder`)."""

    holds = 0
    hold_until = 0.0
    hold_started_at = -1.0
    hold_released_at = -1.0
    progress_at = 0.0
    in_flight = 6
    idle_stretch = 1.0


async def test_a_first_byte_wait_lasts_as_long_as_its_patience_says() -> None:
    """Queued is not stalled: a first-byte wait that ran out asks its patience, which may keep it
    waiting (each time until the time it names) and fires once that says no more."""
    watchdog = Watchdog()
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    deadline = watchdog.arm(Cancellation(task), 1.0, "first_byte", _Engine(), since=0.0)
    asked: list[float] = []

    def patience(now: float) -> float | None:
        asked.append(now)
        return now + 0.25 if now < 2.0 else None

    deadline.patience = patience
    assert watchdog.sweep(now=0.9) == 0 and asked == []  # not due: not asked
    assert watchdog.sweep(now=1.0) == 0 and deadline.at == 1.25
    assert watchdog.sweep(now=1.1) == 0 and asked == [1.0]  # not due again yet
    assert watchdog.sweep(now=1.9) == 0 and deadline.at == 2.15
    assert watchdog.sweep(now=2.2) == 1
    assert asked == [1.0, 1.9, 2.2]
    with pytest.raises(asyncio.CancelledError):
        await task
    assert expired(deadline) and deadline.phase == "first_byte"


async def test_a_first_byte_limit_ends_the_wait_whatever_its_patience_says() -> None:
    """A limit on the first byte (`timeouts.first_token_max`, `limit_at`): patience that would
    keep the attempt waiting on is held to it, and the deadline fires there."""
    watchdog = Watchdog()
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    deadline = watchdog.arm(Cancellation(task), 1.0, "first_byte", _Engine(), since=0.0)
    deadline.patience = lambda now: now + 0.25
    deadline.limit_at = 1.6
    assert watchdog.sweep(now=1.0) == 0 and deadline.at == 1.25
    assert watchdog.sweep(now=1.5) == 0 and deadline.at == 1.6  # not 1.75: the limit's
    assert watchdog.sweep(now=1.6) == 1
    with pytest.raises(asyncio.CancelledError):
        await task
    assert expired(deadline) and deadline.at == deadline.limit_at


async def test_patience_is_not_asked_past_the_first_byte() -> None:
    watchdog = Watchdog()
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    deadline = watchdog.arm(Cancellation(task), 1.0, "first_byte", _Engine(), since=0.0)
    deadline.patience = lambda now: now + 10.0
    deadline.move(2.0, "total")
    assert watchdog.sweep(now=2.0) == 1
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_tick_fires_only_what_had_expired_by_the_tick_before() -> None:
    # The loop was held from 9.0 to 10.5 (a pause of the process): the upstream's answer,
    # sent at 9.5, waits in the socket. The tick that runs after the pause must not cut the
    # attempt before the loop has read it; the next one fires what is still late then.
    watchdog = Watchdog(tick_s=0.025)
    answered = asyncio.Event()

    async def attempt() -> str:
        deadline = watchdog.arm(Cancellation(task), 10.0, "first_byte")
        try:
            await answered.wait()
        except asyncio.CancelledError:
            if expired(deadline):
                return "timed out"
            raise
        deadline.move(20.0, "idle")  # the relay goes on with its next wait
        return "answered"

    task = asyncio.get_running_loop().create_task(attempt())
    await asyncio.sleep(0)  # let it arm
    assert watchdog.tick(9.0) == 0
    assert watchdog.tick(10.5) == 0  # expired after the last tick: the loop reads first
    answered.set()  # what the socket held, read in the loop's turn before the next tick
    assert await task == "answered"
    assert watchdog.tick(10.525) == 0


async def test_a_deadline_still_late_at_the_next_tick_fires_there() -> None:
    watchdog = Watchdog(tick_s=0.025)
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    watchdog.arm(Cancellation(task), 10.0, "first_byte")
    assert watchdog.tick(9.99) == 0
    assert watchdog.tick(10.01) == 0
    assert watchdog.tick(10.035) == 1
    with pytest.raises(asyncio.CancelledError):
        await task
