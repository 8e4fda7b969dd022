"""Prometheus metrics, read from the gateway's live state when scraped.

A collector walks the registry and the decision store at scrape time, so the request path pays
nothing for these: no counter objects to bump, no labels to look up per request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.core.breaker import ADMITTING, ISOLATED, PROBING

if TYPE_CHECKING:
    from gateway.app import Gateway

_STATES = (ADMITTING, ISOLATED, PROBING)


class GatewayCollector(Collector):
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def collect(self) -> Iterator[Metric]:
        gateway = self._gateway
        state = GaugeMetricFamily(
            "gateway_instance_state",
            "1 for the breaker state each instance is in (ADMITTING, ISOLATED, PROBING)",
            labels=["pool", "instance", "state"],
        )
        isolations = CounterMetricFamily(
            "gateway_isolations",
            "Times each instance was isolated here (its own trips, operators, shared decisions)",
            labels=["pool", "instance"],
        )
        for pool in gateway.registry.pools.values():
            for inst in pool.instances:
                current = inst.breaker.state
                for name in _STATES:
                    state.add_metric([pool.name, inst.name, name], 1.0 if name == current else 0.0)
                isolations.add_metric([pool.name, inst.name], inst.breaker.isolations)
        yield state
        yield isolations
        shared = gateway.decisions.status()
        yield GaugeMetricFamily(
            "gateway_shared_state_connected",
            "1 while the replica shares decisions through Redis; 0 when it decides alone",
            value=1.0 if shared.get("connected") else 0.0,
        )
        events = CounterMetricFamily(
            "gateway_shared_decisions",
            "Shared-decision events by kind (published, adopted, lifted, suppressed, malformed...)",
            labels=["event"],
        )
        for event, count in shared.get("counters", {}).items():
            events.add_metric([event], count)
        yield events


def build_registry(gateway: Gateway) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(gateway))
    return registry
