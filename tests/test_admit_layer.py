"""The admission shell in-process: slots, waiting, hand-over, queue timeouts, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import parse_policy
from gateway.errors import Shed
from gateway.pipeline.admit import PoolAdmission, parse_priority, unreserve
from gateway.upstream.registry import Registry

POLICY = """
pools:
  chat:
    models: [m]
    instances: [{name: a, url: "http://127.0.0.1:9"}]
    health: {enabled: false}
    admission:
      concurrency: {mode: fixed, limit: 1}
      interactive: {queue_timeout: 50ms}
      batch: {max_queue: 1}
"""


def admission() -> PoolAdmission:
    policy = parse_policy(POLICY)
    registry = Registry(policy, now=asyncio.get_running_loop().time())
    pool = registry.pools["chat"]
    admission_policy = pool.policy.admission
    assert admission_policy is not None
    assert all(inst.limiter is not None for inst in pool.instances)  # built with the pool
    return PoolAdmission(pool, admission_policy)


async def test_a_freed_slot_goes_to_the_waiting_request() -> None:
    adm = admission()
    await adm.enter("standard")
    assert adm.running == 1
    waiting = asyncio.ensure_future(adm.enter("standard"))
    await asyncio.sleep(0)
    assert not waiting.done() and len(adm.queues) == 1
    adm.leave()
    await waiting
    assert adm.running == 1 and len(adm.queues) == 0


async def test_a_request_waiting_past_its_queue_timeout_is_shed() -> None:
    adm = admission()
    await adm.enter("standard")
    with pytest.raises(Shed) as shed:
        await asyncio.wait_for(adm.enter("interactive"), 5)
    assert "waited" in shed.value.message and shed.value.retry_after_s is not None
    assert adm.queues.shed["interactive"] == 1


async def test_a_full_queue_sheds_at_once() -> None:
    adm = admission()
    await adm.enter("standard")
    first = asyncio.ensure_future(adm.enter("batch"))
    await asyncio.sleep(0)
    with pytest.raises(Shed, match="batch queue is full"):
        await adm.enter("batch")
    first.cancel()


async def test_a_client_that_leaves_while_waiting_frees_its_place() -> None:
    adm = admission()
    await adm.enter("standard")
    gone = asyncio.ensure_future(adm.enter("standard"))
    await asyncio.sleep(0)
    gone.cancel()
    nxt = asyncio.ensure_future(adm.enter("standard"))
    await asyncio.sleep(0)
    adm.leave()
    await asyncio.wait_for(nxt, 5)
    assert adm.running == 1


async def test_no_room_at_all_goes_straight_on() -> None:
    adm = admission()
    adm.pool.instances[0].breaker.isolate(0.0, adm.pool.rng)  # nothing takes traffic
    await adm.enter("batch")  # the pick layer will answer 503 at once
    assert adm.running == 1


TOKENS_POLICY = """
pools:
  chat:
    models: [m]
    instances: [{name: a, url: "http://127.0.0.1:9"}, {name: b, url: "http://127.0.0.1:10"}]
    health: {enabled: false}
    admission:
      concurrency: {mode: fixed, limit: 8}
      tokens: {capacity: 1000, overcommit: 1.0}
"""


def token_admission() -> PoolAdmission:
    policy = parse_policy(TOKENS_POLICY)
    pool = Registry(policy, now=asyncio.get_running_loop().time()).pools["chat"]
    assert pool.policy.admission is not None
    return PoolAdmission(pool, pool.policy.admission)


async def test_tokens_are_reserved_on_the_roomiest_instance_at_admission() -> None:
    adm = token_admission()
    a, b = adm.pool.instances
    first = await adm.enter("standard", 600)
    second = await adm.enter("standard", 600)
    # Let through back to back, before any attempt: each holds its own instance's tokens.
    assert {first, second} == {a, b}
    assert a.budget is not None and b.budget is not None
    assert a.budget.used == b.budget.used == 600
    # A third large one waits although slots are free; a small one fits beside and goes.
    third = asyncio.ensure_future(adm.enter("standard", 600))
    small = await asyncio.wait_for(adm.enter("interactive", 300), 5)
    assert small in (a, b) and not third.done()
    assert adm.running == 3
    # The first finishes: its tokens come back and the third is let through.
    unreserve(first, 600)
    adm.leave()
    assert await asyncio.wait_for(third, 5) is first


async def test_a_saturated_instance_gives_no_room_until_it_clears() -> None:
    adm = token_admission()
    for inst in adm.pool.instances:
        inst.saturated = True
    assert adm.room() == 0
    waiting = asyncio.ensure_future(adm.enter("standard", 10))
    await asyncio.sleep(0)
    assert not waiting.done() and len(adm.queues) == 1
    adm.pool.instances[1].saturated = False
    adm.pool.capacity_changed()  # what the vLLM scraper says when it clears
    assert await asyncio.wait_for(waiting, 5) is adm.pool.instances[1]
    assert adm.room() == 8


def test_priorities() -> None:
    assert parse_priority(None) is None
    assert parse_priority(b" Interactive ") == "interactive"
    with pytest.raises(ValueError):
        parse_priority(b"urgent")
