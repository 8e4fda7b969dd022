"""Instances discovered through DNS, against a real DNS server (dnsmasq) on loopback.

The source alone first (A, AAAA, SRV, NXDOMAIN, a dead resolver), then a real gateway whose pool
lists no instance: fake vLLM backends on 127.0.0.2, .3, ... share one port, as pods behind a
headless Service share their container port, and the records say which of them serve.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from gateway.config import parse_policy
from gateway.config.models import DnsDiscoveryPolicy
from gateway.core.discovery import from_addresses
from gateway.upstream.dns_records import DnsError, DnsSource
from gateway.upstream.health import HealthChecker
from gateway.upstream.registry import Registry
from loadtests.asgi_server import Recorder, ThreadedServer
from loadtests.dnsmasq import DnsServer
from loadtests.ports import hold_port
from loadtests.procs import wait_until
from tests.support import LOOPBACK_LISTENERS, Backend, Gateway, gateways, start_backend

NAME = "vllm.test"


@pytest.fixture
def dns_server(tmp_path: Path) -> Iterator[DnsServer]:
    server = DnsServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def _source(server: DnsServer | None, **policy: Any) -> DnsSource:
    policy.setdefault("nameservers", [server.address] if server else [])
    policy.setdefault("timeout", 0.5)
    return DnsSource(DnsDiscoveryPolicy(**policy))


# -- the source against the server ---------------------------------------------------------------


async def test_a_and_aaaa_records_become_instances_named_by_address(
    dns_server: DnsServer,
) -> None:
    dns_server.set_hosts({NAME: ["127.0.0.3", "127.0.0.2", "fd00::7"]})
    endpoints, ttl = await _source(dns_server, name=NAME, port=8000).resolve()
    assert [(e.name, e.url()) for e in endpoints] == [
        ("127.0.0.2-8000", "http://127.0.0.2:8000"),
        ("127.0.0.3-8000", "http://127.0.0.3:8000"),
        ("fd00--7-8000", "http://[fd00::7]:8000"),
    ]
    assert ttl == dns_server.ttl_s


async def test_unknown_name_is_an_empty_answer_not_an_error(dns_server: DnsServer) -> None:
    assert await _source(dns_server, name="gone.test", port=8000).resolve() == ([], None)


async def test_srv_records_name_instances_by_target_and_use_the_answer_addresses(
    dns_server: DnsServer,
) -> None:
    dns_server.set_srv(
        "_http._tcp.vllm.test",
        [("pod-a.vllm.test", 8001, "127.0.0.5"), ("pod-b.vllm.test", 8002, "127.0.0.6")],
    )
    endpoints, ttl = await _source(dns_server, name="_http._tcp.vllm.test", type="SRV").resolve()
    assert [(e.name, e.url()) for e in endpoints] == [
        ("pod-a", "http://127.0.0.5:8001"),
        ("pod-b", "http://127.0.0.6:8002"),
    ]
    assert ttl == dns_server.ttl_s


async def test_a_resolver_that_does_not_answer_is_an_error(dns_server: DnsServer) -> None:
    dns_server.set_hosts({NAME: ["127.0.0.2"]})
    source = _source(dns_server, name=NAME, port=8000)
    dns_server.pause()
    try:
        with pytest.raises(DnsError, match="timed out"):
            await source.resolve()
    finally:
        dns_server.resume()
    assert [e.name for e in (await source.resolve())[0]] == ["127.0.0.2-8000"]


async def test_a_refused_query_is_an_error() -> None:
    hold = hold_port()  # bound, never answering: the query is refused at once
    try:
        source = _source(None, name=NAME, port=8000, nameservers=[f"127.0.0.1:{hold.port}"])
        with pytest.raises(DnsError):
            await source.resolve()
    finally:
        hold.close()


# -- a gateway following the records -------------------------------------------------------------


class Fleet:
    """Fake vLLMs on 127.0.0.N, all on one port (held on 127.0.0.1 for the test's length)."""

    def __init__(self) -> None:
        self._hold = hold_port()
        self.port = self._hold.port
        self.backends: dict[str, Backend] = {}

    def host(self, n: int) -> str:
        return f"127.0.0.{n}"

    def name(self, n: int) -> str:
        return f"127.0.0.{n}-{self.port}"

    def start(self, *numbers: int, extra: tuple[str, ...] = ()) -> None:
        for n in numbers:
            if n not in self.backends:
                self.backends[self.host(n)] = start_backend(
                    f"b{n}", ["m"], *extra, port=self.port, host=self.host(n)
                )

    def served(self, n: int) -> int:
        """Requests the backend on 127.0.0.N has ended."""
        return len(self.backends[self.host(n)].requests())

    def stop(self, *numbers: int) -> None:
        for n in numbers:
            backend = self.backends.pop(self.host(n), None)
            if backend is not None:
                backend.proc.stop()

    def close(self) -> None:
        try:
            for backend in self.backends.values():
                backend.proc.stop()
        finally:
            self._hold.close()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    fleet = Fleet()
    try:
        yield fleet
    finally:
        fleet.close()


def _policy(server: DnsServer, fleet: Fleet, extra: str = "") -> str:
    return f"""
{LOOPBACK_LISTENERS}
pools:
  chat:
    models: [m]
    discovery:
      dns: {{name: {NAME}, port: {fleet.port}, interval: 1s, timeout: 500ms,
            nameservers: ["{server.address}"]}}
      grace: 4s
    health: {{interval: 1s, timeout: 500ms}}
{extra}
"""


def _state(gateway: Gateway) -> dict[str, Any]:
    pool: dict[str, Any] = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()["pools"][
        "chat"
    ]
    return pool


def _healthy(gateway: Gateway) -> set[str]:
    return {i["name"] for i in _state(gateway)["instances"] if i["health"]["healthy"]}


def _ask(gateway: Gateway, stream: bool = False) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if stream:
        body["stream"] = True
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)


class Load:
    """Four clients asking the gateway in a loop (half streams, half whole answers) until the
    block ends (bounded: 120 s at most), each result (status, complete) recorded."""

    def __init__(self, gateway: Gateway, clients: int = 4) -> None:
        self.gateway = gateway
        self.results: list[tuple[int, bool]] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(clients)
        self._clients = clients

    def _client(self, stream: bool) -> None:
        deadline = time.monotonic() + 120
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                response = _ask(self.gateway, stream=stream)
                complete = response.status_code == 200 and (
                    not stream or response.text.rstrip().endswith("data: [DONE]")
                )
                self.results.append((response.status_code, complete))
            except httpx.HTTPError:
                self.results.append((0, False))

    def __enter__(self) -> Load:
        for index in range(self._clients):
            self._pool.submit(self._client, index % 2 == 0)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)


@pytest.fixture
def gateway_of(tmp_path: Path) -> Iterator[Any]:
    with gateways(tmp_path / "policy.yaml") as start:
        yield start


def test_instances_follow_the_records_and_those_that_stay_keep_their_state(
    dns_server: DnsServer, fleet: Fleet, gateway_of: Any
) -> None:
    fleet.start(2, 3, 4)
    dns_server.set_hosts({NAME: ["127.0.0.2", "127.0.0.3"]})
    gateway = gateway_of(_policy(dns_server, fleet))
    a, b, c = fleet.name(2), fleet.name(3), fleet.name(4)
    wait_until(lambda: _healthy(gateway) == {a, b}, timeout_s=20)
    for _ in range(10):
        assert _ask(gateway).status_code == 200
    # An operator's isolation is state the instance keeps while its record stays.
    isolate = f"{gateway.admin_url}/admin/instances/chat/{a}/isolate"
    assert httpx.post(isolate, timeout=5).status_code == 200
    before = {i["name"]: i for i in _state(gateway)["instances"]}
    assert before[a]["forced"] and before[a]["requests"] > 0

    dns_server.set_hosts({NAME: ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
    wait_until(lambda: _healthy(gateway) == {a, b, c}, timeout_s=20)
    state = _state(gateway)
    after = {i["name"]: i for i in state["instances"]}
    assert after[a]["forced"] and after[a]["state"] == "ISOLATED"
    assert after[a]["requests"] >= before[a]["requests"]
    assert after[b]["ewma"]["ttfb"]["samples"] >= before[b]["ewma"]["ttfb"]["samples"] > 0
    assert state["discovery"]["source"] == "dns"
    assert state["discovery"]["instances"] == [a, b, c]
    assert state["discovery"]["last_error"] is None
    served_c = fleet.served(4)
    for _ in range(10):
        assert _ask(gateway).status_code == 200
    assert fleet.served(4) > served_c  # the new instance takes traffic

    # .2 leaves the records: it gets nothing more, the others serve.
    dns_server.set_hosts({NAME: ["127.0.0.3", "127.0.0.4"]})
    wait_until(lambda: {i["name"] for i in _state(gateway)["instances"]} == {b, c}, timeout_s=20)
    served_a = fleet.served(2)
    for _ in range(10):
        assert _ask(gateway).status_code == 200
    assert fleet.served(2) == served_a
    metrics = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
    assert 'gateway_discovery_instances{pool="chat",source="dns"} 2.0' in metrics
    assert 'gateway_discovery_changes_total{pool="chat",source="dns"} 3.0' in metrics


def test_a_dns_outage_changes_nothing_and_an_empty_answer_waits_for_its_grace(
    dns_server: DnsServer, fleet: Fleet, gateway_of: Any
) -> None:
    fleet.start(2, 3)
    dns_server.set_hosts({NAME: ["127.0.0.2", "127.0.0.3"]})
    gateway = gateway_of(_policy(dns_server, fleet))
    both = {fleet.name(2), fleet.name(3)}
    wait_until(lambda: _healthy(gateway) == both, timeout_s=20)

    dns_server.pause()
    try:
        wait_until(lambda: _state(gateway)["discovery"]["errors"] >= 2, timeout_s=20)
        state = _state(gateway)
        assert "timed out" in state["discovery"]["last_error"]
        assert {i["name"] for i in state["instances"]} == both
        assert all(_ask(gateway).status_code == 200 for _ in range(10))
        metrics = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
        assert 'gateway_discovery_errors_total{pool="chat",source="dns"}' in metrics
    finally:
        dns_server.resume()
    wait_until(lambda: _state(gateway)["discovery"]["last_error"] is None, timeout_s=20)

    # The name disappears: not believed at first, the set stays while answers are empty (read
    # in the same state that shows the empty answers pending)...
    dns_server.set_hosts({})
    pending: list[dict[str, Any]] = []

    def empty_pending() -> bool:
        state = _state(gateway)
        if state["discovery"]["empty_since"] is None:
            return False
        pending.append(state)
        return True

    wait_until(empty_pending, timeout_s=20)
    assert {i["name"] for i in pending[0]["instances"]} == both
    # ...then believed once it lasted the grace: the pool is empty and says so.
    wait_until(lambda: _state(gateway)["instances"] == [], timeout_s=30)
    response = _ask(gateway)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_instance_available"
    # Known empty (a Deployment scaled to zero): every replica sees the same, so it does not
    # turn this one not-ready (with other pools, their models would go too).
    ready = httpx.get(f"{gateway.url}/readyz", timeout=5)
    assert ready.status_code == 200 and ready.json()["pools"] == {"chat": True}
    # Records back: the pool serves again.
    dns_server.set_hosts({NAME: ["127.0.0.2"]})
    wait_until(lambda: _healthy(gateway) == {fleet.name(2)}, timeout_s=20)
    assert _ask(gateway).status_code == 200


def test_no_request_fails_while_the_pool_scales_from_2_to_6_and_back(
    dns_server: DnsServer, fleet: Fleet, gateway_of: Any
) -> None:
    """Under load (streams and whole answers), records for 4 more backends appear, then go
    again and those backends are stopped (SIGTERM: they finish what they run), as pods of a
    Deployment scaled up then down."""
    fleet.start(*range(2, 8), extra=("--per-token", "0.01"))
    dns_server.set_hosts({NAME: ["127.0.0.2", "127.0.0.3"]})
    gateway = gateway_of(_policy(dns_server, fleet))
    wait_until(lambda: _healthy(gateway) == {fleet.name(2), fleet.name(3)}, timeout_s=20)

    with Load(gateway) as load:
        results = load.results
        wait_until(lambda: len(results) >= 20, timeout_s=60)
        everyone = [f"127.0.0.{n}" for n in range(2, 8)]
        dns_server.set_hosts({NAME: everyone})
        six = {fleet.name(n) for n in range(2, 8)}
        wait_until(lambda: _healthy(gateway) == six, timeout_s=30)
        wait_until(lambda: all(fleet.served(n) > 0 for n in range(4, 8)), timeout_s=30)
        dns_server.set_hosts({NAME: ["127.0.0.2", "127.0.0.3"]})
        two = {fleet.name(2), fleet.name(3)}
        wait_until(lambda: {i["name"] for i in _state(gateway)["instances"]} == two, timeout_s=30)
        fleet.stop(4, 5, 6, 7)
        count = len(results)
        wait_until(lambda: len(results) >= count + 20, timeout_s=60)
    assert len(results) >= 60
    assert [r for r in results if r != (200, True)] == []


def test_reloads_add_change_and_remove_discovery_beside_listed_instances(
    dns_server: DnsServer, fleet: Fleet, gateway_of: Any, tmp_path: Path
) -> None:
    """A listed instance stays through every reload; discovery added finds its instances, a
    changed name keeps the old ones until the new name answers, removed drops what it found."""
    fleet.start(2, 3, 4)
    listed = fleet.backends[fleet.host(2)]
    head = f"""
{LOOPBACK_LISTENERS}
pools:
  chat:
    models: [m]
    instances: [{{name: listed, url: "{listed.url}"}}]
    health: {{interval: 1s, timeout: 500ms}}
"""
    gateway = gateway_of(head)
    wait_until(lambda: _healthy(gateway) == {"listed"}, timeout_s=20)

    def reload(text: str) -> None:
        (tmp_path / "policy.yaml").write_text(text)
        response = httpx.post(f"{gateway.admin_url}/admin/reload", timeout=10)
        assert response.status_code == 200, response.text

    def discovery(name: str) -> str:
        return f"""    discovery:
      dns: {{name: {name}, port: {fleet.port}, interval: 1s, timeout: 500ms,
            nameservers: ["{dns_server.address}"]}}
"""

    dns_server.set_hosts({NAME: ["127.0.0.3"], "other.test": ["127.0.0.4"]})
    reload(head + discovery(NAME))
    wait_until(lambda: _healthy(gateway) == {"listed", fleet.name(3)}, timeout_s=20)
    requests_before = {i["name"]: i["requests"] for i in _state(gateway)["instances"]}

    dns_server.pause()  # the new name cannot answer yet: what was found stays meanwhile
    try:
        reload(head + discovery("other.test"))
        wait_until(lambda: _state(gateway)["discovery"]["errors"] >= 1, timeout_s=20)
        state = _state(gateway)
        assert {i["name"] for i in state["instances"]} == {"listed", fleet.name(3)}
        assert state["discovery"]["target"] == "A other.test"
    finally:
        dns_server.resume()
    wait_until(lambda: _healthy(gateway) == {"listed", fleet.name(4)}, timeout_s=20)
    kept = {i["name"]: i["requests"] for i in _state(gateway)["instances"]}
    assert kept["listed"] >= requests_before["listed"]  # the listed instance kept its state

    reload(head)
    wait_until(lambda: {i["name"] for i in _state(gateway)["instances"]} == {"listed"}, 20)
    assert _state(gateway)["discovery"] is None
    assert all(_ask(gateway).status_code == 200 for _ in range(5))


def test_a_gateway_started_while_dns_is_down_serves_once_it_answers(
    dns_server: DnsServer, fleet: Fleet, gateway_of: Any
) -> None:
    fleet.start(2)
    dns_server.set_hosts({NAME: ["127.0.0.2"]})
    dns_server.pause()
    try:
        gateway = gateway_of(_policy(dns_server, fleet))  # starts: its wait is bounded
        state = _state(gateway)
        assert state["instances"] == [] and state["discovery"]["errors"] >= 1
        assert httpx.get(f"{gateway.url}/readyz", timeout=5).status_code == 503
        response = _ask(gateway)
        assert response.status_code == 503
        assert response.json()["error"]["type"]
    finally:
        dns_server.resume()
    wait_until(lambda: _healthy(gateway) == {fleet.name(2)}, timeout_s=20)
    assert httpx.get(f"{gateway.url}/readyz", timeout=5).status_code == 200
    assert _ask(gateway).status_code == 200


# -- what a change leaves alone ------------------------------------------------------------------


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def test_discovery_changes_leave_the_checks_of_the_instances_that_stay_running() -> None:
    """Changes coming faster than the health interval (a DNS server answering random subsets,
    a rollout) must not restart the checks of instances that stay: each is checked on."""
    recorder = Recorder(_ok)
    server = ThreadedServer(recorder)
    try:
        policy = parse_policy(
            f"""
pools:
  chat:
    models: [m]
    instances: [{{name: stays, url: "http://127.0.0.1:{server.port}/stays"}}]
    discovery: {{dns: {{name: {NAME}, port: 9, nameservers: ["127.0.0.1:9"]}}}}
    health: {{interval: 300ms, timeout: 200ms, fast_interval: 300ms}}
"""
        )
        loop = asyncio.get_running_loop()
        registry = Registry(policy, loop.time())
        (pool,) = registry.pools.values()
        assert pool.found is not None
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(registry, session, loop.time)
            await checker.first_round()
            checker.start()
            try:

                def checks() -> int:
                    return sum(r["path"] == "/stays/health" for r in recorder.requests)

                seen = checks()
                for turn in range(400):  # bounded; each turn changes the pool
                    if checks() >= seen + 3:
                        break
                    address = f"127.0.0.{2 + turn % 2}"
                    pool.found.answered(loop.time(), from_addresses([address], 9))
                    added = pool.rediscovered(loop.time(), keep_gone=True)
                    pool.rediscovered(loop.time())
                    assert len(added) == 1
                    checker.follow_pool(pool)
                    await asyncio.sleep(0.05)
                assert checks() >= seen + 3
            finally:
                await checker.close()
    finally:
        server.stop()


async def test_a_second_nameserver_answers_when_the_first_does_not(dns_server: DnsServer) -> None:
    dns_server.set_hosts({NAME: ["127.0.0.2"]})
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    silent.bind(("127.0.0.1", 0))
    try:
        dead = f"127.0.0.1:{silent.getsockname()[1]}"
        servers = [dead, dns_server.address]
        source = _source(None, name=NAME, port=8000, timeout=2.0, nameservers=servers)
        endpoints, _ = await source.resolve()
        assert [e.name for e in endpoints] == ["127.0.0.2-8000"]
    finally:
        silent.close()
