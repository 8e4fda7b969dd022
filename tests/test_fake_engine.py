"""The fake backend's simulated engine in-process: batch limit, FIFO queue, KV budget, slowdown."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from loadtests.fake_vllm.app import build_app
from loadtests.fake_vllm.config import FakeConfig
from loadtests.fake_vllm.engine import DONE, FAILED, QUEUED, RUNNING, Engine, EngineOOM


async def test_requests_beyond_max_running_wait_and_start_in_arrival_order() -> None:
    engine = Engine(max_running=2)
    slots = [engine.submit(1) for _ in range(5)]
    assert [s.state for s in slots] == [RUNNING, RUNNING, QUEUED, QUEUED, QUEUED]
    assert (engine.running, engine.waiting) == (2, 3)
    assert [s.started.done() for s in slots] == [True, True, False, False, False]

    engine.finish(slots[1])  # the freed place goes to the oldest waiter, not the newest
    assert [s.state for s in slots] == [RUNNING, DONE, RUNNING, QUEUED, QUEUED]
    engine.finish(slots[0])
    assert slots[3].state == RUNNING and slots[4].state == QUEUED
    assert (engine.running, engine.waiting) == (2, 1)

    # A newcomer queues behind the waiter even though it arrives as a place frees up.
    late = engine.submit(1)
    engine.finish(slots[2])
    assert (slots[4].state, late.state) == (RUNNING, QUEUED)
    for slot in (slots[3], slots[4], late):
        engine.finish(slot)
    assert (engine.running, engine.waiting, engine.kv_used) == (0, 0, 0)


async def test_unlimited_engine_never_queues() -> None:
    engine = Engine()
    slots = [engine.submit(100) for _ in range(50)]
    assert all(s.state == RUNNING for s in slots)
    assert (engine.running, engine.waiting, engine.cache_usage) == (50, 0, None)


async def test_a_request_that_does_not_fit_the_kv_cache_fails_as_it_starts() -> None:
    engine = Engine(max_running=2, kv_tokens=100)
    engine.submit(60)
    assert engine.kv_used == 60 and engine.cache_usage == 0.6
    too_big = engine.submit(50)  # 60 + 50 > 100: fails at once, holds nothing
    assert too_big.state == FAILED and engine.ooms == 1
    with pytest.raises(EngineOOM):
        await engine.wait_started(too_big)
    assert (engine.running, engine.kv_used) == (1, 60)

    fits = engine.submit(40)  # exactly full is still room
    assert fits.state == RUNNING and engine.cache_usage == 1.0
    # Queued requests are checked when they would start, not when they arrive.
    queued_big, queued_small = engine.submit(70), engine.submit(10)
    assert engine.waiting == 2
    engine.finish(fits)  # 60 used: 70 fails, and the place goes on to the 10
    assert (queued_big.state, queued_small.state) == (FAILED, RUNNING)
    assert (engine.ooms, engine.running, engine.kv_used, engine.waiting) == (2, 2, 70, 0)

    engine.reset()  # clears the cumulative count only
    assert (engine.ooms, engine.running, engine.kv_used) == (0, 2, 70)


async def test_run_gives_back_its_place_when_cancelled_while_running() -> None:
    engine = Engine(max_running=1, kv_tokens=100)
    inside = asyncio.Event()

    async def hold() -> None:
        async with engine.run(30):
            inside.set()
            await asyncio.Event().wait()  # until cancelled, as by a client disconnect

    task = asyncio.create_task(hold())
    await inside.wait()
    assert (engine.running, engine.kv_used) == (1, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (engine.running, engine.kv_used, engine.waiting) == (0, 0, 0)


async def test_run_leaves_the_queue_when_cancelled_while_waiting() -> None:
    engine = Engine(max_running=1, kv_tokens=100)
    holder = engine.submit(50)
    entered: list[str] = []

    async def request(name: str) -> None:
        async with engine.run(20):
            entered.append(name)

    gone = asyncio.create_task(request("gone"))
    assert await engine.wait_waiting(1, timeout_s=5)
    stays = asyncio.create_task(request("stays"))
    assert await engine.wait_waiting(2, timeout_s=5)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert engine.waiting == 1 and engine.kv_used == 50

    engine.finish(holder)
    await asyncio.wait_for(stays, 5)
    assert entered == ["stays"]
    assert (engine.running, engine.kv_used, engine.waiting) == (0, 0, 0)


async def test_a_waiter_cancelled_after_its_place_freed_passes_it_on() -> None:
    # The place frees while the cancelled owner has not yet run its cleanup: it must not be lost.
    engine = Engine(max_running=1)
    holder = engine.submit(1)
    gone, nxt = engine.submit(1), engine.submit(1)
    gone.started.cancel()  # what cancelling the task awaiting it does
    engine.finish(holder)
    assert (gone.state, nxt.state) == (DONE, RUNNING)
    engine.finish(gone)  # the owner's late cleanup is harmless
    assert (engine.running, engine.waiting) == (1, 0)


async def test_batch_slowdown_grows_with_the_batch() -> None:
    engine = Engine(max_running=4, batch_slowdown=1.0)
    assert [engine.submit(1).factor for _ in range(4)] == [1.25, 1.5, 1.75, 2.0]
    unlimited = Engine(batch_slowdown=0.8)  # relative to a batch of 16
    assert unlimited.submit(1).factor == pytest.approx(1.05)
    assert unlimited.submit(1).factor == pytest.approx(1.1)
    assert Engine(max_running=2).submit(1).factor == 1.0


async def test_an_engine_without_a_batch_bound_runs_out_of_memory_past_oom_above() -> None:
    engine = Engine(oom_above=2, batch_slowdown=1.0)  # a full batch is oom_above
    assert [engine.submit(1).factor for _ in range(2)] == [1.5, 2.0]
    third = engine.submit(1)  # no queue: it starts at once, and fails
    assert (third.state, engine.ooms, engine.running, engine.waiting) == (FAILED, 1, 2, 0)
    with pytest.raises(EngineOOM, match="2 requests already running"):
        await engine.wait_started(third)


async def test_run_yields_the_slowdown_and_raises_oom() -> None:
    engine = Engine(max_running=2, kv_tokens=10, batch_slowdown=0.5)
    async with engine.run(4) as factor:
        assert factor == 1.25
        with pytest.raises(EngineOOM):
            async with engine.run(7):
                pytest.fail("an over-budget request must not run")
        assert (engine.running, engine.kv_used, engine.ooms) == (1, 4, 1)
    assert (engine.running, engine.kv_used) == (0, 0)


async def test_wait_waiting_times_out() -> None:
    assert not await Engine(max_running=1).wait_waiting(1, timeout_s=0.01)


async def test_a_fake_without_metrics_answers_404_and_fails_past_oom_above() -> None:
    # As a server that exports no load gauges, with no batch bound of its own.
    config = FakeConfig(models=("m",), ttft_s=0.0, per_token_s=0.05, oom_above=1, metrics=False)
    transport = httpx.ASGITransport(app=build_app(config))
    async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
        assert (await client.get("/metrics")).status_code == 404
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        first = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
        for _ in range(100):  # until the first one runs
            state = (await client.get("/_fake/engine")).json()
            if state["running"]:
                break
            await asyncio.sleep(0.01)
        second = await client.post("/v1/chat/completions", json=body)
        assert second.status_code == 500 and "out of memory" in second.text
        assert (await first).status_code == 200
        assert (await client.get("/_fake/engine")).json()["ooms"] == 1
