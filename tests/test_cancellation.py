"""Why a request's task was cancelled: each party says why (`Cancellation.cancel`), and each
handler takes back only its own reason (`consume`); a client gone or a drain ends the request
and takes back every cancel at once."""

from __future__ import annotations

import asyncio

import pytest

from gateway.ingress.streams import ended_by_drain
from gateway.runtime import CLIENT_GONE, DEADLINE, DRAIN, Cancellation


async def _waiting() -> tuple[asyncio.Task[None], Cancellation]:
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)  # it waits now
    return task, Cancellation(task)


async def _finish(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_deadline_alone_is_consumed_and_nothing_else() -> None:
    task, cancellation = await _waiting()
    cancellation.cancel(DEADLINE)
    assert not cancellation.consume(CLIENT_GONE)
    assert not cancellation.consume(DRAIN)
    assert cancellation.consume(DEADLINE)
    assert task.cancelling() == 0
    assert not cancellation.consume(DEADLINE)  # once
    await _finish(task)


async def test_a_deadline_is_not_consumed_while_the_client_is_gone_too() -> None:
    task, cancellation = await _waiting()
    cancellation.cancel(DEADLINE)
    cancellation.cancel(CLIENT_GONE)  # the client left before the timeout was handled
    assert task.cancelling() == 2
    assert not cancellation.consume(DEADLINE)  # no retry for a client that is gone
    assert cancellation.consume(CLIENT_GONE)
    assert task.cancelling() == 0  # both taken back where the request ends
    assert not cancellation.pending(DEADLINE)
    await _finish(task)


async def test_the_drain_takes_back_a_deadline_that_came_with_it() -> None:
    task, cancellation = await _waiting()
    cancellation.cancel(DRAIN)
    cancellation.cancel(DEADLINE)
    assert not cancellation.consume(DEADLINE)
    assert cancellation.consume(DRAIN)
    assert task.cancelling() == 0
    await _finish(task)


async def test_the_reason_travels_with_the_error() -> None:
    task, cancellation = await _waiting()
    cancellation.cancel(CLIENT_GONE)
    with pytest.raises(asyncio.CancelledError) as caught:
        await task
    assert caught.value.args == (CLIENT_GONE,)


async def test_a_client_gone_during_a_drain_is_ended_as_a_client_gone() -> None:
    """The drain's deadline and the client's leaving both cancelled a stream: the relay does
    not end it as drained (nobody is there to read the ending), and the request ends where
    a client gone is handled, which takes back both cancels."""
    task, cancellation = await _waiting()
    cancellation.cancel(DRAIN)
    cancellation.cancel(CLIENT_GONE)
    assert ended_by_drain(cancellation) is None
    assert cancellation.consume(CLIENT_GONE)
    assert task.cancelling() == 0
    await _finish(task)
    drained, alone = await _waiting()
    alone.cancel(DRAIN)
    assert ended_by_drain(alone) is not None  # the drain alone: ended as drained
    assert drained.cancelling() == 0
    await _finish(drained)
