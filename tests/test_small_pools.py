"""Small pools are never worse off through the gateway than going direct, with the defaults.

Each shape runs the same requests direct (round robin, no retries) and through a gateway whose
policy names only the pool's models and instances, interleaved on the same backends, and
compares the success rates of the two in the same run.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.procs import wait_until
from tests.support import (
    LOOPBACK_LISTENERS,
    Backend,
    Gateway,
    closed_port,
    instances_yaml,
    pool_policy,
    post_in_parallel,
    start_backend,
    start_gateway,
    stop_backends,
)

FAST = ("--ttft", "0.005", "--per-token", "0.0005")


def body(i: int) -> dict[str, Any]:
    """Half streamed, half not."""
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"request {i}"}],
        "max_tokens": 8,
        "stream": i % 2 == 0,
    }


def succeeded(http: httpx.Client, url: str, payload: dict[str, Any]) -> bool:
    """A whole answer: 200 with its JSON, or a stream with no error event ending in [DONE]."""
    try:
        reply = http.post(url + "/v1/chat/completions", json=payload)
    except httpx.HTTPError:
        return False
    if reply.status_code != 200:
        return False
    if not payload["stream"]:
        return "choices" in reply.json()
    events = [line for line in reply.text.splitlines() if line.startswith("data: ")]
    return bool(events) and events[-1] == "data: [DONE]" and '"error"' not in reply.text


def instance_state(gateway: Gateway, name: str, pool: str = "chat") -> dict[str, Any]:
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
    (inst,) = [i for i in state["pools"][pool]["instances"] if i["name"] == name]
    result: dict[str, Any] = inst
    return result


def run_side_by_side(
    gateway: Gateway,
    backends: Callable[[], list[Backend]],
    requests: int,
    at_request: Callable[[int], None] = lambda i: None,
) -> tuple[float, float]:
    """`requests` pairs: one direct (round robin over what `backends()` lists), one through the
    gateway; `at_request(i)` runs before pair i (faults on a timeline). Success rates."""
    direct_ok = gateway_ok = 0
    with httpx.Client(timeout=30) as http:
        for i in range(requests):
            at_request(i)
            pool = backends()
            direct_ok += succeeded(http, pool[i % len(pool)].url, body(i))
            gateway_ok += succeeded(http, gateway.url, body(i))
    return direct_ok / requests, gateway_ok / requests


# -- one instance answering 20 % of its requests with 503: a sidecar next to a flaky pod ------


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[Backend, Gateway]]:
    backend = start_backend("only", ["m"], *FAST, "--seed", "3")
    gateway: Gateway | None = None
    try:
        gateway = start_gateway(tmp_path / "policy.yaml", pool_policy({"only": backend}))
        yield backend, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        backend.stop()


def test_a_flaky_sidecar_is_retried_not_ejected(sidecar: tuple[Backend, Gateway]) -> None:
    backend, gateway = sidecar
    backend.set_faults(error_rate=0.2, error_status=503)
    direct, through = run_side_by_side(gateway, lambda: [backend], 200)
    print(f"flaky sidecar: direct {direct:.1%}, gateway {through:.1%}")
    assert through >= direct
    assert through >= 0.95
    # Its only instance was never isolated, and the pod stayed in its Service all along.
    only = instance_state(gateway, "only")
    assert only["state"] == "ADMITTING" and only["isolations"] == 0
    assert httpx.get(f"{gateway.url}/readyz", timeout=5).status_code == 200


def test_a_sidecar_whose_backend_fails_everything_stays_ready_while_it_answers(
    sidecar: tuple[Backend, Gateway],
) -> None:
    backend, gateway = sidecar
    backend.set_faults(error_rate=1.0, error_status=500)
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        replies = [http.post("/v1/chat/completions", json=body(1)) for _ in range(30)]
        # The backend's own answer is relayed (not a 503 of the gateway's making).
        assert {r.status_code for r in replies} == {500}
        assert all("x-gateway-error" not in r.headers for r in replies)
        # A partial (here total) error rate is no reason to leave the Service: only a
        # backend that is really down is.
        assert http.get("/readyz").status_code == 200
        assert instance_state(gateway, "only")["state"] == "ADMITTING"
        backend.set_faults(unhealthy=True)
        assert wait_until(lambda: http.get("/readyz").status_code == 503, timeout_s=15)


# -- two instances: a answers 30 % with 503 throughout, b is killed for a third of the run -----


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[dict[str, Backend], Gateway]]:
    backends = {
        "a": start_backend("a", ["m"], *FAST, "--seed", "5"),
        "b": start_backend("b", ["m"], *FAST, "--seed", "6"),
    }
    gateway: Gateway | None = None
    try:
        gateway = start_gateway(tmp_path / "policy.yaml", pool_policy(backends))
        yield backends, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        stop_backends(backends)


def test_a_flaky_instance_and_a_dead_one_keep_serving(
    pair: tuple[dict[str, Backend], Gateway],
) -> None:
    backends, gateway = pair
    backends["a"].set_faults(error_rate=0.3, error_status=503)
    port = backends["b"].proc.port()
    requests = 300

    def timeline(i: int) -> None:
        if i == requests // 3:
            backends["b"].stop()
        elif i == 2 * requests // 3:
            backends["b"] = start_backend("b", ["m"], *FAST, "--seed", "6", port=port)

    direct, through = run_side_by_side(
        gateway, lambda: [backends["a"], backends["b"]], requests, timeline
    )
    print(f"flaky pair: direct {direct:.1%}, gateway {through:.1%}")
    assert through >= direct
    assert through >= 0.95


# -- a fresh instance joining a warm pool is timed from its peers, not from the static 30 s ---


def test_a_fresh_instance_in_a_warm_pool_is_rescued_from_a_hang(tmp_path: Path) -> None:
    backends = {name: start_backend(name, ["m"], *FAST) for name in ("a", "b", "c")}
    backends["c"].set_faults(unhealthy=True)  # still loading its model
    gateway = start_gateway(
        tmp_path / "policy.yaml",
        # Without hedging, which would rescue these requests before any timeout.
        pool_policy(backends, "health: {interval: 200ms, timeout: 150ms}\nhedging: false"),
    )
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            # Warm: a and b learn their figures (10 samples each).
            warming = [dict(body(i), stream=True) for i in range(40)]
            assert post_in_parallel(gateway.url, warming) == [200] * 40
            warm = [instance_state(gateway, name) for name in ("a", "b")]
            assert all(s["ewma"]["ttfb"]["samples"] >= 10 for s in warm)
            pool_ttfb_s = max(s["ewma"]["ttfb"]["mean_s"] for s in warm)

            # c comes up, and hangs every request.
            backends["c"].set_faults(unhealthy=False, hang_rate=1.0)
            assert wait_until(
                lambda: instance_state(gateway, "c")["health"]["healthy"] is True, timeout_s=10
            )
            fresh = instance_state(gateway, "c")
            assert fresh["ewma"]["ttfb"]["samples"] == 0
            # Timed from the pool (three times its peers' figures, at the 0.25 s floor here),
            # not from the static `timeouts.initial` of 30 s.
            first_byte_s = fresh["timeouts"]["stream_first_byte_s"]
            print(f"fresh instance: first byte {first_byte_s:.3f} s, peers {pool_ttfb_s:.3f} s")
            assert first_byte_s < 30.0 / 10

            rescued = 0
            for i in range(30):
                reply = http.post("/v1/chat/completions", json=dict(body(i), stream=True))
                assert reply.status_code == 200
                if reply.headers["x-gateway-attempts"] != "1":
                    rescued += 1
                    assert reply.headers["x-gateway-instance"] in ("a", "b")
            assert rescued >= 1
            hung = instance_state(gateway, "c")
            timeouts = {(t["phase"], t["blamed"]): t["count"] for t in hung["timeouts_by_phase"]}
            assert timeouts.get(("first_byte", True), 0) == rescued
    finally:
        gateway.stop()
        stop_backends(backends)


# -- panic: nothing healthy, yet something answers --------------------------------------------


def test_a_pool_that_answers_nothing_is_tried_then_refused_and_one_that_answers_is_served(
    tmp_path: Path,
) -> None:
    backends = {"p0": start_backend("p0", ["m", "dead"], *FAST)}
    backends["p0"].set_faults(unhealthy=True)  # its /health fails, its requests do not
    dead = f'{{name: gone, url: "http://127.0.0.1:{closed_port()}"}}'
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  chat:
    models: [m]
    instances: [{instances_yaml(backends)}]
  dead:
    models: [dead]
    instances: [{dead}]
"""
    gateway = start_gateway(tmp_path / "policy.yaml", policy)
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            served = http.post("/v1/chat/completions", json=body(1))
            assert served.status_code == 200 and served.headers["x-gateway-instance"] == "p0"
            refused = http.post("/v1/chat/completions", json=dict(body(1), model="dead"))
            assert refused.status_code == 503
            assert refused.headers["x-gateway-error"] == "no_instance_available"
            assert int(refused.headers["retry-after"]) >= 1
            assert json.loads(refused.text)["error"]["code"] == "no_instance_available"
            # Tried once (a restarted pod may be back before its next check), refused at once.
            assert refused.headers.get("x-gateway-attempts") == "1"
    finally:
        gateway.stop()
        stop_backends(backends)


def test_a_retry_leaves_an_instance_that_let_it_time_out_for_an_isolated_one(
    pair: tuple[dict[str, Backend], Gateway],
) -> None:
    backends, gateway = pair
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        for i in range(40):  # both learn their pace (a hang is then given up on in seconds)
            assert http.post("/v1/chat/completions", json=body(i)).status_code == 200
        backends["a"].reset()
        # b is isolated by its operator; a is the only instance admitting, and it hangs.
        isolate = f"{gateway.admin_url}/admin/instances/chat/b/isolate"
        httpx.post(isolate, timeout=5).raise_for_status()
        backends["a"].set_faults(hang_rate=1.0)
        reply = http.post("/v1/chat/completions", json=body(1))
        # Asking a again would hang again: the retry went to b, which answers.
        assert reply.status_code == 200
        assert reply.headers["x-gateway-instance"] == "b"
        assert reply.headers["x-gateway-attempts"] == "2"
        assert [r["outcome"] for r in backends["a"].requests(wait_for=1)] == ["cancelled"]


# -- a pool of two gone gray: one instance 50x slow, the other frozen ------------------------


def test_a_slow_instance_and_a_frozen_one_serve_through_the_slow_one(
    pair: tuple[dict[str, Backend], Gateway],
) -> None:
    """Whichever runs out of time first, the frozen one ends up out (the slow one, answering
    retries, is let back in its place, or the frozen one's checks fail first) and every request
    is served by the slow one. Direct, half of them would hang on the frozen one."""
    backends, gateway = pair
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        for i in range(30):  # both learn their pace
            assert http.post("/v1/chat/completions", json=body(i)).status_code == 200
        backends["a"].set_faults(slow_factor=50)
        frozen = backends["b"].proc
        frozen.signal(signal.SIGSTOP)
        try:
            results = [succeeded(http, gateway.url, body(i)) for i in range(30)]
            b = instance_state(gateway, "b")
            a = instance_state(gateway, "a")
        finally:
            frozen.signal(signal.SIGCONT)
    print(f"slow and frozen: {sum(results)}/30 served; a {a['state']}, b {b['state']}")
    # Direct, every other request would hang on b. The first one or two after both turned may
    # spend their attempts before the gateway can tell which is which.
    assert sum(results) >= 27
    # b cannot take traffic; a can (or, b out by its health checks, is the least bad one left).
    assert b["state"] == "ISOLATED" or b["health"]["healthy"] is False
    assert a["state"] == "ADMITTING" or b["state"] != "ISOLATED"
