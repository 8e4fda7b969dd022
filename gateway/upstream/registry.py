"""Runtime state of pools and instances, built once from a policy."""

from __future__ import annotations

from urllib.parse import urlsplit

from yarl import URL

from gateway.config import InstancePolicy, Policy, PoolPolicy
from gateway.ingress.routes import PROXY_ROUTES


class InstanceState:
    """One backend instance: identity, precomputed URLs, and live counters."""

    __slots__ = ("base_url", "in_flight", "name", "name_header", "pool_name", "requests", "urls")

    def __init__(self, pool_name: str, policy: InstancePolicy) -> None:
        self.pool_name = pool_name
        self.name = policy.name
        self.base_url = policy.url
        self.name_header = policy.name.encode()
        base_path = urlsplit(policy.url).path.rstrip("/")
        # The upstream target comes from the policy and a fixed route table only, never from
        # the client's request target, so no request can reach another host or path.
        self.urls: dict[str, URL] = {
            path: URL(policy.url).with_path(base_path + path) for path in PROXY_ROUTES
        }
        self.in_flight = 0
        self.requests = 0


class PoolState:
    __slots__ = ("instances", "name", "next_index", "policy")

    def __init__(self, name: str, policy: PoolPolicy) -> None:
        self.name = name
        self.policy = policy
        self.instances = [InstanceState(name, inst) for inst in policy.instances]
        self.next_index = 0


class Registry:
    """Pools by name and by the models they serve."""

    def __init__(self, policy: Policy) -> None:
        self.pools = {name: PoolState(name, pool) for name, pool in policy.pools.items()}
        self.by_model = {
            model: self.pools[name] for name, pool in policy.pools.items() for model in pool.models
        }
