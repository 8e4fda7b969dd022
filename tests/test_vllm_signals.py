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

import httpx
import pytest

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
            assert a["waiting"] == 1 and 0 < a["cache_usage"] <= 1
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


async def test_requests_wait_in_the_gateway_while_every_instance_is_saturated(
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
                waiting = asyncio.ensure_future(
                    client.post(f"{gateway.url}/v1/chat/completions", json=SHORT)
                )
                assert await asyncio.to_thread(
                    wait_until,
                    lambda: instance_state(gateway, "a")["admission"]["queued"]["standard"] == 1,
                )
                # Held in the gateway's queue, not sent to vLLM's.
                sent = [r for r in backends["a"].requests() if r["path"].startswith("/v1/")]
                assert sent == [] and not waiting.done()
            # The direct requests are gone; the next read frees the instance and the request goes.
            response = await asyncio.wait_for(waiting, 10)
            assert response.status_code == 200
            assert response.headers["x-gateway-instance"] == "a"
    finally:
        gateway.stop()
