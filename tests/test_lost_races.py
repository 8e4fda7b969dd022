"""Hedges an instance loses count against it only while it answers nothing: an instance that
loses `breaker.consecutive_timeouts` races in a row with no answer in between is not
answering, and each further loss is its first-byte timeout. A busy engine whose slots are held
by long streams answers new requests seldom and ends none of its streams for a while: the
attempts it keeps queued lose their races to hedges, for the queue and not for the engine.

Driven through the accounting layer (`Account`) with a clock of its own: the attempts are
given up as a winning hedge gives them up (cancelled, `SUPERSEDED`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import pytest

from gateway.config import parse_policy
from gateway.config.routes import KNOWN_ROUTES
from gateway.core.timeouts import AttemptTimeouts
from gateway.pipeline.account import Account
from gateway.pipeline.call import Attempt, Call, RequestFacts
from gateway.runtime import SUPERSEDED, Cancellation
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.registry import Registry
from gateway.upstream.response import UpstreamResponse
from tests.test_call import POLICY  # a pool of three, health checks off


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setting() -> tuple[Account, PoolState, InstanceState, Clock]:
    clock = Clock()
    pool = Registry(parse_policy(POLICY), now=clock.now).pools["chat"]
    account = Account({"chat": pool}, lambda pool_name, transition: None, clock)
    return account, pool, pool.instances[0], clock


def streamed_call(pool: PoolState, instance: InstanceState, clock: Clock) -> Call:
    """A streamed chat request's first attempt on `instance`, made in the task that runs it."""
    task = asyncio.current_task()
    assert task is not None
    return Call(
        pool=pool,
        route=KNOWN_ROUTES["/v1/chat/completions"],
        query="",
        body=b'{"model": "m", "messages": []}',
        headers=[],
        facts=RequestFacts("m", True, 16),
        deadline=clock.now + 60,
        cancellation=Cancellation(task),
        attempt=Attempt(
            instance=instance,
            timeouts=AttemptTimeouts(first_byte_s=5.0, idle_s=1.0, connect_s=1.0),
        ),
    )


async def lose_a_race(
    account: Account,
    pool: PoolState,
    instance: InstanceState,
    clock: Clock,
    waited_s: float,
    meanwhile: Callable[[float], None] = lambda sent_at: None,
) -> None:
    """One attempt on `instance` that waits `waited_s` with no answer (while `meanwhile` happens,
    given when it was sent), then is given up for a hedge that answered first."""
    sent = asyncio.Event()
    calls: list[Call] = []

    async def handler(call: Call) -> UpstreamResponse:
        sent.set()
        await asyncio.Event().wait()
        raise AssertionError("given up before it answered")

    async def attempt() -> None:
        call = streamed_call(pool, instance, clock)
        calls.append(call)
        await account(call, handler)

    task = asyncio.create_task(attempt())
    await sent.wait()
    meanwhile(clock.now)
    clock.now += waited_s
    calls[0].cancellation.cancel(SUPERSEDED)
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_an_instance_that_answers_nothing_is_charged_each_race_past_the_limit() -> None:
    account, pool, a, clock = setting()
    limit = pool.policy.breaker.consecutive_timeouts
    for _ in range(limit + 2):
        await lose_a_race(account, pool, a, clock, waited_s=1.0)
    # The losses up to the limit are free; each one past it is a first-byte timeout, blamed.
    assert a.failures == 3
    assert a.stats.timeouts == {("first_byte", True): 3}


async def test_a_charged_race_is_logged_with_the_load_it_was_sent_into(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The timeout line of a lost race past the limit says what the blame rests on, as any
    timeout's does: sent with itself alone in flight there, not with none."""
    account, pool, a, clock = setting()
    limit = pool.policy.breaker.consecutive_timeouts
    with caplog.at_level(logging.WARNING, logger="gateway"):
        for _ in range(limit + 1):
            await lose_a_race(account, pool, a, clock, waited_s=1.0)
    (line,) = [r for r in caplog.records if r.getMessage() == "upstream timeout"]
    fields = line.fields  # type: ignore[attr-defined]
    assert (fields["instance"], fields["phase"], fields["sent_with"]) == (a.name, "first_byte", 1)
    assert fields["waited_s"] == pytest.approx(1.0)  # the test's clock


async def test_a_first_byte_between_losses_starts_the_count_again() -> None:
    account, pool, a, clock = setting()
    limit = pool.policy.breaker.consecutive_timeouts
    for _ in range(3):
        for _ in range(limit - 1):
            await lose_a_race(account, pool, a, clock, waited_s=1.0)
        # Another attempt there got its first byte: the instance answers (a stream that goes
        # on, not yet a success).
        a.first_byte(clock.now - 0.5, clock.now)
    assert a.failures == 0
    assert a.stats.timeouts == {}


async def test_a_race_lost_while_queued_at_a_working_instance_is_not_counted() -> None:
    account, pool, a, clock = setting()
    limit = pool.policy.breaker.consecutive_timeouts
    a.capacity_seen = 2
    # Two long streams hold both of its slots; each attempt sent now waits in its queue.
    for _ in range(2):
        a.attempt_started(0)
        a.stream_started()
    for _ in range(limit + 3):
        # The streams went on while it waited.
        await lose_a_race(
            account, pool, a, clock, waited_s=1.0, meanwhile=lambda at: a.progressed(at + 0.5)
        )
    assert a.failures == 0
    assert a.stats.timeouts == {}
    # Once the instance goes silent, its queue is no excuse: the count goes on from there.
    for _ in range(limit + 1):
        await lose_a_race(account, pool, a, clock, waited_s=1.0)
    assert a.failures == 2
