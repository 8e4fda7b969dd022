"""A first-byte timeout counts against its instance unless the attempt waited in the instance's
queue while the instance worked: sent to an instance already serving all it was seen to serve
at once, or timed out while it is that full. An instance that had room, or that sent nothing
meanwhile, is blamed.

Driven through the accounting layer (`Account`) with a clock of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.core.outcome import Phase
from gateway.errors import UpstreamTimeout
from gateway.pipeline.account import Account
from gateway.pipeline.call import Call
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from tests.test_lost_races import Clock, setting, streamed_call

SLOTS = 2


async def time_out(
    account: Account,
    pool: PoolState,
    instance: InstanceState,
    clock: Clock,
    meanwhile: Callable[[float], None],
) -> None:
    """One attempt on `instance` that waits 5 s for a first byte (while `meanwhile` happens,
    given when it was sent) and times out."""
    sent = asyncio.Event()
    waited = asyncio.Event()

    async def handler(call: Call) -> object:
        sent.set()
        await waited.wait()
        raise UpstreamTimeout("the upstream timed out (first_byte)", phase=Phase.FIRST_BYTE)

    async def attempt() -> None:
        call = streamed_call(pool, instance, clock)
        await account(call, handler)  # type: ignore[arg-type]

    task = asyncio.create_task(attempt())
    await sent.wait()
    meanwhile(clock.now)
    clock.now += 5.0
    waited.set()
    with pytest.raises(UpstreamTimeout):
        await task


def busy(instance: InstanceState, clock: Clock) -> None:
    """It has served SLOTS streams at once, and one of them runs now."""
    instance.capacity_seen = SLOTS
    instance.attempt_started(0)
    instance.stream_started()


async def test_an_attempt_with_room_all_along_is_blamed() -> None:
    account, pool, a, clock = setting()
    busy(a, clock)

    def stream_goes_on(at: float) -> None:
        a.progressed(at + 3.0)
        a.attempt_ended(0)
        a.stream_ended()

    await time_out(account, pool, a, clock, stream_goes_on)
    assert a.stats.timeouts == {("first_byte", True): 1}
    assert a.failures == 1


async def test_a_full_instance_that_kept_working_is_not_blamed() -> None:
    account, pool, a, clock = setting()
    busy(a, clock)

    def full_and_working(at: float) -> None:
        a.attempt_started(0)  # full from now on
        a.progressed(at + 3.0)

    await time_out(account, pool, a, clock, full_and_working)
    assert a.stats.timeouts == {("first_byte", False): 1}
    assert a.failures == 0


async def test_a_full_instance_that_went_silent_is_blamed() -> None:
    account, pool, a, clock = setting()
    busy(a, clock)

    def filled_then_silent(at: float) -> None:
        a.attempt_started(0)  # full, and nothing comes from it any more
        a.attempt_ended(0)
        a.attempt_ended(0)
        a.stream_ended()

    await time_out(account, pool, a, clock, filled_then_silent)
    assert a.stats.timeouts == {("first_byte", True): 1}
    assert a.failures == 1
