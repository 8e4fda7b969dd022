"""Instances discovered from Kubernetes EndpointSlices, against a local API server speaking the
real list-and-watch protocol (`loadtests.fake_kube_api`): the source alone (conditions, bookmarks,
410 Gone and relist, dropped watches, refusals), then a real gateway following a Service while
it scales, its endpoints terminate and its API goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.config.models import KubernetesDiscoveryPolicy
from gateway.core.discovery import Endpoint
from gateway.upstream.endpoint_slices import EndpointSliceSource
from loadtests.fake_kube_api import FakeKubeApi, endpoint
from loadtests.procs import wait_until
from loadtests.redis_server import RedisServer
from tests.support import LOOPBACK_LISTENERS, gateways, start_gateway
from tests.test_discovery_dns import Fleet, Load, _ask, _healthy, _state

NS = "models"
PORTS = [{"name": "http", "port": 8000, "protocol": "TCP"}]


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    backends = Fleet()
    try:
        yield backends
    finally:
        backends.close()


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKubeApi]:
    fake = FakeKubeApi(bookmark_interval_s=0.2).start()
    try:
        # The client configures itself as it would outside a cluster: from KUBECONFIG.
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig", NS)))
        yield fake
    finally:
        fake.stop()


class Watcher:
    """An EndpointSliceSource running in this loop, its answers and errors recorded."""

    def __init__(self, **policy: Any) -> None:
        policy.setdefault("service", "vllm")
        self.source = EndpointSliceSource(KubernetesDiscoveryPolicy(**policy))
        self.answers: list[list[str]] = []
        self.errors: list[str] = []
        self.task: asyncio.Task[None] | None = None

    async def _answered(self, endpoints: Sequence[Endpoint]) -> None:
        self.answers.append([f"{e.name}={e.host}:{e.port}" for e in endpoints])

    def _failed(self, error: str) -> None:
        self.errors.append(error)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.task = loop.create_task(self.source.run(self._answered, self._failed, loop.time))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def until(self, predicate: Any, within_s: float = 15.0) -> None:
        deadline = asyncio.get_running_loop().time() + within_s
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"not reached; answers {self.answers[-3:]}, {self.errors}")
            await asyncio.sleep(0.02)

    def last(self) -> list[str] | None:
        return self.answers[-1] if self.answers else None


@pytest.fixture
async def watcher() -> AsyncIterator[Any]:
    started: list[Watcher] = []

    def start(**policy: Any) -> Watcher:
        w = Watcher(**policy)
        w.start()
        started.append(w)
        return w

    try:
        yield start
    finally:
        for w in started:
            await w.close()


async def test_ready_endpoints_become_instances_named_by_their_pod(
    api: FakeKubeApi, watcher: Any
) -> None:
    api.put_slice(
        "vllm-abc",
        NS,
        "vllm",
        [
            endpoint("10.0.0.1", "vllm-0"),
            endpoint("10.0.0.2", "vllm-1", ready=False),  # starting: not ready yet
            endpoint("10.0.0.3", "vllm-2", ready=False, serving=True, terminating=True),
        ],
        PORTS,
    )
    api.put_slice("other", NS, "other", [endpoint("10.0.0.9", "other-0")], PORTS)
    w = watcher(port="http")
    await w.until(lambda: w.last() == ["vllm-0=10.0.0.1:8000"])
    # A second slice of the Service (more endpoints than one slice holds) adds its endpoints.
    api.put_slice("vllm-def", NS, "vllm", [endpoint("10.0.0.4", "vllm-3")], PORTS)
    await w.until(lambda: w.last() == ["vllm-0=10.0.0.1:8000", "vllm-3=10.0.0.4:8000"])
    # vllm-0 terminates: no new requests for it.
    api.put_slice(
        "vllm-abc",
        NS,
        "vllm",
        [endpoint("10.0.0.1", "vllm-0", ready=False, serving=True, terminating=True)],
        PORTS,
    )
    await w.until(lambda: w.last() == ["vllm-3=10.0.0.4:8000"])
    api.delete_slice("vllm-def", NS)
    # None ready, one terminating but still serving: it serves rather than nobody.
    await w.until(lambda: w.last() == ["vllm-0=10.0.0.1:8000"])
    assert w.errors == []
    assert w.source.lists == 1


async def test_a_selector_and_a_port_number_pick_the_slices_and_port(
    api: FakeKubeApi, watcher: Any
) -> None:
    ports = [{"name": "http", "port": 8000}, {"name": "metrics", "port": 9000}]
    api.put_slice("a", NS, "vllm-a", [endpoint("10.0.1.1", "a-0")], ports, {"app": "llm"})
    api.put_slice("b", NS, "vllm-b", [endpoint("10.0.1.2", "b-0")], ports, {"app": "llm"})
    api.put_slice("c", NS, "web", [endpoint("10.0.1.3", "c-0")], ports, {"app": "web"})
    w = watcher(service=None, selector="app=llm", port=9000)
    await w.until(lambda: w.last() == ["a-0=10.0.1.1:9000", "b-0=10.0.1.2:9000"])


async def test_several_ports_without_a_port_named_is_an_error_that_changes_nothing(
    api: FakeKubeApi, watcher: Any
) -> None:
    api.put_slice("a", NS, "vllm", [endpoint("10.0.1.1", "a-0")], PORTS)
    w = watcher()
    await w.until(lambda: w.last() == ["a-0=10.0.1.1:8000"])
    api.put_slice(
        "a", NS, "vllm", [endpoint("10.0.1.1", "a-0")], [*PORTS, {"name": "m", "port": 9000}]
    )
    await w.until(lambda: any("several ports" in e for e in w.errors))
    assert w.last() == ["a-0=10.0.1.1:8000"]


async def test_bookmarks_keep_a_quiet_watch_current_and_410_relists(
    api: FakeKubeApi, watcher: Any
) -> None:
    api.put_slice("a", NS, "vllm", [endpoint("10.0.2.1", "p-0")], PORTS)
    w = watcher()
    await w.until(lambda: w.last() == ["p-0=10.0.2.1:8000"])
    # Changes elsewhere move the version; bookmarks carry it to this quiet watch.
    api.put_slice("x", "elsewhere", "vllm", [endpoint("10.9.9.9", "x-0")], PORTS)
    target = api.current_rv
    await w.until(lambda: w.source.resource_version == str(target))
    # The API goes away for a while; meanwhile a change is made and the history compacted:
    # resuming from the version the source had is 410 Gone, so it lists again, and so learns
    # of the change.
    old = w.source.resource_version
    lists = w.source.lists
    api.set_unavailable(True)
    api.drop_watches()
    await w.until(lambda: len(w.errors) >= 1)
    api.put_slice("a", NS, "vllm", [endpoint("10.0.2.2", "p-1")], PORTS)
    api.compact()
    api.set_unavailable(False)
    await w.until(lambda: w.last() == ["p-1=10.0.2.2:8000"])
    assert w.source.lists == lists + 1  # the relist
    assert any(r.error_code == 410 for r in api.watch_requests)
    assert all("503" in e for e in w.errors)  # the outage is an error; a 410 is the protocol
    assert int(w.source.resource_version or 0) > int(old or 0)


async def test_a_dropped_watch_resumes_from_its_version_without_an_error(
    api: FakeKubeApi, watcher: Any
) -> None:
    api.put_slice("a", NS, "vllm", [endpoint("10.0.3.1", "p-0")], PORTS)
    w = watcher()
    await w.until(lambda: w.last() == ["p-0=10.0.3.1:8000"] and api.open_watches == 1)
    await asyncio.sleep(1.5)  # a working watch (WORKING_WATCH_S)
    version = w.source.resource_version
    api.drop_watches()
    await w.until(lambda: api.watch_count >= 2)
    resumed = api.watch_requests[-1]
    assert resumed.resource_version == version
    api.put_slice("a", NS, "vllm", [endpoint("10.0.3.2", "p-1")], PORTS)
    await w.until(lambda: w.last() == ["p-1=10.0.3.2:8000"])
    assert w.errors == []
    assert w.source.lists == 1  # resumed, not listed again


async def test_an_api_outage_or_refusal_is_an_error_and_changes_nothing(
    api: FakeKubeApi, watcher: Any
) -> None:
    api.put_slice("a", NS, "vllm", [endpoint("10.0.4.1", "p-0")], PORTS)
    w = watcher()
    await w.until(lambda: w.last() == ["p-0=10.0.4.1:8000"])
    answers = len(w.answers)
    api.set_unavailable(True)
    api.drop_watches()
    await w.until(lambda: len(w.errors) >= 2)
    assert "HTTP 503" in w.errors[-1]
    assert len(w.answers) == answers  # nothing changed
    api.set_unavailable(False)
    api.put_slice("a", NS, "vllm", [endpoint("10.0.4.2", "p-1")], PORTS)
    await w.until(lambda: w.last() == ["p-1=10.0.4.2:8000"], within_s=30)

    forbidden = watcher(namespace="secret")
    api.set_forbidden_namespaces(["secret"])
    await forbidden.until(lambda: any("HTTP 403" in e for e in forbidden.errors))
    assert forbidden.answers == []


# -- a gateway following a Service ---------------------------------------------------------------


def _policy(top: str = "") -> str:
    return f"""
{LOOPBACK_LISTENERS}
{top}
pools:
  chat:
    models: [m]
    discovery:
      kubernetes: {{namespace: {NS}, service: vllm, port: http}}
      grace: 4s
    health: {{interval: 1s, timeout: 500ms}}
"""


def _slice(
    api: FakeKubeApi, backends: Fleet, ready: Sequence[int], terminating: Sequence[int] = ()
) -> None:
    """The Service's one slice: these backends ready, those terminating (still serving)."""
    endpoints = [endpoint(backends.host(n), f"vllm-{n}") for n in ready]
    endpoints += [
        endpoint(backends.host(n), f"vllm-{n}", ready=False, serving=True, terminating=True)
        for n in terminating
    ]
    api.put_slice("vllm-1", NS, "vllm", endpoints, [{"name": "http", "port": backends.port}])


@pytest.fixture
def gateway_on(tmp_path: Path, api: FakeKubeApi) -> Iterator[Any]:
    with gateways(tmp_path / "policy.yaml", {"KUBECONFIG": str(tmp_path / "kubeconfig")}) as start:
        yield start


def test_a_gateway_follows_the_service_keeps_state_and_survives_the_api_going_away(
    api: FakeKubeApi,
    fleet: Fleet,
    gateway_on: Any,
) -> None:
    fleet.start(2, 3, 4)
    _slice(api, fleet, [2, 3])
    gateway = gateway_on(_policy())
    wait_until(lambda: _healthy(gateway) == {"vllm-2", "vllm-3"}, timeout_s=20)
    assert all(_ask(gateway).status_code == 200 for _ in range(10))
    before = {i["name"]: i for i in _state(gateway)["instances"]}

    _slice(api, fleet, [2, 3, 4])
    wait_until(lambda: _healthy(gateway) == {"vllm-2", "vllm-3", "vllm-4"}, timeout_s=20)
    after = {i["name"]: i for i in _state(gateway)["instances"]}
    for name in ("vllm-2", "vllm-3"):  # same objects: their counts went on
        assert after[name]["requests"] >= before[name]["requests"] > 0
    # The newcomer, with no latency of its own yet, is costed at its peers' average: it wins a
    # draw against the slower peer only, a third of the draws. Sent until it serves one,
    # bounded: 60 misses in a row would be odds of (2/3)^60, about 3e-11.
    served = fleet.served(4)
    statuses = []
    for _ in range(60):
        statuses.append(_ask(gateway).status_code)
        if fleet.served(4) > served:
            break
    assert statuses == [200] * len(statuses)
    assert fleet.served(4) > served

    # vllm-2 terminates: it leaves the pool and gets nothing new.
    _slice(api, fleet, [3, 4], terminating=[2])
    wait_until(
        lambda: {i["name"] for i in _state(gateway)["instances"]} == {"vllm-3", "vllm-4"},
        timeout_s=20,
    )
    served = fleet.served(2)
    assert all(_ask(gateway).status_code == 200 for _ in range(10))
    assert fleet.served(2) == served

    # The API goes away: the pool keeps serving on what it knew, and says so.
    api.set_unavailable(True)
    api.drop_watches()
    wait_until(lambda: _state(gateway)["discovery"]["errors"] >= 1, timeout_s=20)
    state = _state(gateway)
    assert "HTTP 503" in state["discovery"]["last_error"]
    assert state["discovery"]["source"] == "kubernetes"
    assert state["discovery"]["target"] == f"{NS}/vllm"
    assert {i["name"] for i in state["instances"]} == {"vllm-3", "vllm-4"}
    assert all(_ask(gateway).status_code == 200 for _ in range(10))
    api.set_unavailable(False)
    _slice(api, fleet, [3])
    wait_until(lambda: {i["name"] for i in _state(gateway)["instances"]} == {"vllm-3"}, 30)
    assert _state(gateway)["discovery"]["last_error"] is None


def test_no_request_fails_while_the_deployment_scales_from_2_to_6_and_back(
    api: FakeKubeApi,
    fleet: Fleet,
    gateway_on: Any,
) -> None:
    """As a Deployment scales: new pods' endpoints appear not ready, then ready; removed pods
    turn terminating (still serving) and their processes get SIGTERM and finish what they run."""
    fleet.start(*range(2, 8), extra=("--per-token", "0.01"))
    _slice(api, fleet, [2, 3])
    gateway = gateway_on(_policy())
    wait_until(lambda: _healthy(gateway) == {"vllm-2", "vllm-3"}, timeout_s=20)

    with Load(gateway) as load:
        results = load.results
        wait_until(lambda: len(results) >= 20, timeout_s=60)
        six = {f"vllm-{n}" for n in range(2, 8)}
        # New pods: not ready at first, then ready.
        endpoints = [endpoint(fleet.host(n), f"vllm-{n}") for n in (2, 3)]
        endpoints += [endpoint(fleet.host(n), f"vllm-{n}", ready=False) for n in range(4, 8)]
        api.put_slice("vllm-1", NS, "vllm", endpoints, [{"name": "http", "port": fleet.port}])
        _slice(api, fleet, list(range(2, 8)))
        wait_until(lambda: _healthy(gateway) == six, timeout_s=30)
        wait_until(lambda: all(fleet.served(n) > 0 for n in range(4, 8)), timeout_s=30)
        _slice(api, fleet, [2, 3], terminating=list(range(4, 8)))
        wait_until(
            lambda: {i["name"] for i in _state(gateway)["instances"]} == {"vllm-2", "vllm-3"},
            timeout_s=30,
        )
        fleet.stop(4, 5, 6, 7)
        _slice(api, fleet, [2, 3])
        count = len(results)
        wait_until(lambda: len(results) >= count + 20, timeout_s=60)
    assert len(results) >= 60
    assert [r for r in results if r != (200, True)] == []


def test_the_scale_benchmark_runs_and_records_every_figure(tmp_path: Path) -> None:
    """`loadtests.discovery_scale` end to end, one short cycle per source: behaviour only (every
    request accounted for, each figure measured), no assertion on how fast."""
    from loadtests.discovery_scale import main

    runs = main(
        ["--cycles", "1", "--clients", "2", "--settle", "1", "--ttl", "1"],
        out=lambda line: None,
    )
    assert [run.source for run in runs] == ["dns", "kubernetes"]
    for run in runs:
        assert run.requests > 0 and run.failed == 0, run
        assert len(run.up_first_s) == len(run.up_all_s) == len(run.down_last_s) == 1
        # Each figure is measured from the change on (order, not speed).
        assert min(run.up_first_s + run.up_all_s + run.down_last_s) >= 0


def test_a_sidecar_and_a_discovering_central_gateway_agree_on_who_is_who(
    api: FakeKubeApi, fleet: Fleet, gateway_on: Any, tmp_path: Path
) -> None:
    """The sidecar of pod vllm-2 names its vLLM after its pod, as the central gateway's
    discovery does: the sidecar's verdict, shared through Redis, isolates the discovered
    instance, and the isolation stays through a later change of the Service's endpoints."""
    fleet.start(2, 3, 4)
    sidecar_backend = fleet.backends[fleet.host(2)]
    with RedisServer() as redis:
        shared = f'shared: {{redis_url: "{redis.url}", key_prefix: gw, decision_ttl: 1s}}'
        _slice(api, fleet, [2, 3])
        central = gateway_on(_policy(shared))
        sidecar = start_gateway(
            tmp_path / "sidecar.yaml",
            f"""
{LOOPBACK_LISTENERS}
{shared}
pools:
  chat:
    models: [m]
    instances: [{{name: vllm-2, url: "{sidecar_backend.url}"}}]
""",
            {"GATEWAY_REPLICA_ID": "vllm-2"},
        )
        try:
            wait_until(lambda: _healthy(central) == {"vllm-2", "vllm-3"}, timeout_s=20)
            sidecar_backend.set_faults(error_rate=1.0, error_status=503)

            def isolated() -> bool:
                _ask(sidecar)  # still failing there: the verdict is shared again
                (found,) = [i for i in _state(central)["instances"] if i["name"] == "vllm-2"]
                return bool(found["state"] == "ISOLATED" and found["decided_by"] == "vllm-2")

            wait_until(isolated, timeout_s=20)
            _slice(api, fleet, [2, 3, 4])
            wait_until(lambda: "vllm-4" in _healthy(central), timeout_s=20)
            wait_until(isolated, timeout_s=10)
            assert all(_ask(central).status_code == 200 for _ in range(10))
        finally:
            sidecar.stop()
