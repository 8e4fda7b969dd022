"""One replica at a time probes an instance that every replica isolated: a short Redis lease.

`{prefix}:probe:{pool}:{instance}` holds the id of the replica allowed to probe. An isolation
falling due is contended for with SET NX PX (lease = decision_ttl / 3), by replicas whose pool has
had traffic lately (one without requests could not probe anyway); so is any isolation of a pool
with fallbacks in which nothing admits (its spare probes: `try_admit(spare=True)`). The winner's
breaker gets `lease_until` (`BreakerState.try_admit` starts a probe only before it), the others
get 0 and keep the instance out until they hear the probe's result. The lease is renewed while
the probe runs (only by its holder: a compare-and-expire script) and handed back once it has
ended.

Connected, every breaker needs the lease (`coordinate`); alone, none does (`alone`): without
Redis each replica probes for itself, as it would with no shared state at all.
"""

from __future__ import annotations

import asyncio
import math

from redis.asyncio import Redis

from gateway.cluster.store import Key, instance_keys
from gateway.core.breaker import ADMITTING, ISOLATED, PROBING
from gateway.upstream.registry import Registry

RELEASE_IF_OURS = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)
_RENEW_IF_OURS = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
)


class ProbeLeases:
    def __init__(
        self,
        client: Redis,
        registry: Registry,
        replica: str,
        prefix: str,
        lease_s: float,
        tick_s: float,
        timeout_s: float,
    ) -> None:
        self._client = client
        self._replica = replica
        self._prefix = prefix
        self._lease_s = lease_s
        self._lease_ms = max(1, round(lease_s * 1000))
        self._tick_s = tick_s
        self._timeout_s = timeout_s
        self._clock = asyncio.get_running_loop().time
        self._pools = registry.pools
        self._breakers, self._keys = instance_keys(registry, prefix, "probe")
        self._held: dict[Key, float] = {}  # leases we hold: when they lapse (monotonic)
        self._renewed: dict[Key, float] = {}
        self._pool_attempts: dict[str, int] = {}
        self._pool_busy_at: dict[str, float] = {}
        self._release = client.register_script(RELEASE_IF_OURS)
        self._renew = client.register_script(_RENEW_IF_OURS)
        self.acquired = 0

    def follow(self, registry: Registry, connected: bool) -> None:
        """A reloaded policy's instances: leases on dropped ones lapse by themselves."""
        breakers, keys = instance_keys(registry, self._prefix, "probe")
        if connected:
            for key, breaker in breakers.items():
                if key not in self._breakers:
                    breaker.lease_probes(0.0)  # new here: coordinate as the others do
        self._breakers, self._keys = breakers, keys
        for table in (self._held, self._renewed):
            for key in [key for key in table if key not in breakers]:
                del table[key]

    def held(self) -> list[str]:
        return sorted(f"{pool}/{instance}" for pool, instance in self._held)

    def coordinate(self) -> None:
        """Connected: from now on, probes need the lease."""
        for breaker in self._breakers.values():
            breaker.lease_probes(0.0)

    def alone(self) -> None:
        """Disconnected: nobody to ask, every replica probes for itself."""
        self._held.clear()
        self._renewed.clear()
        for breaker in self._breakers.values():
            breaker.lease_probes(math.inf)

    async def release_all(self) -> None:
        for key in list(self._held):
            await self._release(keys=[self._keys[key]], args=[self._replica])
        self._held.clear()

    async def tend(self) -> None:
        """Acquire the lease for isolations falling due, renew it while our probe runs, give
        it back once the probe has ended."""
        now = self._clock()
        horizon = now + self._tick_s / 2  # due before the next tick
        busy = self._busy_pools(now)
        spare = self._spare_pools()
        work: list[tuple[Key, str]] = []
        for key, breaker in self._breakers.items():
            held = self._held.get(key)
            state = breaker.state
            if (
                state == ISOLATED
                and not breaker.forced
                and (breaker.isolated_until <= horizon or key[0] in spare)
            ):
                if (held is None or held <= now) and key[0] in busy:
                    work.append((key, "acquire"))
            elif state == PROBING and held is not None:
                if now - self._renewed.get(key, now) >= self._lease_s / 3:
                    work.append((key, "renew"))
            elif held is not None:
                del self._held[key]
                self._renewed.pop(key, None)
                breaker.lease_probes(0.0)
                work.append((key, "release"))
        if not work:
            return
        async with asyncio.timeout(self._timeout_s * 2):
            for key, action in work:
                name = self._keys.get(key)
                if name is None:
                    continue  # dropped by a policy reload while this ran
                if action == "release":
                    await self._release(keys=[name], args=[self._replica])
                    continue
                if action == "acquire":
                    granted = await self._client.set(
                        name, self._replica, nx=True, px=self._lease_ms
                    )
                else:
                    granted = await self._renew(keys=[name], args=[self._replica, self._lease_ms])
                self._lease_result(key, action, bool(granted))

    def _spare_pools(self) -> set[str]:
        """Pools whose isolated instances may be probed before their isolations end: nothing
        in them admits and their requests go to fallback pools meanwhile
        (`BreakerState.try_admit(spare=True)`)."""
        return {
            name
            for name, pool in self._pools.items()
            if pool.policy.fallbacks
            and not any(inst.breaker.state == ADMITTING for inst in pool.instances)
        }

    def _busy_pools(self, now: float) -> set[str]:
        """Pools that sent attempts, or handed requests over to their fallbacks, lately. Only
        they compete for a probe lease: a replica without traffic (a sidecar whose pod left
        its Service, an idle replica) would hold the lease with no request to probe with while
        the busy ones wait."""
        busy = set()
        for name, pool in self._pools.items():
            attempts = sum(inst.requests for inst in pool.instances)
            attempts += sum(pool.stats.fallbacks.values())
            if attempts != self._pool_attempts.get(name):
                self._pool_attempts[name] = attempts
                self._pool_busy_at[name] = now
            if now - self._pool_busy_at.get(name, -math.inf) <= 3 * self._lease_s:
                busy.add(name)
        return busy

    def _lease_result(self, key: Key, action: str, granted: bool) -> None:
        breaker = self._breakers.get(key)
        if breaker is None:
            return  # dropped by a policy reload while the call ran
        if not granted:
            self._held.pop(key, None)
            self._renewed.pop(key, None)
            breaker.lease_probes(0.0)
            return
        now = self._clock()
        if action == "acquire":
            self.acquired += 1
        self._held[key] = now + self._lease_s
        self._renewed[key] = now
        # Our permission ends a call's length before Redis's, so that we never start a probe
        # on a lease that has already lapsed there.
        breaker.lease_probes(now + self._lease_s - self._timeout_s)
