"""vLLM's own load signals: each instance's `/metrics` scraped, so a saturated one gets no new work.

For pools whose `admission.vllm_signals` is set, one task per pool reads every instance's
`/metrics` each `interval`, bounded by `timeout`, keeps `vllm:num_requests_waiting` and the KV-
cache usage on the instance, and judges it saturated (`gateway.core.concurrency.vllm_saturated`).
A failed or unreadable scrape forgets the signals: an instance is never held back on stale
news (its health check and breaker judge a dead one). When an instance stops being saturated
the pool is told, so requests waiting for admission go at once rather than at the next finish.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from gateway.config.models import VllmSignalsPolicy
from gateway.core.concurrency import vllm_saturated
from gateway.core.vllm_metrics import read_running, read_vllm_load
from gateway.runtime import cancel_and_wait
from gateway.upstream.registry import InstanceState, PoolState, Registry

log = logging.getLogger("gateway.vllm_load")

# The most of a /metrics page read: vLLM's runs to tens of kilobytes of histograms.
MAX_PAGE_BYTES = 4 * 1024 * 1024


class VllmLoadScraper:
    def __init__(self, registry: Registry, session: aiohttp.ClientSession) -> None:
        self._pools = [
            (pool, pool.policy.admission.vllm_signals)
            for pool in registry.pools.values()
            if pool.policy.admission is not None and pool.policy.admission.vllm_signals
        ]
        self._session = session
        self._tasks: list[asyncio.Task[None]] = []
        self.scrapes = 0
        self.failures = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(pool, policy)) for pool, policy in self._pools]

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)

    async def _run(self, pool: PoolState, policy: VllmSignalsPolicy) -> None:
        limit = aiohttp.ClientTimeout(total=policy.timeout)
        while True:
            await self.scrape_pool(pool, policy, limit)
            await asyncio.sleep(policy.interval)

    async def scrape_pool(
        self, pool: PoolState, policy: VllmSignalsPolicy, limit: aiohttp.ClientTimeout
    ) -> None:
        freed = await asyncio.gather(
            *(self._scrape(pool, inst, policy, limit) for inst in pool.instances)
        )
        if any(freed):
            pool.capacity_changed()

    async def _scrape(
        self,
        pool: PoolState,
        instance: InstanceState,
        policy: VllmSignalsPolicy,
        limit: aiohttp.ClientTimeout,
    ) -> bool:
        """Refresh one instance's signals; True when it just stopped being saturated."""
        self.scrapes += 1
        waiting: float | None = None
        usage: float | None = None
        try:
            async with self._session.get(
                instance.base_url + policy.path,
                timeout=limit,
                allow_redirects=False,
                ssl=pool.ssl,  # the pool's TLS settings and credential, as its requests
                headers=pool.credential_headers,
            ) as response:
                if response.status == 200:
                    page = await response.content.read(MAX_PAGE_BYTES)
                    waiting, usage = read_vllm_load(page)
                    running = read_running(page)
                    if waiting and running and running > instance.capacity_seen:
                        # Requests wait inside the engine: it runs all it can at once.
                        instance.capacity_seen = int(running)
                else:
                    self.failures += 1
        except (TimeoutError, aiohttp.ClientError):
            self.failures += 1
        was = instance.saturated
        instance.vllm_waiting = waiting
        instance.vllm_cache_usage = usage
        instance.saturated = vllm_saturated(
            waiting, usage, policy.max_waiting, policy.max_cache_usage
        )
        if instance.saturated != was:
            log.info(
                "vllm load",
                extra={
                    "fields": {
                        "pool": instance.pool_name,
                        "instance": instance.name,
                        "saturated": instance.saturated,
                        "waiting": waiting,
                        "cache_usage": usage,
                    }
                },
            )
        return was and not instance.saturated
