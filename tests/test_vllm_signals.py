"""vLLM's own load gauges end to end: an instance whose engine queues gets no new work from
the gateway, and requests wait in the gateway's queues while every instance is saturated.

The backends run the fake's engine model with one request at a time: two long requests sent
to one backend directly put one in its queue (`vllm:num_requests_waiting` 1), as another
client of a shared vLLM would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from starlette.types import Receive, Scope, Send

from gateway.config import parse_policy
from gateway.upstream.registry import Registry
from gateway.upstream.vllm_load import VllmLoadScraper
from loadtests.asgi_server import Recorder, ThreadedServer
from loadtests.procs import wait_until
from tests.support import Backend, Gateway, pool_policy, running_backends, start_gateway

SHORT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(
        ("a", "b"), ["m"], "--max-running", "1", "--ttft", "0.01", "--per-token", "0.01"
    )


def signals_policy(backends: dict[str, Backend]) -> str:
    return pool_policy(
        backends,
        """
        admission:
          concurrency: {mode: fixed, limit: 4}
          vllm_signals: {interval: 50ms, max_waiting: 0}
          standard: {queue_timeout: 20s}
        """,
    )


def instance_state(gateway: Gateway, name: str) -> dict[str, Any]:
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
    pool = state["pools"]["chat"]
    found: dict[str, Any] = next(i for i in pool["instances"] if i["name"] == name)
    found["admission"] = pool["admission"]
    return found


@asynccontextmanager
async def queue_on(backend: Backend) -> AsyncIterator[None]:
    """Two long requests straight to the backend: one runs, one waits in its engine's queue
    (for as long as the block lasts; leaving it disconnects both)."""
    async with httpx.AsyncClient(timeout=30) as client:
        held = [
            asyncio.ensure_future(client.post(f"{backend.url}/v1/chat/completions", json=LONG))
            for _ in range(2)
        ]
        queued = await client.get(f"{backend.url}/_fake/engine?waiting=1&timeout=5")
        assert queued.json()["waiting"] == 1
        try:
            yield
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)


async def test_a_saturated_instance_gets_no_new_work(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    gateway = start_gateway(tmp_path / "policy.yaml", signals_policy(backends))
    try:
        async with queue_on(backends["a"]):
            assert await asyncio.to_thread(
                wait_until, lambda: instance_state(gateway, "a")["vllm"]["saturated"]
            )
            a = instance_state(gateway, "a")["vllm"]
            assert a["waiting"] == 1 and a["cache_usage"] == 0.0  # no KV cache: never full
            async with httpx.AsyncClient(timeout=10) as client:
                served = []
                for _ in range(8):
                    response = await client.post(f"{gateway.url}/v1/chat/completions", json=SHORT)
                    assert response.status_code == 200
                    served.append(response.headers["x-gateway-instance"])
            assert served == ["b"] * 8
        # Its queue drained: the next read lets it take work again.
        assert await asyncio.to_thread(
            wait_until, lambda: not instance_state(gateway, "a")["vllm"]["saturated"]
        )
    finally:
        gateway.stop()


async def test_while_every_instance_is_saturated_one_request_each_goes_and_the_rest_wait(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    only_a = {"a": backends["a"]}
    gateway = start_gateway(tmp_path / "policy.yaml", signals_policy(only_a))
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            async with queue_on(backends["a"]):
                assert await asyncio.to_thread(
                    wait_until, lambda: instance_state(gateway, "a")["vllm"]["saturated"]
                )
                backends["a"].reset()
                first, second = (
                    asyncio.ensure_future(
                        client.post(f"{gateway.url}/v1/chat/completions", json=SHORT)
                    )
                    for _ in range(2)
                )
                assert await asyncio.to_thread(
                    wait_until,
                    lambda: instance_state(gateway, "a")["admission"]["queued"]["standard"] == 1,
                )
                # One waits in the engine's queue, as it would sent directly (a queue that
                # other clients keep full must not shut this gateway's clients out); the
                # other in the gateway's, not vLLM's.
                assert await asyncio.to_thread(
                    wait_until,
                    lambda: (
                        len([r for r in backends["a"].requests() if r["path"].startswith("/v1/")])
                        == 1
                    ),
                )
                assert not first.done() and not second.done()
            # The direct requests are gone: the engine serves the first, the next read frees
            # the instance and the second goes.
            for response in await asyncio.wait_for(asyncio.gather(first, second), 10):
                assert response.status_code == 200
                assert response.headers["x-gateway-instance"] == "a"
    finally:
        gateway.stop()


# -- the scraper against engines with and without gauges ------------------------------------


def one_instance(port: int, admission: str) -> Registry:
    """A registry of one pool, `chat`, of one instance on `port`, with that `admission`."""
    policy = f"""
pools:
  chat:
    models: [m]
    instances: [{{name: a, url: "http://127.0.0.1:{port}"}}]
    admission: {admission}
"""
    return Registry(parse_policy(policy), now=asyncio.get_running_loop().time())


class Pages:
    """An ASGI app whose /metrics answer is set by the test: a status and a page."""

    def __init__(self) -> None:
        self.status = 200
        self.page = b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": self.page})


async def test_an_engine_without_gauges_is_left_to_the_limiter_and_asked_again_later() -> None:
    pages = Pages()
    recorder = Recorder(pages)
    server = ThreadedServer(recorder)
    try:
        registry = one_instance(server.port, "{vllm_signals: {recheck: 30s}}")
        pool = registry.pools["chat"]
        admission = pool.policy.admission
        assert admission is not None
        limit = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession() as session:
            scraper = VllmLoadScraper(registry, session)
            inst = pool.instances[0]

            pages.status, pages.page = 404, b"not found"
            await scraper.scrape_pool(pool, admission, limit)
            assert inst.engine.gauges is False and not inst.engine.saturated
            await scraper.scrape_pool(pool, admission, limit)  # not asked again before recheck
            assert len(recorder.requests) == 1

            # Another engine took its place (the recheck came): its gauges are read. Until it
            # queues, it is given four times the most it was seen running, at least 16.
            scraper._recheck_at.clear()
            pages.status = 200
            pages.page = b"llamacpp:requests_processing 3\nllamacpp:requests_deferred 0\n"
            await scraper.scrape_pool(pool, admission, limit)
            assert inst.engine.gauges is True and inst.room() == 16
            pages.page = b"llamacpp:requests_processing 12\nllamacpp:requests_deferred 0\n"
            await scraper.scrape_pool(pool, admission, limit)
            assert inst.room() == 48 and inst.engine.batch == 0
            pages.page = b"llamacpp:requests_processing 4\nllamacpp:requests_deferred 3\n"
            inst.in_flight = 6
            await scraper.scrape_pool(pool, admission, limit)
            assert inst.engine.gauges is True and inst.engine.saturated
            # 6 in flight, 3 beyond the engine's room: 3 may stay; the limiter's room is
            # held to that.
            assert inst.engine.slots == 3 and inst.room() == 3

            # It ran 4 at once with others waiting: its batch. Once it is no longer saturated,
            # it is given that batch and a headroom of 2 at most (not the limiter's 16).
            assert inst.engine.batch == 4
            pages.page = b"llamacpp:requests_processing 4\nllamacpp:requests_deferred 0\n"
            await scraper.scrape_pool(pool, admission, limit)
            assert not inst.engine.saturated and inst.room() == 4 + 2
            # Running more without a queue shows a larger batch: the cap follows.
            pages.page = b"llamacpp:requests_processing 12\nllamacpp:requests_deferred 0\n"
            await scraper.scrape_pool(pool, admission, limit)
            assert inst.engine.batch == 12 and inst.room() == 12 + 3
            # A read that fails (the network, a restart) forgets the saturation but keeps the
            # pace the engine showed: not the limiter's, learned from the same faults.
            assert inst.limiter is not None
            inst.limiter.record(0.0, 1.0, 1, overloaded=True)
            pages.status = 500
            await scraper.scrape_pool(pool, admission, limit)
            assert inst.engine.gauges is None and inst.room() == 12 + 3
            pages.status = 200

            # A page of other metrics (a plain exporter): no gauges. The limiter paces it.
            pages.page = b"process_cpu_seconds_total 12.5\n"
            await scraper.scrape_pool(pool, admission, limit)
            assert inst.engine.gauges is False and not inst.engine.saturated
            assert inst.room() == inst.limiter.limit < 1024

            # A failed read (5xx) forgets the signals but is asked again next time.
            scraper._recheck_at.clear()
            pages.status = 500
            await scraper.scrape_pool(pool, admission, limit)
            assert inst.engine.gauges is None and not inst.engine.saturated
            count = len(recorder.requests)
            await scraper.scrape_pool(pool, admission, limit)
            assert len(recorder.requests) == count + 1

            # Even with more waiting than it holds, a saturated instance keeps one slot.
            pages.status = 200
            pages.page = b'vllm:num_requests_waiting{model_name="m"} 40\n'
            inst.in_flight = 2
            await scraper.scrape_pool(pool, admission, limit)
            assert inst.engine.saturated and inst.engine.slots == 1
    finally:
        server.stop()


async def test_a_budget_sized_by_the_engines_first_read_counts_what_is_already_in_flight() -> None:
    pages = Pages()
    server = ThreadedServer(Recorder(pages))
    try:
        registry = one_instance(server.port, "{tokens: {overcommit: 1.0}}")
        pool = registry.pools["chat"]
        admission = pool.policy.admission
        assert admission is not None
        inst = pool.instances[0]
        assert inst.budget is None  # no capacity in the policy: the engine will say
        inst.tokens_held = 700  # attempts sent before its engine was read hold these
        pages.page = (
            b"vllm:num_requests_running 2\nvllm:num_requests_waiting 0\n"
            b'vllm:cache_config_info{block_size="16",num_gpu_blocks="250"} 1\n'
        )
        async with aiohttp.ClientSession() as session:
            scraper = VllmLoadScraper(registry, session)
            await scraper.scrape_pool(pool, admission, aiohttp.ClientTimeout(total=5))
        assert inst.budget is not None
        assert (inst.budget.budget, inst.budget.used) == (4000, 700)
    finally:
        server.stop()
