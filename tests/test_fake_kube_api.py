"""The fake Kubernetes API (`loadtests.fake_kube_api`) as `kubernetes_asyncio` sees it: lists,
watches from a version, bookmarks, 410 after compaction, authentication, dropped connections."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from loadtests.fake_kube_api import SERVICE_NAME_LABEL, FakeKubeApi, endpoint

NS = "default"
SELECTOR = f"{SERVICE_NAME_LABEL}=vllm"
PORTS = [{"name": "http", "port": 8000}]


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    with FakeKubeApi(bookmark_interval_s=0.2) as api:
        yield api


async def _discovery(kube: FakeKubeApi, kubeconfig: Path) -> client.ApiClient:
    # A configuration of its own, not the library's process-wide default.
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return client.ApiClient(configuration)


@pytest.fixture
async def api(kube: FakeKubeApi, tmp_path: Path) -> AsyncIterator[client.DiscoveryV1Api]:
    api_client = await _discovery(kube, kube.kubeconfig(tmp_path / "kubeconfig"))
    try:
        yield client.DiscoveryV1Api(api_client)
    finally:
        await api_client.close()


async def _collect(
    api: client.DiscoveryV1Api,
    into: list[dict[str, Any]],
    changes: int = 0,
    bookmarks: int = 0,
    **kwargs: Any,
) -> watch.Watch:
    """Watches (server-side timeout 10 s) until `changes` events other than bookmarks, and
    `bookmarks` bookmarks, have come."""
    w = watch.Watch()
    async with w:
        stream = w.stream(
            api.list_namespaced_endpoint_slice,
            NS,
            label_selector=SELECTOR,
            allow_watch_bookmarks=True,
            timeout_seconds=10,
            **kwargs,
        )
        async for event in stream:
            into.append(event)
            marks = sum(1 for e in into if e["type"] == "BOOKMARK")
            if len(into) - marks >= changes and marks >= bookmarks:
                break
    return w


def _summary(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [
        (
            e["type"],
            e["raw_object"]["metadata"].get("name", ""),
            e["raw_object"]["metadata"]["resourceVersion"],
        )
        for e in events
    ]


async def test_list_returns_matching_slices_and_the_current_version(
    kube: FakeKubeApi, api: client.DiscoveryV1Api
) -> None:
    kube.put_slice(
        "vllm-a",
        NS,
        "vllm",
        [endpoint("10.0.0.1", "vllm-0"), endpoint("10.0.0.2", "vllm-1", ready=False)],
        PORTS,
    )
    kube.put_slice("other-a", NS, "other", [endpoint("10.0.1.1", "other-0")], PORTS)

    listing = await api.list_namespaced_endpoint_slice(NS, label_selector=SELECTOR)
    assert listing.metadata.resource_version == str(kube.current_rv)
    assert [item.metadata.name for item in listing.items] == ["vllm-a"]
    item = listing.items[0]
    assert item.address_type == "IPv4"
    assert item.metadata.labels[SERVICE_NAME_LABEL] == "vllm"
    assert [(e.addresses, e.conditions.ready, e.conditions.serving) for e in item.endpoints] == [
        (["10.0.0.1"], True, True),
        (["10.0.0.2"], False, False),
    ]
    assert (item.endpoints[0].target_ref.kind, item.endpoints[0].target_ref.name) == (
        "Pod",
        "vllm-0",
    )
    assert item.endpoints[0].target_ref.namespace == NS
    assert [(p.name, p.port, p.protocol) for p in item.ports] == [("http", 8000, "TCP")]
    # As from the real server, list items carry no kind/apiVersion (the list itself does).
    assert item.kind is None and listing.kind == "EndpointSliceList"
    assert kube.list_requests[-1].params["labelSelector"] == SELECTOR

    # Paging: `limit` with a `continue` token pinned to the first page's version.
    kube.put_slice("vllm-b", NS, "vllm", [endpoint("10.0.0.3", "vllm-2")], PORTS)
    first = await api.list_namespaced_endpoint_slice(NS, label_selector=SELECTOR, limit=1)
    assert [i.metadata.name for i in first.items] == ["vllm-a"] and first.metadata._continue
    rest = await api.list_namespaced_endpoint_slice(
        NS, label_selector=SELECTOR, limit=1, _continue=first.metadata._continue
    )
    assert [i.metadata.name for i in rest.items] == ["vllm-b"] and not rest.metadata._continue


async def test_a_watch_from_the_lists_version_sees_later_changes_in_order(
    kube: FakeKubeApi, api: client.DiscoveryV1Api
) -> None:
    kube.put_slice("vllm-a", NS, "vllm", [endpoint("10.0.0.1", "vllm-0")], PORTS)
    listed = (await api.list_namespaced_endpoint_slice(NS, label_selector=SELECTOR)).metadata
    events: list[dict[str, Any]] = []
    watcher = asyncio.create_task(
        _collect(api, events, changes=4, resource_version=listed.resource_version)
    )
    try:
        await kube.until(lambda: kube.open_watches == 1)
        rv_modified = kube.put_slice("vllm-a", NS, "vllm", [endpoint("10.0.0.2", "vllm-1")], PORTS)
        kube.put_slice("other-a", NS, "other", [endpoint("10.0.1.1", "other-0")], PORTS)
        rv_added = kube.put_slice("vllm-b", NS, "vllm", [endpoint("10.0.0.3", "vllm-2")], PORTS)
        # Relabelled out of the selector: the watcher sees it deleted, at the change's version.
        rv_relabelled = kube.put_slice(
            "vllm-b", NS, "vllm", [endpoint("10.0.0.3", "vllm-2")], PORTS, {SERVICE_NAME_LABEL: "x"}
        )
        rv_deleted = kube.delete_slice("vllm-a", NS)
        w = await watcher
    finally:
        watcher.cancel()
    changes = [e for e in events if e["type"] != "BOOKMARK"]
    assert _summary(changes) == [
        ("MODIFIED", "vllm-a", str(rv_modified)),
        ("ADDED", "vllm-b", str(rv_added)),
        ("DELETED", "vllm-b", str(rv_relabelled)),
        ("DELETED", "vllm-a", str(rv_deleted)),
    ]
    assert changes[0]["object"].endpoints[0].addresses == ["10.0.0.2"]
    assert changes[0]["raw_object"]["kind"] == "EndpointSlice"
    assert w.resource_version == events[-1]["raw_object"]["metadata"]["resourceVersion"]
    request = kube.watch_requests[-1]
    assert request.resource_version == listed.resource_version
    assert request.params["watch"].lower() == "true"


async def test_a_watch_without_a_version_starts_with_the_current_state(
    kube: FakeKubeApi, api: client.DiscoveryV1Api
) -> None:
    kube.put_slice("vllm-b", NS, "vllm", [endpoint("10.0.0.3", "vllm-2")], PORTS)
    kube.put_slice("vllm-a", NS, "vllm", [endpoint("10.0.0.1", "vllm-0")], PORTS)
    events: list[dict[str, Any]] = []
    await _collect(api, events, changes=2)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "vllm-a"),
        ("ADDED", "vllm-b"),
    ]


async def test_bookmarks_carry_the_current_version(
    kube: FakeKubeApi, api: client.DiscoveryV1Api
) -> None:
    kube.put_slice("vllm-a", NS, "vllm", [endpoint("10.0.0.1", "vllm-0")], PORTS)
    # A change outside the selector: the watcher gets no event, but its bookmark moves on.
    kube.put_slice("other-a", NS, "other", [endpoint("10.0.1.1", "other-0")], PORTS)
    start = str(kube.current_rv - 1)
    events: list[dict[str, Any]] = []
    w = await _collect(api, events, bookmarks=1, resource_version=start)
    (bookmark,) = events
    assert bookmark["type"] == "BOOKMARK"
    # The library hands bookmarks over undecoded, and remembers their version.
    assert isinstance(bookmark["object"], dict)
    assert bookmark["raw_object"]["kind"] == "EndpointSlice"
    assert bookmark["raw_object"]["metadata"]["resourceVersion"] == str(kube.current_rv)
    assert w.resource_version == str(kube.current_rv)


async def test_after_compaction_a_watch_from_an_old_version_gets_410(
    kube: FakeKubeApi, api: client.DiscoveryV1Api
) -> None:
    kube.put_slice("vllm-a", NS, "vllm", [endpoint("10.0.0.1", "vllm-0")], PORTS)
    old = (await api.list_namespaced_endpoint_slice(NS, label_selector=SELECTOR)).metadata
    kube.put_slice("vllm-a", NS, "vllm", [endpoint("10.0.0.2", "vllm-1")], PORTS)
    kube.compact()

    with pytest.raises(ApiException) as raised:
        await _collect(api, [], changes=1, resource_version=old.resource_version)
    assert raised.value.status == 410
    assert "too old resource version" in str(raised.value.reason)
    assert kube.watch_requests[-1].error_code == 410
    assert kube.watch_requests[-1].resource_version == old.resource_version

    # Listing again gives a version a watch can start from.
    fresh = (await api.list_namespaced_endpoint_slice(NS, label_selector=SELECTOR)).metadata
    assert int(fresh.resource_version) == kube.current_rv
    events: list[dict[str, Any]] = []
    watcher = asyncio.create_task(
        _collect(api, events, changes=1, resource_version=fresh.resource_version)
    )
    try:
        await kube.until(lambda: kube.open_watches == 1)
        rv = kube.delete_slice("vllm-a", NS)
        await watcher
    finally:
        watcher.cancel()
    assert [e for e in _summary(events) if e[0] != "BOOKMARK"] == [("DELETED", "vllm-a", str(rv))]
    assert kube.watch_requests[-1].error_code is None


async def test_a_wrong_token_gets_401_and_a_forbidden_namespace_403(
    kube: FakeKubeApi, api: client.DiscoveryV1Api, tmp_path: Path
) -> None:
    wrong = await _discovery(kube, kube.kubeconfig(tmp_path / "wrong", token="not-the-token"))
    try:
        with pytest.raises(ApiException) as raised:
            await client.DiscoveryV1Api(wrong).list_namespaced_endpoint_slice(NS)
        assert raised.value.status == 401
        status = json.loads(raised.value.body)
        assert (status["kind"], status["reason"], status["code"]) == ("Status", "Unauthorized", 401)
        # A watch's refusal comes as a Status body too, which the library raises.
        with pytest.raises(ApiException) as raised:
            await _collect(client.DiscoveryV1Api(wrong), [], changes=1)
        assert raised.value.status == 401
    finally:
        await wrong.close()

    kube.set_forbidden_namespaces({NS})
    with pytest.raises(ApiException) as raised:
        await api.list_namespaced_endpoint_slice(NS)
    assert raised.value.status == 403
    assert json.loads(raised.value.body)["reason"] == "Forbidden"


async def test_injected_failures_then_recovery(
    kube: FakeKubeApi, api: client.DiscoveryV1Api
) -> None:
    kube.fail_next(1, status=500)
    with pytest.raises(ApiException) as raised:
        await api.list_namespaced_endpoint_slice(NS)
    assert raised.value.status == 500
    kube.set_unavailable(True)
    with pytest.raises(ApiException) as raised:
        await api.list_namespaced_endpoint_slice(NS)
    assert raised.value.status == 503
    kube.set_unavailable(False)
    await api.list_namespaced_endpoint_slice(NS)
    assert [r.status for r in kube.list_requests] == [500, 503, 200]


async def test_dropped_watches_end_the_read_with_an_error_and_resume_from_the_last_version(
    kube: FakeKubeApi, api: client.DiscoveryV1Api
) -> None:
    kube.put_slice("vllm-a", NS, "vllm", [endpoint("10.0.0.1", "vllm-0")], PORTS)
    start = str(kube.current_rv)
    seen: list[dict[str, Any]] = []
    w = watch.Watch()

    async def follow() -> None:
        async with w:
            stream = w.stream(
                api.list_namespaced_endpoint_slice,
                NS,
                label_selector=SELECTOR,
                resource_version=start,
                timeout_seconds=10,
            )
            async for event in stream:
                seen.append(event)

    watcher = asyncio.create_task(follow())
    try:
        await kube.until(lambda: kube.open_watches == 1)
        rv = kube.put_slice("vllm-a", NS, "vllm", [endpoint("10.0.0.2", "vllm-1")], PORTS)
        await kube.until(lambda: len(seen) == 1)
        assert kube.drop_watches() == 1
        # A reset mid-body: the read fails (an incomplete chunked payload), it never ends cleanly.
        with pytest.raises(aiohttp.ClientPayloadError):
            await watcher
    finally:
        watcher.cancel()
    assert w.resource_version == str(rv)

    # Resuming from the last version seen misses nothing.
    rv_next = kube.put_slice("vllm-a", NS, "vllm", [endpoint("10.0.0.3", "vllm-2")], PORTS)
    events: list[dict[str, Any]] = []
    await _collect(api, events, changes=1, resource_version=w.resource_version)
    assert [e for e in _summary(events) if e[0] != "BOOKMARK"] == [
        ("MODIFIED", "vllm-a", str(rv_next))
    ]


async def test_a_watch_ends_cleanly_at_its_timeout(
    kube: FakeKubeApi, api: client.DiscoveryV1Api
) -> None:
    async with watch.Watch() as w:
        stream = w.stream(
            api.list_namespaced_endpoint_slice,
            NS,
            resource_version=str(kube.current_rv),
            allow_watch_bookmarks=True,
            timeout_seconds=1,
        )
        events: list[dict[str, Any]] = [e async for e in stream]
    # Shorter than the 2 s pre-timeout margin: like the real server, no bookmark at all.
    assert events == []
    assert kube.watch_requests[-1].params["timeoutSeconds"] == "1"
