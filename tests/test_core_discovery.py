"""Discovered instances: stable names, refresh times, and what each answer does to the set."""

from __future__ import annotations

import pytest

from gateway.config.models import NAME_RE
from gateway.core.discovery import (
    MIN_REFRESH_S,
    DiscoveredSet,
    Endpoint,
    Slice,
    SliceEndpoint,
    address_name,
    from_addresses,
    from_slices,
    from_srv,
    next_refresh,
)


def test_addresses_are_named_by_address_and_port() -> None:
    assert address_name("10.0.0.5", 8000) == "10.0.0.5-8000"
    assert address_name("FD00:0:0::1", 8000) == "fd00--1-8000"  # canonical form
    assert address_name("::1", 8000) == "0--1-8000"  # a name starts with a letter or digit
    with pytest.raises(ValueError):
        address_name("vllm-0", 8000)
    endpoints = from_addresses(["10.0.0.9", "fd00::1", "10.0.0.10", "10.0.0.9", "::1"], 8000)
    names = [e.name for e in endpoints]
    assert names == ["10.0.0.9-8000", "10.0.0.10-8000", "0--1-8000", "fd00--1-8000"]
    assert endpoints[3].url() == "http://[fd00::1]:8000"
    assert all(NAME_RE.match(e.name) for e in endpoints)


def test_srv_targets_are_named_by_their_first_label() -> None:
    records = [
        ("vllm-1.vllm.default.svc.cluster.local.", 8000),
        ("VLLM-0.vllm.default.svc.cluster.local.", 8000),
        ("vllm-0.vllm.default.svc.cluster.local", 8000),  # the same record again
    ]
    endpoints = from_srv(records)
    assert endpoints == [
        Endpoint("vllm-0", "vllm-0.vllm.default.svc.cluster.local", 8000),
        Endpoint("vllm-1", "vllm-1.vllm.default.svc.cluster.local", 8000),
    ]


def test_srv_names_stay_distinct_and_valid() -> None:
    # One target on two ports; one label under two domains on the same port; a label that
    # is no valid name.
    endpoints = from_srv(
        [("a.x.", 80), ("a.x.", 81), ("b.x.", 80), ("b.y.", 80), ("c" * 70 + ".x.", 80)]
    )
    names = [e.name for e in endpoints]
    assert len(set(names)) == len(names) == 5
    assert {"a-80", "a-81"} <= set(names)
    assert all(NAME_RE.match(name) for name in names)
    # Stable: the same answer gives the same names.
    assert [e.name for e in from_srv([("b.y.", 80), ("b.x.", 80)])] == sorted(
        e.name for e in endpoints if e.host.startswith("b.")
    )


@pytest.mark.parametrize(
    ("ttl_s", "delay_s"),
    [(None, 5.0), (30.0, 5.0), (2.0, 2.0), (0.0, MIN_REFRESH_S), (0.2, MIN_REFRESH_S)],
)
def test_a_source_is_asked_again_by_its_interval_or_sooner_ttl(
    ttl_s: float | None, delay_s: float
) -> None:
    assert next_refresh(100.0, 5.0, ttl_s) == 100.0 + delay_s


A = Endpoint("a", "10.0.0.1", 8000)
B = Endpoint("b", "10.0.0.2", 8000)


def test_answers_replace_the_set_and_errors_change_nothing() -> None:
    found = DiscoveredSet(grace_s=30.0)
    assert found.answered(0.0, [B, A]) and found.endpoints == (A, B)
    assert not found.answered(1.0, [A, B])  # the same set
    found.failed(2.0, "SERVFAIL")
    assert found.endpoints == (A, B)
    assert (found.errors, found.last_error, found.failed_at) == (1, "SERVFAIL", 2.0)
    assert found.answered(3.0, [A]) and found.endpoints == (A,)
    assert found.last_error is None and found.refreshed_at == 3.0 and found.errors == 1


def test_an_empty_answer_is_believed_only_after_the_grace() -> None:
    found = DiscoveredSet(grace_s=30.0)
    found.answered(0.0, [A, B])
    assert not found.answered(10.0, [])
    assert not found.answered(39.0, [])  # 29 s empty: not yet
    assert found.endpoints == (A, B) and found.empty_since == 10.0
    assert found.answered(40.0, []) and found.endpoints == ()
    # Endpoints again: taken at once.
    assert found.answered(41.0, [A]) and found.empty_since is None


def test_an_answer_with_endpoints_ends_the_grace() -> None:
    found = DiscoveredSet(grace_s=30.0)
    found.answered(0.0, [A, B])
    found.answered(10.0, [])
    found.answered(20.0, [A])
    assert found.endpoints == (A,) and found.empty_since is None
    assert not found.answered(45.0, [])  # a new grace starts
    assert found.endpoints == (A,) and found.empty_since == 45.0


def test_a_first_empty_answer_is_taken_and_a_grace_must_not_be_negative() -> None:
    assert not DiscoveredSet(grace_s=30.0).answered(0.0, [])  # nothing to keep
    with pytest.raises(ValueError):
        DiscoveredSet(grace_s=-1.0)


# -- EndpointSlices ------------------------------------------------------------------------------


def _ep(address: str, pod: str | None, **conditions: bool | None) -> SliceEndpoint:
    return SliceEndpoint(address, pod=pod, **conditions)


def test_slices_give_ready_endpoints_named_by_pod_on_the_named_port() -> None:
    slices = [
        Slice(
            "IPv4",
            (("http", 8000), ("metrics", 9000)),
            (
                _ep("10.0.0.2", "vllm-b"),
                _ep("10.0.0.1", "vllm-a", ready=None),  # not set: ready
                _ep("10.0.0.3", "vllm-c", ready=False),  # starting
                _ep("10.0.0.4", "vllm-d", ready=False, serving=True, terminating=True),
            ),
        ),
        Slice("IPv6", (("http", 8000),), (_ep("fd00::1", "vllm-a"),)),  # dual stack: once
        Slice("FQDN", (("http", 8000),), (_ep("vllm.example", "x"),)),
    ]
    assert [(e.name, e.host, e.port) for e in from_slices(slices, "http")] == [
        ("vllm-a", "10.0.0.1", 8000),
        ("vllm-b", "10.0.0.2", 8000),
    ]
    assert [e.port for e in from_slices(slices, 9000)] == [9000, 9000]
    assert from_slices(slices, 80) == []  # a Service's port is not the pods': no such port
    with pytest.raises(ValueError, match="several ports"):
        from_slices(slices[:1], None)
    assert from_slices(slices, "grpc") == []


def test_when_none_is_ready_the_terminating_ones_that_still_serve_do() -> None:
    slices = [
        Slice(
            "IPv4",
            (("http", 8000),),
            (
                _ep("10.0.0.1", "a", ready=False, serving=True, terminating=True),
                _ep("10.0.0.2", "b", ready=False, serving=False, terminating=True),
            ),
        )
    ]
    assert [e.name for e in from_slices(slices, None)] == ["a"]


def test_a_change_the_pool_could_not_take_is_tried_again_by_the_same_answer() -> None:
    found = DiscoveredSet(grace_s=0)
    endpoints = from_addresses(["10.0.0.1"], 8000)
    assert found.answered(1.0, endpoints)
    found.not_applied()
    assert found.answered(2.0, endpoints)  # the same answer, yet a change to apply
    assert not found.answered(3.0, endpoints)


def test_an_endpoint_without_a_usable_pod_name_is_named_by_its_address() -> None:
    long_pod = "p" * 80  # valid in Kubernetes, too long for an instance name
    slices = [Slice("IPv4", ((None, 8000),), (_ep("10.0.0.1", long_pod),))]
    assert [e.name for e in from_slices(slices, None)] == ["10.0.0.1-8000"]
