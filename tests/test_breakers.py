"""Breakers and the balancer end to end: failing instances are isolated and probed back in,
slow ones get less traffic, operators can isolate and restore."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtests.procs import wait_until
from tests.support import (
    LOOPBACK_LISTENERS,
    Backend,
    Gateway,
    instances_yaml,
    running_backends,
    start_backend,
    start_gateway,
)

NAMES = ("b0", "b1", "b2")


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(NAMES, ["bm"], "--ttft", "0.02", "--per-token", "0.001")


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    instances = instances_yaml(backends)
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  bp:
    models: [bm]
    instances: [{instances}]
    timeouts: {{initial: 1s, min_samples: 3, floor: 100ms}}
    breaker: {{min_requests: 5, window: 10s, isolation: 2s, max_isolation: 4s,
              max_isolated_fraction: 0.5}}
    health: {{interval: 500ms, timeout: 250ms}}
    # The breaker's own counts: a hedge would rescue the hung attempts before they time out
    # (tests/test_hedge.py), and the balancer would then avoid the instance for its losses.
    hedging: false
"""
    gw = start_gateway(tmp_path_factory.mktemp("breakers") / "policy.yaml", policy)
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def clean(backends: dict[str, Backend], gateway: Gateway) -> None:
    for name in NAMES:
        backends[name].reset()
        httpx.post(f"{gateway.admin_url}/admin/instances/bp/{name}/restore", timeout=5)


def state_of(gateway: Gateway, name: str) -> dict[str, Any]:
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
    (inst,) = [i for i in state["pools"]["bp"]["instances"] if i["name"] == name]
    result: dict[str, Any] = inst
    return result


def in_rotation(gateway: Gateway, name: str) -> bool:
    state = state_of(gateway, name)
    return state["state"] == "ADMITTING" and state["health"]["healthy"] is True


def send(gateway: Gateway, count: int, **extra: Any) -> list[httpx.Response]:
    body = {"model": "bm", "max_tokens": 4, **extra}
    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        return [http.post("/v1/chat/completions", json=body) for _ in range(count)]


def test_failing_instance_is_isolated_then_probed_back_in(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    backends["b0"].set_faults(error_rate=1.0, error_status=500)
    replies = []
    while state_of(gateway, "b0")["state"] != "ISOLATED" and len(replies) < 60:
        replies.extend(send(gateway, 1))
    assert all(r.status_code == 200 for r in replies)  # each failure retried elsewhere
    assert state_of(gateway, "b0")["state"] == "ISOLATED"
    seen = len(backends["b0"].requests())
    send(gateway, 10)
    assert len(backends["b0"].requests()) == seen  # nothing while isolated

    backends["b0"].reset()  # recovered
    assert wait_until(lambda: state_of(gateway, "b0")["isolation_remaining_s"] == 0, 6.0)
    send(gateway, 3)  # the first one is the probe
    assert backends["b0"].requests(), "no probe reached the recovered instance"
    assert state_of(gateway, "b0")["state"] == "ADMITTING"
    assert state_of(gateway, "b0")["isolations"] >= 1


def test_a_streamed_probe_lets_the_instance_back_at_its_first_byte(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    """A probe that is a long stream must not keep its instance out of rotation for the
    stream's whole length: it answered, so its breaker admits again at once."""
    backends["b0"].set_faults(error_rate=1.0, error_status=500)
    sent = 0
    while state_of(gateway, "b0")["state"] != "ISOLATED" and sent < 60:
        send(gateway, 1)
        sent += 1
    assert state_of(gateway, "b0")["state"] == "ISOLATED"
    backends["b0"].reset()
    assert wait_until(lambda: state_of(gateway, "b0")["isolation_remaining_s"] == 0, 6.0)
    # 20,000 tokens at 1 ms each: the stream is still going long after the checks below.
    body = {"model": "bm", "max_tokens": 20_000, "stream": True}
    with (
        httpx.Client(base_url=gateway.url, timeout=20) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as stream,
    ):
        assert stream.status_code == 200
        assert stream.headers["x-gateway-instance"] == "b0", "the probe goes first"
        chunks = stream.iter_bytes()
        first = next(chunks)
        assert first.startswith(b"data: ")
        state = state_of(gateway, "b0")
        assert state["state"] == "ADMITTING", "held out of rotation while its probe streams"
        assert state["streaming"] == 1, "the probe's stream ended before the check"


def test_hung_instance_is_isolated_after_three_timeouts(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    backends["b1"].set_faults(hang_rate=1.0)
    replies = []
    while state_of(gateway, "b1")["state"] != "ISOLATED" and len(replies) < 80:
        replies.extend(send(gateway, 1, stream=True))
    assert all(r.status_code == 200 for r in replies)
    assert state_of(gateway, "b1")["state"] == "ISOLATED"
    assert len(backends["b1"].requests()) == 3  # consecutive_timeouts: 3


def test_a_failing_instance_the_cap_keeps_admitting_is_priced_out(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    """With the pool's one isolation taken (b2, by the operator), b0 failing fast cannot be
    isolated; the balancer must not keep choosing it for how cheap its failures look."""
    httpx.post(f"{gateway.admin_url}/admin/instances/bp/b2/isolate", timeout=5)
    backends["b0"].set_faults(error_rate=1.0, error_status=500)
    replies = send(gateway, 60)
    assert [r.status_code for r in replies] == [200] * 60  # its failures retried on b1
    assert state_of(gateway, "b0")["state"] == "ADMITTING"  # the cap held
    attempts = len(backends["b0"].requests())
    # consecutive_failures (5) reach it before the cap refuses to isolate it; then it is priced
    # out, and tried again only once its estimate has decayed.
    assert attempts <= 10, attempts


def test_slow_instance_gets_a_smaller_share(gateway: Gateway, backends: dict[str, Backend]) -> None:
    backends["b2"].set_faults(slow_factor=10)
    shares = Counter(r.headers["x-gateway-instance"] for r in send(gateway, 60))
    assert shares["b2"] < 0.5 * min(shares["b0"], shares["b1"]), shares


def test_operator_isolate_and_restore(gateway: Gateway, backends: dict[str, Backend]) -> None:
    url = f"{gateway.admin_url}/admin/instances/bp/b2"
    assert httpx.post(f"{url}/isolate", timeout=5).json()["state"] == "ISOLATED"
    assert state_of(gateway, "b2")["forced"] is True
    send(gateway, 10)
    assert backends["b2"].requests() == []
    assert httpx.post(f"{url}/restore", timeout=5).json()["state"] == "ADMITTING"
    assert httpx.post(f"{url}/explode", timeout=5).status_code == 404
    missing = f"{gateway.admin_url}/admin/instances/bp/nope/isolate"
    assert httpx.post(missing, timeout=5).status_code == 404


def test_restarted_instance_is_probed_back_in(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    port = int(backends["b1"].url.rsplit(":", 1)[1])
    backends["b1"].proc.signal(signal.SIGKILL)  # the pod dies
    backends["b1"].proc.proc.wait(5)
    replies = []
    while in_rotation(gateway, "b1") and len(replies) < 60:
        replies.extend(send(gateway, 1))
    assert all(r.status_code == 200 for r in replies)  # its failures were retried elsewhere
    assert not in_rotation(gateway, "b1")  # its breaker or its health checks took it out

    backends["b1"] = start_backend(
        "b1", ["bm"], "--ttft", "0.02", "--per-token", "0.001", port=port
    )
    # Back after its isolation ends and a health check passes: one probe, then admitting.
    served: list[str] = []
    deadline = time.monotonic() + 15
    while "b1" not in served and time.monotonic() < deadline:
        served += [r.headers["x-gateway-instance"] for r in send(gateway, 1)]
    assert "b1" in served
    assert in_rotation(gateway, "b1")
