"""A request leaves no reference cycles behind.

Memory a request held must go back when it ends, by reference counting. What a cycle holds
(an exception whose traceback holds the frame that keeps it, a task that keeps its own
cancellation) waits for the collector; long-lived enough to reach its oldest generation, it
waits for a full collection, which CPython runs rarely. Under load such garbage piled up to
gigabytes in the gateway, and each full collection then stopped it for seconds. Here: the
whole gateway in process (its data plane called as an ASGI app), real fake backends on
loopback, requests that succeed, stream, fail over, time out, are cut mid-stream and are
resumed; then the collector, which must find nothing of the gateway's in any cycle.
"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import Gateway
from gateway.config import parse_policy
from tests.support import Backend, instances_yaml, running_backends

NAMES = ("g0", "g1")


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    # 50 ms to the first token: long enough for the gateway to watch each client.
    yield from running_backends(NAMES, ["m"], "--ttft", "0.05", "--per-token", "0.002")


def chat(i: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"request {i}"}],
        "max_tokens": 24,
        "stream": stream,
    }


async def _traffic(gateway: Gateway, requests: int) -> list[int]:
    transport = httpx.ASGITransport(app=gateway.data_app)
    statuses: list[int] = []
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as http:
        for i in range(requests):
            reply = await http.post("/v1/chat/completions", json=chat(i, stream=i % 2 == 0))
            statuses.append(reply.status_code)
    return statuses


def _gateway_garbage(requests: int, policy_text: str) -> tuple[list[int], Counter[str]]:
    """Runs `requests` through an in-process gateway with the collector off; returns their
    statuses and the gateway's objects the collector then found in cycles, by type."""

    async def scenario() -> tuple[list[int], Counter[str]]:
        gateway = Gateway(parse_policy(policy_text))
        try:
            await _traffic(gateway, 4)  # first use: lazy imports, pools of connections
            gc.collect()
            gc.disable()
            try:
                statuses = await _traffic(gateway, requests)
                gc.set_debug(gc.DEBUG_SAVEALL)
                gc.collect()
                found = Counter(
                    type(o).__qualname__
                    for o in gc.garbage
                    if type(o).__module__.startswith("gateway.")
                )
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
            return statuses, found
        finally:
            await gateway.close()

    return asyncio.run(scenario())


def policy(backends: dict[str, Backend], settings: str = "") -> str:
    return f"""
pools:
  chat:
    models: [m]
    instances: [{instances_yaml(backends)}]
    health: {{enabled: false}}
{settings}
"""


def test_requests_that_succeed_leave_no_cycles(backends: dict[str, Backend]) -> None:
    for backend in backends.values():
        backend.reset()
    statuses, found = _gateway_garbage(12, policy(backends))
    assert statuses == [200] * 12
    assert found == Counter()


def test_failed_attempts_retries_and_resumed_streams_leave_no_cycles(
    backends: dict[str, Backend],
) -> None:
    for backend in backends.values():
        backend.reset()
    # g0 fails: errors before the first byte (retried on g1), streams cut mid-way (resumed
    # on g1), answers that never come (timed out, retried).
    backends["g0"].set_faults(error_rate=0.3, die_rate=0.3, hang_rate=0.2)
    settings = (
        "    timeouts: {initial: 1s}\n"
        "    breaker: {consecutive_failures: 100, error_rate: 1.0}"  # kept in: tried again
    )
    try:
        statuses, found = _gateway_garbage(24, policy(backends, settings))
        faults = Counter(r["fault"] for r in backends["g0"].requests() if r["fault"])
    finally:
        backends["g0"].reset()
    assert statuses == [200] * 24  # each rescued
    assert len(faults) >= 2, faults  # more than one kind of failure was met
    assert found == Counter()
