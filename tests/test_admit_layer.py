"""The admission shell in-process: slots, waiting, hand-over, queue timeouts, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import parse_policy
from gateway.errors import Shed
from gateway.pipeline.admit import PoolAdmission, parse_priority
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


def test_priorities() -> None:
    assert parse_priority(None) is None
    assert parse_priority(b" Interactive ") == "interactive"
    with pytest.raises(ValueError):
        parse_priority(b"urgent")
