"""Adaptive timeouts and tiered retries, end to end: three fake instances and the gateway."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import (
    LOOPBACK_LISTENERS,
    Backend,
    Gateway,
    instances_yaml,
    post_in_parallel,
    running_backends,
    start_gateway,
)

NAMES = ("r0", "r1", "r2")
# A backend fault: no answer for this long, then a 504 of its own.
HANG_S = 20.0


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(NAMES, ["res", "outage"], "--ttft", "0.01", "--per-token", "0.001")


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    instances = instances_yaml(backends)
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  res:
    models: [res]
    instances: [{instances}]
    timeouts: {{initial: 2s, min_samples: 3, floor: 100ms, jitter: 0ms}}
    # Timeouts, failover and a stream's error ending without the rescues layered on them
    # (tests/test_resume.py, tests/test_hedge.py).
    resume: false
    hedging: false
  outage:
    models: [outage]
    instances: [{instances}]
    timeouts: {{initial: 2s, min_samples: 3, floor: 100ms, jitter: 0ms}}
    retries: {{budget: {{ratio: 0.2, min_per_second: 0}}}}
"""
    gw = start_gateway(tmp_path_factory.mktemp("res") / "policy.yaml", policy)
    # Teach every instance its latency, streamed and not.
    teaching = [chat(max_tokens=16, stream=i % 2 == 0) for i in range(90)]
    assert post_in_parallel(gw.url, teaching) == [200] * 90
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def clean(backends: dict[str, Backend], gateway: Gateway) -> None:
    for backend in backends.values():
        backend.reset()
    for pool in ("res", "outage"):  # earlier faults may have isolated instances
        for name in NAMES:
            url = f"{gateway.admin_url}/admin/instances/{pool}/{name}/restore"
            httpx.post(url, timeout=5).raise_for_status()


@pytest.fixture
def client(gateway: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        yield http


def chat(model: str = "res", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def instance_state(gateway: Gateway, pool: str = "res") -> dict[str, dict[str, Any]]:
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
    return {i["name"]: i for i in state["pools"][pool]["instances"]}


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line.startswith("data: ")]


def timeouts_in(instance: dict[str, Any], phase: str, blamed_only: bool) -> int:
    """The timeouts /admin/state counts against an instance in `phase`."""
    return sum(
        t["count"]
        for t in instance["timeouts_by_phase"]
        if t["phase"] == phase and (t["blamed"] or not blamed_only)
    )


def first_byte_timeouts(instance: dict[str, Any]) -> int:
    return timeouts_in(instance, "first_byte", blamed_only=False)


def idle_timeouts(instance: dict[str, Any]) -> int:
    return timeouts_in(instance, "idle", blamed_only=True)


def test_instances_learned_their_latency(gateway: Gateway) -> None:
    for name, inst in instance_state(gateway).items():
        assert inst["ewma"]["ttfb"]["samples"] >= 3, name
        assert inst["ewma"]["per_token"]["samples"] >= 3, name
        # Learned ~10 ms to the first token: the timeout is near the floor, not `initial` (2 s).
        assert inst["timeouts"]["stream_first_byte_s"] < 0.5


def test_hang_before_headers_fails_over_within_the_predicted_timeout(
    gateway: Gateway, client: httpx.Client, backends: dict[str, Backend]
) -> None:
    before = first_byte_timeouts(instance_state(gateway)["r0"])
    backends["r0"].set_faults(hang_rate=1.0)
    answers = []
    while not backends["r0"].requests() and len(answers) < 60:  # until the balancer tries r0
        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            assert r.status_code == 200
            assert sse_lines(r)[-1] == "data: [DONE]"
            answers.append((r.headers["x-gateway-instance"], r.headers["x-gateway-attempts"]))
    assert "r0" not in {instance for instance, _ in answers}
    assert "2" in {attempts for _, attempts in answers}
    hung = backends["r0"].requests()
    hung = backends["r0"].requests(wait_for=len(hung))
    assert hung and all(r["outcome"] == "cancelled" for r in hung)
    # Each one was given up by r0's first-byte timeout (the one the gateway predicts for it),
    # and counted against r0 as such.
    assert first_byte_timeouts(instance_state(gateway)["r0"]) == before + len(hung)


def test_stall_mid_stream_ends_with_error_event_within_the_idle_timeout(
    gateway: Gateway, client: httpx.Client, backends: dict[str, Backend]
) -> None:
    for name in NAMES:
        backends[name].set_faults(stall_rate=1.0, stall_after=3)
    before = instance_state(gateway)
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=50)) as r:
        lines = sse_lines(r)
        served = r.headers["x-gateway-instance"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "upstream_timeout"
    assert len(lines) >= 3  # the tokens sent before the stall came through
    # Cut by the idle timeout between chunks (the request's own ceiling is far off).
    after = instance_state(gateway)
    assert idle_timeouts(after[served]) == idle_timeouts(before[served]) + 1
    # After the first byte nothing is retried: exactly one request reached a backend.
    assert sum(len(backends[n].requests()) for n in NAMES) == 1


def test_backend_dying_mid_stream_is_not_retried(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    for name in NAMES:
        backends[name].set_faults(die_rate=1.0, die_after=2)
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=40)) as r:
        lines = sse_lines(r)
    assert lines[-1] == "data: [DONE]" and "error" in lines[-2]
    assert sum(len(backends[n].requests()) for n in NAMES) == 1


def test_a_crash_mid_stream_counts_against_its_instance_at_once(
    gateway: Gateway, client: httpx.Client, backends: dict[str, Backend]
) -> None:
    before = instance_state(gateway)
    for name in NAMES:
        backends[name].set_faults(die_rate=1.0, die_after=2)
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=40)) as r:
        lines = sse_lines(r)
        served = r.headers["x-gateway-instance"]
    assert lines[-1] == "data: [DONE]" and "upstream_reset" in lines[-2]
    # Counted when the stream broke, not at the next health check: a failure of that instance.
    after = instance_state(gateway)
    assert after[served]["failures"] == before[served]["failures"] + 1
    for name in NAMES:
        if name != served:
            assert after[name]["failures"] == before[name]["failures"]


def test_a_stall_mid_stream_is_an_idle_timeout_of_its_instance(
    gateway: Gateway, client: httpx.Client, backends: dict[str, Backend]
) -> None:
    before = instance_state(gateway)
    for name in NAMES:
        backends[name].set_faults(stall_rate=1.0, stall_after=3)
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=50)) as r:
        lines = sse_lines(r)
        served = r.headers["x-gateway-instance"]
    assert "upstream_timeout" in lines[-2]
    after = instance_state(gateway)
    assert after[served]["failures"] == before[served]["failures"] + 1
    assert idle_timeouts(after[served]) == idle_timeouts(before[served]) + 1
    metrics = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
    line = (
        f'gateway_instance_timeouts_total{{backend="{served}",blamed="true",phase="idle",'
        f'pool="res"}} {float(idle_timeouts(after[served]))}'
    )
    assert line in metrics.splitlines()


def test_long_healthy_generation_never_times_out(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    # 4096 tokens at 1 ms: ~4.1 s, far beyond what 16-token requests took while learning.
    whole = client.post("/v1/chat/completions", json=chat(max_tokens=4096))
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["completion_tokens"] == 4096
    assert whole.headers["x-gateway-attempts"] == "1"
    with client.stream(
        "POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=4096)
    ) as streamed:
        lines = sse_lines(streamed)
    assert lines[-1] == "data: [DONE]" and all("error" not in line for line in lines)


def test_503_burst_is_retried_onto_healthy_instances(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    backends["r1"].set_faults(error_rate=1.0, error_status=503)
    results = []
    while not backends["r1"].requests() and len(results) < 60:  # until the balancer tries r1
        results.append(client.post("/v1/chat/completions", json=chat(max_tokens=4)))
    assert backends["r1"].requests(), "the balancer never tried r1"
    assert [r.status_code for r in results] == [200] * len(results)
    assert {r.headers["x-gateway-instance"] for r in results} <= {"r0", "r2"}
    assert any(r.headers["x-gateway-attempts"] == "2" for r in results)


def test_429_retry_after_keeps_traffic_off_the_instance(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    backends["r2"].set_faults(rate_limit_rate=1.0, retry_after=3)
    results = [client.post("/v1/chat/completions", json=chat(max_tokens=4)) for _ in range(12)]
    assert [r.status_code for r in results] == [200] * 12
    # One 429 taught the gateway to leave r2 alone for 3 s: it saw one request, not four.
    assert len(backends["r2"].requests()) == 1


def test_total_outage_stays_within_the_retry_budget(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    for name in NAMES:
        backends[name].set_faults(error_rate=1.0, error_status=503)
    requests = 40
    statuses = [
        client.post("/v1/chat/completions", json=chat("outage", max_tokens=4)).status_code
        for _ in range(requests)
    ]
    assert statuses == [503] * requests  # the backends' own answer, relayed
    attempts = sum(len(backends[n].requests()) for n in NAMES)
    # Budget: retries <= 20 % of requests (no per-second floor in this pool), not 2 per request.
    assert requests < attempts <= requests * 1.2 + 1, attempts


def test_client_deadline_header_bounds_the_whole_request(
    gateway: Gateway, client: httpx.Client, backends: dict[str, Backend]
) -> None:
    # A whole answer this long gets a first-byte timeout of at least 1.5 x its tokens x the
    # learned time per token: far beyond the backends' hang, which is far beyond the budget.
    # Only the client's budget can end the request while the backends still hang.
    max_tokens = 100_000
    learned = instance_state(gateway).values()
    assert max_tokens * 1.5 * min(i["ewma"]["per_token"]["mean_s"] for i in learned) > 2 * HANG_S
    for name in NAMES:
        backends[name].set_faults(hang_rate=1.0, hang_s=HANG_S)
    started = time.monotonic()
    response = client.post(
        "/v1/chat/completions",
        json=chat(max_tokens=max_tokens),
        headers={"x-gateway-timeout": "0.3"},
    )
    elapsed = time.monotonic() - started
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    # The budget ran out during the first attempt: none was left for a retry, and the one
    # backend asked was let go while it still hung (else it would end "hung", its 504 relayed).
    assert response.headers["x-gateway-attempts"] == "1"
    assert elapsed >= 0.3
    (asked,) = [name for name in NAMES if backends[name].requests()]
    (record,) = backends[asked].requests(wait_for=1)
    assert record["outcome"] == "cancelled"


def test_admin_state_shows_failure_rate_and_tier(gateway: Gateway) -> None:
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
    pool = state["pools"]["res"]
    assert 0.0 <= pool["failure_rate"] <= 1.0
    assert set(pool["tier"]) == {"index", "max_retries", "backoff_s", "k"}
    instance = pool["instances"][0]
    assert set(instance["timeouts"]) >= {"stream_first_byte_s", "stream_idle_s"}
