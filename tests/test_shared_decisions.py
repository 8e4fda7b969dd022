"""Shared decisions end to end: gateway processes, one real redis-server, fake vLLM backends.

Several replicas agree on isolations and on who probes; Redis dying, pausing, restarting empty
or lying never fails a request.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.decision import Decision, decode
from loadtests.procs import wait_until
from loadtests.redis_server import RedisServer
from tests.support import (
    LOOPBACK_LISTENERS,
    Backend,
    Gateway,
    closed_port,
    instances_yaml,
    running_backends,
    start_gateway,
)

NAMES = ("a", "b", "c")
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PAUSE_S = 2.0  # how long Redis holds every command in the pause test


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(NAMES, ["m"], "--ttft", "0.02", "--per-token", "0.001")


@pytest.fixture(autouse=True)
def clean_backends(backends: dict[str, Backend]) -> None:
    for backend in backends.values():
        backend.reset()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def policy(
    redis_url: str,
    instances: str,
    breaker: str = "{consecutive_failures: 3, isolation: 30s, max_isolation: 60s}",
    ttl: str = "1s",
) -> str:
    return f"""
{LOOPBACK_LISTENERS}
shared: {{redis_url: "{redis_url}", key_prefix: it, decision_ttl: {ttl}}}
pools:
  chat:
    models: [m]
    instances: [{instances}]
    breaker: {breaker}
    health: {{interval: 500ms, timeout: 250ms}}
"""


class Replicas:
    """Gateway processes sharing one policy file's settings, named r0, r1, ..."""

    def __init__(self, tmp_path: Path, text: str, count: int, first: int = 0) -> None:
        self.gateways: list[Gateway] = []
        try:
            for i in range(first, first + count):
                env = {"GATEWAY_REPLICA_ID": f"r{i}"}
                self.gateways.append(start_gateway(tmp_path / f"r{i}.yaml", text, env))
        except BaseException:
            self.stop()
            raise

    def __getitem__(self, index: int) -> Gateway:
        return self.gateways[index]

    def stop(self) -> None:
        for gateway in self.gateways:
            gateway.stop()


@pytest.fixture
def replica_set(tmp_path: Path) -> Iterator[Callable[..., Replicas]]:
    started: list[Replicas] = []

    def start(text: str, count: int, first: int = 0) -> Replicas:
        replicas = Replicas(tmp_path, text, count, first)
        started.append(replicas)
        return replicas

    yield start
    for replicas in started:
        replicas.stop()


def state(gateway: Gateway) -> dict[str, Any]:
    response = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def instance(gateway: Gateway, name: str, pool: str = "chat") -> dict[str, Any]:
    found: dict[str, Any] = next(
        i for i in state(gateway)["pools"][pool]["instances"] if i["name"] == name
    )
    return found


def shows(gateway: Gateway, name: str, wanted: str, pool: str = "chat") -> bool:
    return bool(instance(gateway, name, pool)["state"] == wanted)


def operate(gateway: Gateway, name: str, action: str, pool: str = "chat") -> None:
    url = f"{gateway.admin_url}/admin/instances/{pool}/{name}/{action}"
    httpx.post(url, timeout=5).raise_for_status()


def metric(gateway: Gateway, name: str, **labels: str) -> float:
    """One sample of the admin plane's /metrics, parsed as Prometheus would."""
    text = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels} in:\n{text}")


def written_by(raw: bytes | str | None) -> str:
    """The replica that wrote a decision stored in Redis."""
    assert raw is not None
    return decode(raw).replica


def chat(gateway: Gateway) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=BODY, timeout=10)


@dataclass
class Sent:
    """One request of `drive`: which client sent it, its status (0: no answer), and when it was
    sent and answered (the test's event-loop clock)."""

    client: int
    status: int
    sent: float
    answered: float


@dataclass
class Traffic:
    """Results of `drive`: every request, the number of clients, and when each event's action
    started and ended (the test's event-loop clock)."""

    results: list[Sent] = field(default_factory=list)
    clients: int = 0
    events: list[tuple[float, float]] = field(default_factory=list)

    @property
    def failures(self) -> list[Sent]:
        return [r for r in self.results if r.status != 200]

    def clients_answered_between(self, start: float, end: float) -> set[int]:
        """The clients that got an answer, before `end`, to a request sent after `start`."""
        return {r.client for r in self.results if start <= r.sent and r.answered <= end}

    @property
    def every_client(self) -> set[int]:
        return set(range(self.clients))


async def drive(
    gateways: list[Gateway],
    duration_s: float,
    events: list[tuple[float, Callable[[], None]]] = (),  # type: ignore[assignment]
    per_gateway: int = 2,
    max_requests: int = 5000,
) -> Traffic:
    """Steady closed-loop traffic through the gateways for `duration_s` (bounded in count), from
    `per_gateway` clients each; at each `(t, action)`, run `action` in a thread, `t` seconds
    after the start."""
    traffic = Traffic()
    loop = asyncio.get_running_loop()
    start = loop.time()
    stop_at = start + duration_s

    async def worker(client: httpx.AsyncClient, url: str, number: int) -> None:
        while loop.time() < stop_at and len(traffic.results) < max_requests:
            sent = loop.time()
            try:
                response = await client.post(f"{url}/v1/chat/completions", json=BODY)
                status = response.status_code
            except httpx.HTTPError:
                status = 0
            traffic.results.append(Sent(number, status, sent, loop.time()))

    async def inject() -> None:
        for at, action in sorted(events, key=lambda e: e[0]):
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            began = loop.time()
            await asyncio.to_thread(action)
            traffic.events.append((began, loop.time()))

    urls = [gw.url for gw in gateways for _ in range(per_gateway)]
    traffic.clients = len(urls)
    async with httpx.AsyncClient(timeout=10) as client:
        await asyncio.gather(
            inject(), *(worker(client, url, number) for number, url in enumerate(urls))
        )
    return traffic


# -- agreement between replicas ---------------------------------------------------------------


def test_one_replica_isolates_and_every_replica_stops_routing_there(
    backends: dict[str, Backend],
    redis_server: RedisServer,
    replica_set: Callable[..., Replicas],
) -> None:
    r = replica_set(policy(redis_server.url, instances_yaml(backends)), 3)
    backends["b"].set_faults(error_rate=1.0, error_status=500)
    # Traffic through r0 only, until r0's breaker isolates b (3 failures; each retried).
    for _ in range(60):
        assert chat(r[0]).status_code == 200
        if shows(r[0], "b", "ISOLATED"):
            break
    assert shows(r[0], "b", "ISOLATED")
    # r1 and r2 learnt it from r0, without sending b anything.
    assert wait_until(lambda: shows(r[1], "b", "ISOLATED") and shows(r[2], "b", "ISOLATED"), 2)
    assert instance(r[1], "b")["decided_by"] == "r0"
    seen = len(backends["b"].requests())
    for _ in range(20):
        assert chat(r[1]).status_code == 200
        assert chat(r[2]).status_code == 200
    assert len(backends["b"].requests()) == seen
    # The operator restores b on r0: every replica routes to it again.
    backends["b"].reset()
    operate(r[0], "b", "restore")
    assert wait_until(lambda: shows(r[1], "b", "ADMITTING") and shows(r[2], "b", "ADMITTING"), 2)
    for _ in range(60):
        assert chat(r[1]).status_code == 200
        if backends["b"].requests():
            break
    assert backends["b"].requests(), "r1 sends b traffic again"


async def test_one_probe_at_a_time_across_replicas(
    backends: dict[str, Backend],
    redis_server: RedisServer,
    replica_set: Callable[..., Replicas],
) -> None:
    # b answers every request with a 504 after 0.3 s: each probe is visible as an interval.
    breaker = "{consecutive_failures: 2, isolation: 500ms, max_isolation: 500ms}"
    r = replica_set(policy(redis_server.url, instances_yaml(backends), breaker), 3)
    backends["b"].set_faults(hang_rate=1.0, hang_s=0.3)
    traffic = await drive(list(r.gateways), duration_s=5.0, per_gateway=3)
    assert not traffic.failures
    log = sorted(
        (q["started"], q["ended"] or time.time())
        for q in backends["b"].requests()
        if q["path"] == "/v1/chat/completions"
    )
    # The first requests went to b before anyone had isolated it; after that, only probes.
    first = log[0][0]
    probes = [q for q in log if q[0] > first + 1.2]
    assert len(probes) >= 3, log
    for (_, ended), (started, _) in itertools.pairwise(probes):
        assert started >= ended, f"two probes of b overlapped: {probes}"
    # Each replica alone would probe every ~0.8 s: three replicas, about three times as many.
    span = probes[-1][0] - probes[0][0]
    assert len(probes) <= span / 0.7 + 2, probes


def test_a_sidecars_verdict_reaches_the_central_gateway(
    backends: dict[str, Backend], redis_server: RedisServer, tmp_path: Path
) -> None:
    """A sidecar next to pod "a" and a central gateway in front of pods a, b, c use the same
    pool and instance names, as in policies/sidecar.yaml and policies/central.yaml."""
    shared = f'shared: {{redis_url: "{redis_server.url}", key_prefix: gw, decision_ttl: 1s}}'
    sidecar_text = f"""
{LOOPBACK_LISTENERS}
{shared}
pools:
  chat:
    models: [m]
    instances: [{{name: a, url: "{backends["a"].url}"}}]
    breaker: {{consecutive_failures: 3, isolation: 30s, max_isolation: 60s}}
"""
    central_text = f"""
{LOOPBACK_LISTENERS}
{shared}
pools:
  chat:
    models: [m]
    instances: [{instances_yaml(backends)}]
"""
    sidecar = start_gateway(
        tmp_path / "sidecar.yaml", sidecar_text, {"GATEWAY_REPLICA_ID": "pod-a"}
    )
    central = start_gateway(tmp_path / "central.yaml", central_text)
    try:
        backends["a"].set_faults(error_rate=1.0, error_status=503)
        for _ in range(10):
            chat(sidecar)
        # The sidecar never isolates its only instance: it relays the backend's own answers
        # and its pod stays in the Service (a bad model version everywhere must not take
        # every pod out). But it tells the others what it saw.
        assert shows(sidecar, "a", "ADMITTING")
        response = chat(sidecar)
        assert response.status_code == 503 and "x-gateway-error" not in response.headers
        assert httpx.get(f"{sidecar.url}/readyz", timeout=5).status_code == 200
        assert wait_until(lambda: shows(central, "a", "ISOLATED"), 2)
        assert instance(central, "a")["decided_by"] == "pod-a"
        seen = len(backends["a"].requests())
        for _ in range(20):
            assert chat(central).status_code == 200
            chat(sidecar)  # still failing there: the verdict is shared again, not left to fade
        sidecar_requests = 21 * 4  # each sidecar request above: the first try and 3 retries
        assert len(backends["a"].requests()) - seen <= sidecar_requests
        assert shows(central, "a", "ISOLATED")
        # The sidecar's pod recovers: its verdict fades, and the central gateway probes a back.
        backends["a"].set_faults(error_rate=0.0)
        assert chat(sidecar).status_code == 200
        assert wait_until(lambda: chat(central) and shows(central, "a", "ADMITTING"), 45)
    finally:
        sidecar.stop()
        central.stop()


# -- Redis faults -------------------------------------------------------------------------------


async def test_redis_killed_mid_traffic_costs_nothing(
    backends: dict[str, Backend],
    redis_server: RedisServer,
    replica_set: Callable[..., Replicas],
) -> None:
    r = replica_set(policy(redis_server.url, instances_yaml(backends)), 2)
    assert state(r[0])["shared_state"]["connected"]
    assert metric(r[0], "gateway_shared_state_connected") == 1.0
    traffic = await drive(list(r.gateways), duration_s=3.0, events=[(1.0, redis_server.kill)])
    assert len(traffic.results) > 20  # traffic flowed (how much: the machine's pace)
    assert not traffic.failures
    # Redis is never on the request path: once it was dead, every client still got answers to
    # new requests (a request waiting on a Redis call would hold its client back).
    ((_, killed),) = traffic.events
    assert traffic.clients_answered_between(killed, math.inf) == traffic.every_client
    shared = state(r[0])["shared_state"]
    assert shared["connected"] is False and shared["last_error"]
    assert shared["counters"]["connection_losses"] == 1
    assert metric(r[0], "gateway_shared_state_connected") == 0.0
    # Back: reconnected (the backoff is capped at ~1.5 s) without a restart.
    redis_server.start()
    assert wait_until(lambda: state(r[0])["shared_state"]["connected"], 5)


async def test_redis_paused_mid_traffic_costs_nothing(
    backends: dict[str, Backend],
    redis_server: RedisServer,
    replica_set: Callable[..., Replicas],
) -> None:
    r = replica_set(policy(redis_server.url, instances_yaml(backends)), 2)
    seen: list[bool] = []

    def pause() -> None:
        redis_server.pause(PAUSE_S)

    def look() -> None:
        seen.append(state(r[0])["shared_state"]["connected"])

    traffic = await drive(list(r.gateways), duration_s=3.5, events=[(0.5, pause), (1.5, look)])
    assert len(traffic.results) > 20  # traffic flowed (how much: the machine's pace)
    assert not traffic.failures
    assert seen == [False], "a paused Redis counts as lost"
    # Redis is never on the request path: while it held every command (from the moment the
    # pause was in force until it could have ended), every client sent requests and got their
    # answers. A request waiting on a Redis call would have held its client until the end.
    (asked, paused), _ = traffic.events
    held_until = asked + PAUSE_S
    assert traffic.clients_answered_between(paused, held_until) == traffic.every_client
    assert wait_until(lambda: state(r[0])["shared_state"]["connected"], 5)


def test_redis_restarted_empty_replicas_agree_again(
    backends: dict[str, Backend],
    redis_server: RedisServer,
    replica_set: Callable[..., Replicas],
) -> None:
    r = replica_set(policy(redis_server.url, instances_yaml(backends), ttl="3s"), 2)
    operate(r[0], "c", "isolate")
    assert wait_until(lambda: shows(r[1], "c", "ISOLATED"), 2)
    key = "it:decision:chat:c"
    client = redis_server.client()
    assert client.get(key) is not None
    redis_server.restart()  # empty: no decision, no lease
    client = redis_server.client()
    # The holder writes its isolation again once it has reconnected.
    assert wait_until(lambda: client.get(key) is not None, 10)
    assert written_by(client.get(key)) == "r0"
    # A replica started now learns it from Redis alone, and r1 agrees.
    late = replica_set(policy(redis_server.url, instances_yaml(backends), ttl="3s"), 1, 2)[0]
    assert wait_until(lambda: shows(late, "c", "ISOLATED") and shows(r[1], "c", "ISOLATED"), 10)
    assert instance(late, "c")["decided_by"] == "r0"
    # Flushed without a restart: the holder writes it back at its next renewal (TTL / 3).
    client.flushall()
    assert wait_until(lambda: client.get(key) is not None, 10)
    assert written_by(client.get(key)) == "r0"


def test_forged_decisions_cannot_isolate_more_than_the_cap(
    backends: dict[str, Backend],
    redis_server: RedisServer,
    replica_set: Callable[..., Replicas],
) -> None:
    breaker = "{max_isolated_fraction: 0.34}"  # 3 instances: at most one out
    r = replica_set(policy(redis_server.url, instances_yaml(backends), breaker), 1)
    client = redis_server.client()
    wall = time.time()
    for name in NAMES:
        forged = Decision("chat", name, "ISOLATED", "forged", "intruder", wall, None, True)
        client.set(f"it:decision:chat:{name}", forged.encode(), px=60_000)
        client.publish("it:decisions", forged.encode())
    client.publish("it:decisions", b'{"v": 1, "state": "OPEN"}')
    assert wait_until(lambda: state(r[0])["shared_state"]["counters"]["suppressed"] >= 2, 3)
    states = [instance(r[0], name)["state"] for name in NAMES]
    assert states.count("ISOLATED") == 1 and states.count("ADMITTING") == 2
    assert state(r[0])["shared_state"]["counters"]["malformed"] >= 1
    assert metric(r[0], "gateway_shared_decisions_total", event="suppressed") >= 2
    isolated = [
        metric(r[0], "gateway_instance_state", backend=name, state="ISOLATED") for name in NAMES
    ]
    assert sorted(isolated) == [0.0, 0.0, 1.0]
    for _ in range(10):
        assert chat(r[0]).status_code == 200


def test_a_gateway_serves_without_ever_reaching_redis(
    backends: dict[str, Backend], replica_set: Callable[..., Replicas]
) -> None:
    r = replica_set(policy(f"redis://127.0.0.1:{closed_port()}/0", instances_yaml(backends)), 1)
    for _ in range(10):
        assert chat(r[0]).status_code == 200
    shared = state(r[0])["shared_state"]
    assert shared["configured"] is True and shared["connected"] is False
    assert "Connection" in shared["last_error"] or "Error" in shared["last_error"]
    assert "cannot reach" in r[0].proc.output()
