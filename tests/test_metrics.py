"""/metrics after a scripted scenario: the counts match what happened."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import (
    Backend,
    Gateway,
    pool_policy,
    running_backends,
    start_gateway,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("a", "b"), ["m"], "--ttft", "0.01", "--per-token", "0.001")


@pytest.fixture
def gateway(backends: dict[str, Backend], tmp_path: Path) -> Iterator[Gateway]:
    policy = pool_policy(
        backends, "breaker: {consecutive_failures: 3, isolation: 60s, max_isolation: 120s}"
    )
    gw = start_gateway(tmp_path / "policy.yaml", policy)
    yield gw
    gw.stop()


def samples(gateway: Gateway) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = httpx.get(f"{gateway.admin_url}/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    found = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def test_requests_retries_isolation_and_ooms_are_counted(
    backends: dict[str, Backend], gateway: Gateway
) -> None:
    backends["b"].set_faults(oom_rate=1.0)  # every request: 500 "CUDA out of memory"
    try:
        statuses = [
            httpx.post(f"{gateway.url}/v1/chat/completions", json=BODY, timeout=10).status_code
            for _ in range(30)
        ]
        unknown = httpx.post(
            f"{gateway.url}/v1/chat/completions", json={**BODY, "model": "nope"}, timeout=10
        )
    finally:
        backends["b"].reset()
    assert statuses == [200] * 30 and unknown.status_code == 404
    found = samples(gateway)
    ooms = value(found, "gateway_backend_ooms_total", pool="chat", backend="b")
    assert ooms == 3  # then b is isolated: 3 consecutive failures
    assert (
        value(found, "gateway_upstream_attempts_total", pool="chat", backend="b", outcome="oom")
        == 3
    )
    assert (
        value(found, "gateway_upstream_attempts_total", pool="chat", backend="a", outcome="ok")
        == 30
    )
    assert value(found, "gateway_retries_total", pool="chat", reason="oom") == 3
    assert value(found, "gateway_isolations_total", pool="chat", backend="b") == 1
    assert value(found, "gateway_instance_state", pool="chat", backend="b", state="ISOLATED") == 1
    assert value(found, "gateway_instance_state", pool="chat", backend="a", state="ADMITTING") == 1
    # Only requests routed to a pool count; the unknown model is not a label.
    assert value(found, "gateway_requests_total", pool="chat", model="m", status_class="2xx") == 30
    assert not [key for key in found if ("model", "nope") in key[1]]
    assert value(found, "gateway_request_duration_seconds_count", pool="chat", model="m") == 30
    assert value(found, "gateway_time_to_first_byte_seconds_count", pool="chat", model="m") == 30
    assert (
        value(found, "gateway_request_duration_seconds_bucket", pool="chat", model="m", le="+Inf")
        == 30
    )
    assert value(found, "gateway_pool_failure_rate", pool="chat") > 0
    assert (
        value(found, "gateway_instance_timeout_seconds", pool="chat", backend="a", phase="connect")
        > 0
    )
    assert (
        value(
            found,
            "gateway_instance_latency_ewma_seconds",
            pool="chat",
            backend="a",
            estimate="per_token",
            stat="mean",
        )
        > 0
    )
    # No `shared` in this policy: nothing to be connected to, so no series (an alert on 0
    # would fire for every gateway that decides alone by design).
    assert ("gateway_shared_state_connected", frozenset()) not in found
    assert value(found, "gateway_pool_panic_attempts_total", pool="chat") == 0
    assert ("gateway_pool_panic_attempts_total", frozenset({("pool", "chat")})) in found


def test_a_metrics_listener_serves_prometheus_without_the_admin_token(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    """`metrics.listen`: Prometheus scrapes /metrics from the pod's address with no token; the
    admin plane keeps its token; the process and build families are there too."""
    policy = pool_policy(backends, top="metrics: {listen: 127.0.0.1:0}")
    gw = start_gateway(tmp_path / "policy.yaml", policy, {"GATEWAY_ADMIN_TOKEN": "t0ken"})
    try:
        url = f"http://{gw.proc.ready['metrics']}"
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=BODY, timeout=10).status_code == 200
        scraped = httpx.get(f"{url}/metrics", timeout=5)
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(scraped.text)}
        assert "gateway_requests" in families
        (info,) = families["gateway_build_info"].samples
        assert info.value == 1 and info.labels["version"]
        for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds"):
            assert families[name].samples, name
        # Nothing else is served there, and the admin plane still wants its token.
        assert httpx.get(f"{url}/admin/state", timeout=5).status_code == 404
        assert httpx.get(f"{gw.admin_url}/metrics", timeout=5).status_code == 401
    finally:
        gw.stop()
