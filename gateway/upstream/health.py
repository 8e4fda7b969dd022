"""Active health checks: a light periodic GET of each instance's health path (vLLM: /health).

At start every instance is checked at once (`first_round`); then one task per instance checks it
every `health.interval`, each check bounded by `health.timeout`; the verdicts
(`gateway.core.health`) decide which instances take traffic. Checks come every
`health.fast_interval` instead while the verdict is in doubt (a check disagreed with it) or
the instance is down with nothing answering its checks (a restart is back within that), and
one comes at once (no sooner than `fast_interval` after the last) when a request timed out on
the instance or could not connect to it (`InstanceState.health_wanted`): HAProxy's `fastinter`
and `on-error fastinter`. So a frozen instance is known down in about two check timeouts after
the first request it let time out, not after the next rounds.
The checks use an aiohttp session (shared with the vLLM scrapes): measured with 50 instances
every 2 s, httpx cost 5 % of a core where the design allows about 1 %.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from gateway.core.health import HealthChange
from gateway.runtime import Clock, cancel_and_wait
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.registry import Registry

log = logging.getLogger("gateway.health")


class HealthChecker:
    def __init__(self, registry: Registry, session: aiohttp.ClientSession, clock: Clock) -> None:
        self._pools = [p for p in registry.pools.values() if p.policy.health.enabled]
        self._session = session
        self._timeouts = {
            p.name: aiohttp.ClientTimeout(total=p.policy.health.timeout) for p in self._pools
        }
        self._tasks: dict[InstanceState, asyncio.Task[None]] = {}
        self._stopped: list[asyncio.Task[None]] = []  # of instances gone: awaited at close
        self._clock = clock

    async def first_round(self) -> None:
        """Check every instance once: the process is not ready before it knows who is healthy."""
        await asyncio.gather(*(self.check_pool(pool) for pool in self._pools))

    async def check_instances(self, instances: list[InstanceState]) -> None:
        """Check these instances once now (new ones after a policy reload)."""
        pools = {pool.name: pool for pool in self._pools}
        await asyncio.gather(
            *(self._check(pools[i.pool_name], i) for i in instances if i.pool_name in pools)
        )

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = {
            instance: loop.create_task(self._watch(pool, instance))
            for pool in self._pools
            for instance in pool.instances
        }

    def follow_pool(self, pool: PoolState) -> None:
        """The pool's instances changed in place (discovery): instances that stay keep their
        checks and timers, gone ones are no longer checked, new ones (checked once already:
        `check_instances`) are checked from now on. Other pools are not touched."""
        if pool not in self._pools:
            return
        current = set(pool.instances)
        for instance in [i for i in self._tasks if i.pool_name == pool.name]:
            if instance not in current:
                task = self._tasks.pop(instance)
                task.cancel()
                self._stopped.append(task)
        self._stopped = [task for task in self._stopped if not task.done()]
        loop = asyncio.get_running_loop()
        for instance in pool.instances:
            if instance not in self._tasks:
                self._tasks[instance] = loop.create_task(self._watch(pool, instance))

    async def close(self) -> None:
        await cancel_and_wait([*self._tasks.values(), *self._stopped])

    async def _watch(self, pool: PoolState, instance: InstanceState) -> None:
        """Check `instance` every interval, sooner in doubt or when a request asks for it."""
        policy = pool.policy.health
        fast = min(policy.fast_interval, policy.interval)
        wanted = instance.health_wanted
        last = self._clock()  # `first_round` or `check_instances` has just checked it
        while True:
            wait = fast if instance.health.watched else policy.interval
            remaining = last + wait - self._clock()
            if remaining > 0 and not wanted.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wanted.wait(), remaining)
            too_soon = last + fast - self._clock()
            if too_soon > 0:
                await asyncio.sleep(too_soon)
            wanted.clear()
            last = self._clock()
            await self._check(pool, instance)

    async def check_pool(self, pool: PoolState) -> None:
        await asyncio.gather(*(self._check(pool, inst) for inst in pool.instances))

    async def _check(self, pool: PoolState, instance: InstanceState) -> None:
        policy = pool.policy.health
        try:
            async with self._session.get(
                instance.base_url + policy.path,
                timeout=self._timeouts[pool.name],
                allow_redirects=False,
                ssl=pool.ssl,  # the pool's TLS settings and credential, as its requests
                headers=pool.credential_headers,
            ) as response:
                await response.read()
                passed = response.status == 200
                reason = f"HTTP {response.status}"
                answered = True
        except TimeoutError:
            passed, reason = False, f"no answer within {policy.timeout:g}s"
            answered = False
        except aiohttp.ClientError as exc:
            passed, reason = False, type(exc).__name__
            answered = False
        change = instance.health.record(self._clock(), passed, reason, answered)
        if change is not None:
            pool.refresh_routable()
            if change.healthy:
                now = self._clock()
                instance.breaker.back_up(now)  # probed by the next request, not seconds later
                pool.rejoined(instance, now, ramp=instance.health.back, healthy=True)
            log_health_change(pool, instance, change)


def log_health_change(pool: PoolState, instance: InstanceState, change: HealthChange) -> None:
    fields = {
        "pool": pool.name,
        "instance": instance.name,
        "healthy": change.healthy,
        "reason": change.reason,
        "cold_start_s": instance.health.cold_start_s,
    }
    log.warning("health change", extra={"fields": fields})
