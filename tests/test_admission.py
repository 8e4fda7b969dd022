"""Admission control end to end: a burst of 3x a pool's capacity through a real gateway."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.pipeline.admit import FLOOD_WINDOW_S
from tests.support import (
    Backend,
    Gateway,
    pool_policy,
    running_backends,
    start_gateway,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ROUTES = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}  # same body, either API
LIMIT = 2  # per instance: two instances, four slots


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("a", "b"), ["m"], "--ttft", "0.3", "--per-token", "0.001")


@pytest.fixture
def gateway(backends: dict[str, Backend], tmp_path: Path) -> Iterator[Gateway]:
    policy = pool_policy(
        backends,
        f"""
        admission:
          max_queued: 10
          concurrency: {{mode: fixed, limit: {LIMIT}}}
          interactive: {{max_queue: 10, queue_timeout: 10s}}
          batch: {{max_queue: 6, queue_timeout: 10s}}
        """,
    )
    gw = start_gateway(tmp_path / "policy.yaml", policy)
    yield gw
    gw.stop()


async def send(
    client: httpx.AsyncClient, gateway: Gateway, priority: str, delay_s: float, api: str = "chat"
) -> tuple[str, int, float, httpx.Response]:
    await asyncio.sleep(delay_s)
    started = time.monotonic()
    response = await client.post(
        f"{gateway.url}{ROUTES[api]}", json=BODY, headers={"x-gateway-priority": priority}
    )
    return priority, response.status_code, time.monotonic() - started, response


def max_concurrency(requests: list[dict[str, float]]) -> int:
    edges = sorted([(r["started"], 1) for r in requests] + [(r["ended"], -1) for r in requests])
    now = peak = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


async def test_a_burst_sheds_backlog_first_and_answers_everyone(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    for backend in backends.values():
        backend.reset()
    async with httpx.AsyncClient(timeout=30) as client:
        # 12 requests in flight or queued = 3x the four slots: batch first, interactive next.
        batch = [send(client, gateway, "batch", 0.0) for _ in range(12)]
        interactive = [send(client, gateway, "interactive", 0.1) for _ in range(8)]
        results = await asyncio.wait_for(asyncio.gather(*batch, *interactive), 30)
        state = (await client.get(f"{gateway.admin_url}/admin/state")).json()
        metrics = (await client.get(f"{gateway.admin_url}/metrics")).text
    statuses = {(p, s) for p, s, _, _ in results}
    assert statuses <= {("batch", 200), ("batch", 429), ("interactive", 200)}, statuses
    shed = [r for p, s, _, r in results if s == 429]
    assert shed, "the burst was larger than slots plus queues: some batch requests are shed"
    for response in shed:
        assert response.json()["error"]["code"] == "shed"
        assert response.headers["x-gateway-error"] == "shed"
        assert int(response.headers["retry-after"]) >= 1
    assert all("x-gateway-error" not in r.headers for _, s, _, r in results if s == 200)
    # Interactive requests went ahead of the waiting batch ones.
    waits = {
        p: sorted(t for q, s, t, _ in results if q == p and s == 200)
        for p in ("batch", "interactive")
    }
    assert len(waits["interactive"]) == 8
    assert waits["interactive"][len(waits["interactive"]) // 2] < waits["batch"][-1]
    # Counted where operators look.
    admission = state["pools"]["chat"]["admission"]
    assert admission["shed"]["batch"] == len(shed) and admission["shed"]["interactive"] == 0
    assert admission["room"] == 2 * LIMIT and admission["running"] == 0
    assert f'gateway_shed_requests_total{{class="batch",pool="chat"}} {float(len(shed))}' in metrics
    # No instance ever had more than its limit at once.
    for backend in backends.values():
        done = [r for r in backend.requests() if r["path"] == "/v1/chat/completions"]
        assert max_concurrency(done) <= LIMIT


async def test_a_shed_on_the_messages_route_is_marked_though_its_body_has_no_code(
    gateway: Gateway,
) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        # 4 slots and 6 batch places in the queue: of 14 batch requests, some are shed.
        burst = [send(client, gateway, "batch", 0.0, api="messages") for _ in range(14)]
        results = await asyncio.wait_for(asyncio.gather(*burst), 30)
    assert {s for _, s, _, _ in results} == {200, 429}
    for _, status, _, response in results:
        if status == 200:
            assert response.json()["type"] == "message"
            assert "x-gateway-error" not in response.headers
            continue
        # Anthropic's shape, which has no code: the header is what says "shed".
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert response.headers["x-gateway-error"] == "shed"
        assert int(response.headers["retry-after"]) >= 1


def test_an_unknown_priority_is_a_bad_request(gateway: Gateway) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=BODY,
        headers={"x-gateway-priority": "urgent"},
        timeout=10,
    )
    assert response.status_code == 400
    assert "x-gateway-priority" in response.json()["error"]["message"]
    assert response.headers["x-gateway-error"] == "invalid_request"


async def test_a_learned_limit_without_engine_gauges_holds_back_only_a_flood(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    """Its limit is a guess from latency and failures: at a rate the pool has served, requests
    past it go on to the backends, which take them as they would without the gateway."""
    for backend in backends.values():
        backend.reset()
    policy = pool_policy(
        backends,
        """
        admission:
          vllm_signals: false
          concurrency: {limit: 64, initial: 1, min: 1}
          batch: {max_queue: 2, queue_timeout: 10s}
        """,
    )
    gw = start_gateway(tmp_path / "policy.yaml", policy)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            # Seen completing requests two at a time; a burst of 8 once those are out of the
            # arrival rate's window is no flood (FLOOD_RATIO, FLOOD_WINDOW_S).
            for _ in range(8):
                pair = [send(client, gw, "standard", 0.0) for _ in range(2)]
                assert [r[1] for r in await asyncio.gather(*pair)] == [200, 200]
            await asyncio.sleep(FLOOD_WINDOW_S + 0.1)
            room = (await client.get(f"{gw.admin_url}/admin/state")).json()["pools"]["chat"][
                "admission"
            ]["room"]
            assert room < 8  # learned from the pairs, from a limit of 1 per instance
            burst = [send(client, gw, "batch", 0.0) for _ in range(8)]
            results = await asyncio.wait_for(asyncio.gather(*burst), 30)
            state = (await client.get(f"{gw.admin_url}/admin/state")).json()
            metrics = (await client.get(f"{gw.admin_url}/metrics")).text
    finally:
        gw.stop()
    assert [s for _, s, _, _ in results] == [200] * 8
    admission = state["pools"]["chat"]["admission"]
    assert admission["shed"] == {"interactive": 0, "standard": 0, "batch": 0}
    assert admission["overflow"]["batch"] == 8 - room  # none queued: past the limit at once
    overflow = float(admission["overflow"]["batch"])
    assert f'gateway_admission_overflow_total{{class="batch",pool="chat"}} {overflow}' in metrics
    assert 'gateway_shed_requests_total{class="batch",pool="chat"} 0.0' in metrics
    # Sent on past the learned limit, to both instances.
    peaks = [
        max_concurrency([r for r in b.requests() if r["path"] == "/v1/chat/completions"])
        for b in backends.values()
    ]
    assert sum(peaks) > room, peaks
