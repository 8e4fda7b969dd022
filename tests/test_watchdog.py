"""The watchdog fires deadlines by the time it is given, not by sleeping."""

from __future__ import annotations

import asyncio

import pytest

from gateway.pipeline.watchdog import Watchdog, expired


async def test_sweep_fires_only_past_deadlines_and_names_the_phase() -> None:
    watchdog = Watchdog()
    waiting = asyncio.get_running_loop().create_future()

    async def attempt() -> str:
        deadline = watchdog.arm(task, 10.0, "first_byte")
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
    deadline = watchdog.arm(task, 1.0, "first_byte")
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
        deadline = watchdog.arm(task, 10.0, "idle")
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
