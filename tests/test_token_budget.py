"""Token-aware admission end to end: large requests are spread so no instance holds more
estimated KV-cache tokens than its budget, and small ones slip past them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.procs import wait_until
from tests.support import Backend, Gateway, pool_policy, running_backends, start_gateway
from tests.test_admission import max_concurrency

TTFT_S = 0.4
# A large request (600 tokens) holds its instance 1.8 s longer than a small one (20 tokens):
# a small one that went straight through ends long before any large one does.
PER_TOKEN_S = 0.003
# A budget of 1000 tokens per instance: one 600-token request fits, two do not.
BIG = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}
SMALL = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(
        ("a", "b"), ["m"], "--ttft", str(TTFT_S), "--per-token", str(PER_TOKEN_S)
    )


@pytest.fixture
def gateway(backends: dict[str, Backend], tmp_path: Path) -> Iterator[Gateway]:
    policy = pool_policy(
        backends,
        """
        admission:
          concurrency: {mode: fixed, limit: 8}
          tokens: {capacity: 1000, overcommit: 1.0}
          standard: {queue_timeout: 20s}
        """,
    )
    gw = start_gateway(tmp_path / "policy.yaml", policy)
    yield gw
    gw.stop()


async def post(
    client: httpx.AsyncClient, gateway: Gateway, body: dict[str, object], priority: str
) -> tuple[int, float]:
    started = time.monotonic()
    response = await client.post(
        f"{gateway.url}/v1/chat/completions", json=body, headers={"x-gateway-priority": priority}
    )
    return response.status_code, time.monotonic() - started


async def test_large_requests_are_spread_by_kv_tokens_and_small_ones_pass_them(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    for backend in backends.values():
        backend.reset()
    async with httpx.AsyncClient(timeout=30) as client:
        big = [post(client, gateway, BIG, "standard") for _ in range(6)]
        small = [post(client, gateway, SMALL, "interactive") for _ in range(2)]
        results = await asyncio.wait_for(asyncio.gather(*big, *small), 30)
        state = (await client.get(f"{gateway.admin_url}/admin/state")).json()
    assert [status for status, _ in results] == [200] * 8
    # Six large requests, one at a time per instance: three rounds of the backend's TTFT.
    big_times = sorted(elapsed for _, elapsed in results[:6])
    assert big_times[-1] >= 3 * TTFT_S
    logs = {
        name: [r for r in backend.requests() if r["path"] == "/v1/chat/completions"]
        for name, backend in backends.items()
    }
    for name, log in logs.items():
        large = [r for r in log if r["max_tokens"] == 600]
        assert max_concurrency(large) == 1, name
    # The small ones fit beside a large one and never waited for a round to end: both were
    # over before the first large one was.
    small_ends = [r["ended"] for log in logs.values() for r in log if r["max_tokens"] == 20]
    large_ends = [r["ended"] for log in logs.values() for r in log if r["max_tokens"] == 600]
    assert len(small_ends) == 2 and len(large_ends) == 6, logs
    assert max(small_ends) < min(large_ends), logs
    for instance in state["pools"]["chat"]["instances"]:
        assert instance["kv_tokens"] == {"in_use": 0, "budget": 1000}


def test_each_instance_budget_is_sized_by_its_own_engine(tmp_path: Path) -> None:
    # Two GPU types in one pool: engines with KV caches of 4000 and 2048 tokens, which they
    # report as vLLM does (`vllm:cache_config_info`). The policy gives no capacity.
    backends = running_backends(("big",), ["m"], "--max-running", "8", "--kv-tokens", "4000")
    small = running_backends(("small",), ["m"], "--max-running", "8", "--kv-tokens", "2048")
    try:
        both = {**next(backends), **next(small)}
        policy = pool_policy(
            both,
            """
        admission:
          tokens: {overcommit: 1.0}
          vllm_signals: {interval: 50ms}
        """,
        )
        gateway = start_gateway(tmp_path / "policy.yaml", policy)
        try:

            def budgets() -> dict[str, object]:
                state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
                instances = state["pools"]["chat"]["instances"]
                return {i["name"]: (i["kv_tokens"] or {}).get("budget") for i in instances}

            assert wait_until(lambda: None not in budgets().values(), timeout_s=10)
            assert budgets() == {"big": 4000, "small": 2048}
        finally:
            gateway.stop()
    finally:
        for gen in (backends, small):
            gen.close()
