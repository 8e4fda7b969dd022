"""Where a replica's isolation decisions go, and where it learns the other replicas' decisions.

Two stores with one interface, chosen by the policy: `LocalDecisions` (no `shared` section:
every decision stays in this process) and `RedisDecisions` (`shared.redis_url`).
"""

from __future__ import annotations

from gateway.cluster.local import LocalDecisions
from gateway.cluster.store import DecisionStore, TransitionLog, replica_id
from gateway.config import Policy
from gateway.upstream.registry import Registry


def build_store(policy: Policy, registry: Registry) -> DecisionStore:
    if policy.shared is None:
        return LocalDecisions()
    from gateway.cluster.redis_store import RedisDecisions  # redis only when configured

    return RedisDecisions(policy.shared, registry, replica_id())


__all__ = ["DecisionStore", "LocalDecisions", "TransitionLog", "build_store", "replica_id"]
