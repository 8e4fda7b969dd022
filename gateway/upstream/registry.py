"""Pools by name and by the models they serve, built once from a policy and changed in place
on reload."""

from __future__ import annotations

import random

from gateway.config import Policy
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState


def clients_authenticated(policy: Policy) -> bool:
    """Whether the data plane asks clients for API keys (their keys are then not forwarded)."""
    return policy.auth is not None and bool(policy.auth.keys)


class Registry:
    """Pools by name and by the models they serve.

    The two dicts are long-lived: the data plane and the decision store hold them, so a policy
    reload (`apply`) changes them in place rather than replacing them.
    """

    def __init__(self, policy: Policy, now: float, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()
        client_auth = clients_authenticated(policy)
        self.pools = {
            name: PoolState(name, pool, self.rng, now, client_auth)
            for name, pool in policy.pools.items()
        }
        self.by_model = {
            model: self.pools[name] for name, pool in policy.pools.items() for model in pool.models
        }

    def apply(self, policy: Policy, now: float) -> tuple[list[InstanceState], list[PoolState]]:
        """Take a reloaded policy, in one synchronous step: surviving pools are reconfigured
        in place (`PoolState.reconfigure`), new ones built, dropped ones removed (their
        requests in flight keep their references and finish). Returns the new instances
        (to health-check) and the dropped pools."""
        added: list[InstanceState] = []
        pools: dict[str, PoolState] = {}
        client_auth = clients_authenticated(policy)
        for name, pool_policy in policy.pools.items():
            pool = self.pools.get(name)
            if pool is None:
                pool = PoolState(name, pool_policy, self.rng, now, client_auth)
                added.extend(pool.instances)
            elif pool.declared != pool_policy:
                added.extend(pool.reconfigure(pool_policy, now))
            pool.set_upstream_headers(client_auth)  # a rotated credential, auth turned on/off
            pools[name] = pool
        dropped = [pool for name, pool in self.pools.items() if name not in pools]
        self.pools.clear()
        self.pools.update(pools)
        self.by_model.clear()
        self.by_model.update(
            {model: pools[name] for name, pool in policy.pools.items() for model in pool.models}
        )
        return added, dropped
