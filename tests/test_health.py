"""Active health checks: unhealthy instances get no traffic, come back after passing, and a pool
with nothing healthy answers at once (503 + Retry-After)."""

from __future__ import annotations

import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.procs import wait_until
from tests.support import (
    LOOPBACK_LISTENERS,
    Backend,
    Gateway,
    instances_yaml,
    start_backend,
    start_backends,
    start_gateway,
    stop_backends,
)


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    started = start_backends(("h0", "h1"), ["hm", "hm-panic"], "--ttft", "0", "--per-token", "0")
    # h1 is still "loading its model" when the gateway starts.
    started["h1"].set_faults(unhealthy=True)
    yield started
    stop_backends(started)


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  hp:
    models: [hm]
    instances: [{instances_yaml(backends)}]
    health: {{interval: 200ms, timeout: 150ms, healthy_threshold: 1, unhealthy_threshold: 1}}
    breaker: {{when_none_available: fail_fast}}
  panicky:
    models: [hm-panic]
    instances: [{instances_yaml(backends)}]
    health: {{interval: 200ms, timeout: 150ms, healthy_threshold: 1, unhealthy_threshold: 1}}
    breaker: {{when_none_available: panic}}
"""
    gw = start_gateway(tmp_path_factory.mktemp("health") / "policy.yaml", policy)
    yield gw
    gw.stop()


def health_of(gateway: Gateway, name: str, pool: str = "hp") -> dict[str, Any]:
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
    (inst,) = [i for i in state["pools"][pool]["instances"] if i["name"] == name]
    health: dict[str, Any] = inst["health"]
    return health


def served_by(gateway: Gateway, count: int) -> list[str]:
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        body = {"model": "hm", "max_tokens": 2}
        replies = [http.post("/v1/chat/completions", json=body) for _ in range(count)]
    assert [r.status_code for r in replies] == [200] * count
    return [r.headers["x-gateway-instance"] for r in replies]


def test_health_lifecycle(gateway: Gateway, backends: dict[str, Backend]) -> None:
    # A loading instance gets nothing until its first passing check.
    assert health_of(gateway, "h1")["healthy"] is False
    assert set(served_by(gateway, 6)) == {"h0"}
    assert backends["h1"].requests() == []

    backends["h1"].set_faults(unhealthy=False)  # model loaded
    assert wait_until(lambda: health_of(gateway, "h1")["healthy"] is True, timeout_s=5)
    assert health_of(gateway, "h1")["cold_start_s"] > 0
    served: list[str] = []
    while "h1" not in served and len(served) < 30:  # back in the balancer's rotation
        served += served_by(gateway, 1)
    assert "h1" in served

    backends["h0"].set_faults(unhealthy=True)  # fails its checks: taken out of rotation
    assert wait_until(lambda: health_of(gateway, "h0")["healthy"] is False, timeout_s=5)
    assert set(served_by(gateway, 6)) == {"h1"}

    backends["h1"].set_faults(unhealthy=True)  # nothing left: answered at once
    assert wait_until(lambda: health_of(gateway, "h1")["healthy"] is False, timeout_s=5)
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        seen = {name: len(backend.requests()) for name, backend in backends.items()}
        reply = http.post("/v1/chat/completions", json={"model": "hm"})
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "no_instance_available"
        assert int(reply.headers["retry-after"]) >= 1
        # Refused without trying anyone: no backend saw the request.
        assert {name: len(backend.requests()) for name, backend in backends.items()} == seen
        assert http.get("/readyz").status_code == 503
        # A pool that panics (the default) sends to instances that still answer instead of
        # refusing.
        for name in ("h0", "h1"):
            assert wait_until(
                lambda name=name: health_of(gateway, name, "panicky")["healthy"] is False,
                timeout_s=5,
            )
        panicked = http.post("/v1/chat/completions", json={"model": "hm-panic", "max_tokens": 2})
        assert panicked.status_code == 200

    for name in ("h0", "h1"):
        backends[name].set_faults(unhealthy=False)
    assert wait_until(lambda: health_of(gateway, "h0")["healthy"] is True, timeout_s=5)
    assert set(served_by(gateway, 2)) <= {"h0", "h1"}


def start_pair(tmp_path: Path, prefix: str, settings: str) -> tuple[dict[str, Backend], Gateway]:
    """Backends `<prefix>0` and `<prefix>1` serving model `<prefix>m`, pool `<prefix>p` with
    `settings` (YAML lines: the pool's other keys), and a gateway in front."""
    started = start_backends(
        (f"{prefix}0", f"{prefix}1"), [f"{prefix}m"], "--ttft", "0", "--per-token", "0"
    )
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  {prefix}p:
    models: [{prefix}m]
    instances: [{instances_yaml(started)}]
{textwrap.indent(settings, "    ")}
"""
    try:
        return started, start_gateway(tmp_path / "policy.yaml", policy)
    except BaseException:
        stop_backends(started)
        raise


def test_a_request_that_times_out_brings_the_next_check_forward(tmp_path: Path) -> None:
    """A frozen instance (SIGSTOP: connections open, nothing answers) is known down from the
    checks a timed-out request asks for, every `fast_interval` while in doubt, long before the
    next round of a 60 s interval."""
    started, gw = start_pair(
        tmp_path,
        "q",
        "health: {interval: 60s, fast_interval: 100ms, timeout: 300ms, unhealthy_threshold: 2}\n"
        "timeouts: {initial: 300ms, floor: 300ms}",
    )
    frozen = started["q1"].proc
    try:
        assert health_of(gw, "q1", "qp")["healthy"] is True
        frozen.signal(signal.SIGSTOP)
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            body = {"model": "qm", "max_tokens": 2}
            # Until q1 has an attempt of its own, power of two choices costs it as q0 and a tie
            # goes to the first drawn: each request lands on q1 at even odds, times out there and
            # is retried on q0. Bounded: 30 misses in a row would be odds of 2^-30.
            replies = []
            for _ in range(30):
                replies.append(http.post("/v1/chat/completions", json=body))
                if replies[-1].headers.get("x-gateway-attempts") == "2":
                    break
        assert [r.status_code for r in replies] == [200] * len(replies)
        assert replies[-1].headers["x-gateway-attempts"] == "2"
        assert replies[-1].headers["x-gateway-instance"] == "q0"
        assert wait_until(lambda: health_of(gw, "q1", "qp")["healthy"] is False, timeout_s=30)
        assert health_of(gw, "q1", "qp")["reason"] == "no answer within 0.3s"
        assert health_of(gw, "q0", "qp")["healthy"] is True
    finally:
        frozen.signal(signal.SIGCONT)
        gw.stop()
        stop_backends(started)


def test_an_instance_healthy_again_is_costed_as_its_peers(tmp_path: Path) -> None:
    """What the balancer remembered of an instance before it went down (here a 3 s answer) is
    forgotten when its checks pass again: its estimate starts at its peers', so it gets its
    share at once instead of idling until a 3 s peak decays (tens of seconds)."""
    started, gw = start_pair(
        tmp_path,
        "s",
        "health: {interval: 200ms, timeout: 150ms, healthy_threshold: 1, unhealthy_threshold: 1}",
    )

    def peak_of(name: str) -> float:
        state = httpx.get(f"{gw.admin_url}/admin/state", timeout=5).json()
        (inst,) = [i for i in state["pools"]["sp"]["instances"] if i["name"] == name]
        return float(inst["peak_ewma_s"])

    try:
        started["s1"].set_faults(ttft=3.0)
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            body = {"model": "sm", "max_tokens": 2}
            # s1 has no answer of its own yet, so it is costed as s0: even odds each time.
            # Bounded: 30 misses in a row would be odds of 2^-30.
            for _ in range(30):
                reply = http.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200
                if reply.headers["x-gateway-instance"] == "s1":
                    break
        assert reply.headers["x-gateway-instance"] == "s1"
        assert peak_of("s1") > 2 * peak_of("s0")
        started["s1"].set_faults(unhealthy=True)
        assert wait_until(lambda: health_of(gw, "s1", "sp")["healthy"] is False, timeout_s=10)
        started["s1"].set_faults(unhealthy=False, ttft=0.0)
        assert wait_until(lambda: health_of(gw, "s1", "sp")["healthy"] is True, timeout_s=10)
        # Nothing was sent since: both estimates decayed alike from the same value.
        assert peak_of("s1") == pytest.approx(peak_of("s0"), rel=0.05)
    finally:
        gw.stop()
        stop_backends(started)


def test_an_instance_that_refuses_a_connection_leaves_rotation_at_once(tmp_path: Path) -> None:
    """Down is not an outlier. Of three instances an operator holds one out, which is all the
    isolation cap allows; then d1 is killed. Its breaker may not isolate it, and its checks
    would need five failures (four seconds or more), but the first refused connection takes it
    out of rotation: of the requests after the kill, one tried it. A restart on the same
    port brings it back through its checks."""
    started = start_backends(("d0", "d1", "d2"), ["dm"], "--ttft", "0", "--per-token", "0")
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  dp:
    models: [dm]
    instances: [{instances_yaml(started)}]
    health: {{interval: 1s, fast_interval: 1s, timeout: 300ms, unhealthy_threshold: 5}}
    breaker: {{slow_start: 0s}}  # back at even odds at once, not along a ramp
"""
    gw: Gateway | None = None
    try:
        gw = start_gateway(tmp_path / "policy.yaml", policy)
        url = f"{gw.admin_url}/admin/instances/dp/d2/isolate"
        assert httpx.post(url, timeout=5).json()["state"] == "ISOLATED"
        port = started["d1"].proc.port()
        started["d1"].proc.signal(signal.SIGKILL)
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            body = {"model": "dm", "max_tokens": 2}
            replies = [http.post("/v1/chat/completions", json=body) for _ in range(20)]
        assert [r.status_code for r in replies] == [200] * 20
        assert {r.headers["x-gateway-instance"] for r in replies} == {"d0"}
        # Each request that drew d1 went on to d0: one did, and d1 was out from then on.
        assert sum(int(r.headers["x-gateway-attempts"]) for r in replies) == 21
        health = health_of(gw, "d1", "dp")
        assert health["healthy"] is False
        state = httpx.get(f"{gw.admin_url}/admin/state", timeout=5).json()
        (d1,) = [i for i in state["pools"]["dp"]["instances"] if i["name"] == "d1"]
        assert d1["state"] == "ADMITTING"  # out by its health, not by its breaker

        started["d1"] = start_backend("d1", ["dm"], "--ttft", "0", "--per-token", "0", port=port)
        assert wait_until(lambda: health_of(gw, "d1", "dp")["healthy"] is True, timeout_s=30)
        # Back in rotation, at even odds with d0. Bounded: 30 misses would be odds of 2^-30.
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            for _ in range(30):
                reply = http.post("/v1/chat/completions", json={"model": "dm", "max_tokens": 2})
                assert reply.status_code == 200
                if reply.headers["x-gateway-instance"] == "d1":
                    break
        assert reply.headers["x-gateway-instance"] == "d1"
    finally:
        if gw is not None:
            gw.stop()
        stop_backends(started)
