"""The engines' own load signals: each instance's `/metrics` scraped, so a saturated one gets no
new work beyond what its engine has room for.

For pools with admission (on by default) and `admission.vllm_signals` (also on by default), one
task per pool reads every instance's `/metrics` each `interval`, bounded by `timeout`, and at
once when admission has to queue a request (at most every `EARLIEST_READ_S`), so a slow start
grows as fast as the engines show they keep up. What it
reads (`gateway.core.vllm_metrics`): vLLM's requests waiting and running and its KV-cache usage,
or llama.cpp's server's requests deferred and processing (that server has no cache gauge); and
vLLM's KV-cache size (`vllm:cache_config_info`), which sizes the instance's token budget when the
pool counts tokens. An instance whose engine queues more than `max_waiting` requests or fills its
cache past `max_cache_usage` is saturated (`gateway.core.concurrency.vllm_saturated`): it may
keep what it has in flight less its share of the requests beyond the engine's room (its share
of what the engine runs and queues: other replicas and clients queue there too), and at least
one. What an engine has shown it runs caps what it is given (`InstanceState.room`): four times
the most it was seen running, until it has been seen queueing; then the most it ran at once, its
batch, with some headroom.

An engine without the gauges (a page without them, or no page: 404) is left to the concurrency
limiter, and asked again every `recheck`. A failed or unreadable read forgets the signals: an
instance is never held back on stale news (its health check and breaker judge a dead one); an
engine that had gauges stays paced by what it showed (`InstanceState.engine_paced`). When
an instance stops being saturated the pool is told, so requests waiting for admission go at once
rather than at the next finish.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from gateway.config.models import AdmissionPolicy, VllmSignalsPolicy
from gateway.core.concurrency import vllm_saturated
from gateway.core.vllm_metrics import EngineLoad, read_engine_load
from gateway.runtime import cancel_and_wait
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.registry import Registry

log = logging.getLogger("gateway.vllm_load")

# The most of a /metrics page read: vLLM's runs to tens of kilobytes of histograms.
MAX_PAGE_BYTES = 4 * 1024 * 1024
# The soonest a pool's engines are read again when admission asks: a vLLM page runs to
# a hundred kilobytes its API server has to render.
EARLIEST_READ_S = 0.1
# Statuses that say the instance has no metrics page (as opposed to failing to serve it).
_NO_PAGE = frozenset((401, 403, 404, 405, 501))


class VllmLoadScraper:
    def __init__(self, registry: Registry, session: aiohttp.ClientSession) -> None:
        self._pools = [
            (pool, pool.policy.admission)
            for pool in registry.pools.values()
            if pool.policy.admission is not None and pool.policy.admission.vllm_signals
        ]
        self._session = session
        self._tasks: list[asyncio.Task[None]] = []
        # Instances whose engine showed no gauges, and when to ask them again (loop time).
        self._recheck_at: dict[InstanceState, float] = {}
        self.scrapes = 0
        self.failures = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(pool, policy)) for pool, policy in self._pools]

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)

    async def _run(self, pool: PoolState, admission: AdmissionPolicy) -> None:
        """Read every `interval`, and sooner when admission asks (`pool.engines_wanted`), but
        no more often than every `EARLIEST_READ_S`."""
        policy = admission.vllm_signals
        assert policy is not None
        limit = aiohttp.ClientTimeout(total=policy.timeout)
        loop = asyncio.get_running_loop()
        wanted = pool.engines_wanted
        while True:
            started = loop.time()
            wanted.clear()
            await self.scrape_pool(pool, admission, limit)
            left = policy.interval - (loop.time() - started)
            try:
                await asyncio.wait_for(wanted.wait(), max(0.0, left))
            except TimeoutError:
                continue
            await asyncio.sleep(max(0.0, EARLIEST_READ_S - (loop.time() - started)))

    async def scrape_pool(
        self, pool: PoolState, admission: AdmissionPolicy, limit: aiohttp.ClientTimeout
    ) -> None:
        now = asyncio.get_running_loop().time()
        if self._recheck_at:  # instances that left the pool (discovery, reload) are forgotten
            current = set(pool.instances)
            for gone in [i for i in self._recheck_at if i.pool_name == pool.name]:
                if gone not in current:
                    del self._recheck_at[gone]
        due = [i for i in pool.instances if self._recheck_at.get(i, now) <= now]
        freed = await asyncio.gather(*(self._scrape(pool, inst, admission, limit) for inst in due))
        if any(freed):
            pool.capacity_changed()

    async def _read(
        self,
        pool: PoolState,
        instance: InstanceState,
        policy: VllmSignalsPolicy,
        limit: aiohttp.ClientTimeout,
    ) -> EngineLoad | None:
        """The engine's gauges; None when the read failed. An engine without gauges gives an
        empty `EngineLoad` and is not asked again for `recheck`."""
        self.scrapes += 1
        try:
            async with self._session.get(
                instance.base_url + policy.path,
                timeout=limit,
                allow_redirects=False,
                ssl=pool.ssl,  # the pool's TLS settings and credential, as its requests
                headers=pool.credential_headers,
            ) as response:
                if response.status == 200:
                    load = read_engine_load(await _page(response))
                elif response.status in _NO_PAGE:
                    load = EngineLoad()
                else:
                    self.failures += 1
                    return None
        except (TimeoutError, aiohttp.ClientError):
            self.failures += 1
            return None
        if load.empty:
            now = asyncio.get_running_loop().time()
            self._recheck_at[instance] = now + policy.recheck
            if instance.engine.gauges is not False:
                log.info(
                    "no engine load gauges: the concurrency limiter alone paces this instance",
                    extra={
                        "fields": {
                            "pool": instance.pool_name,
                            "instance": instance.name,
                            "path": policy.path,
                            "recheck_s": policy.recheck,
                        }
                    },
                )
        else:
            self._recheck_at.pop(instance, None)
        instance.engine.found(not load.empty)  # none: nothing to cap it by any more
        return load

    async def _scrape(
        self,
        pool: PoolState,
        instance: InstanceState,
        admission: AdmissionPolicy,
        limit: aiohttp.ClientTimeout,
    ) -> bool:
        """Refresh one instance's signals; True when it just stopped being saturated."""
        policy = admission.vllm_signals
        assert policy is not None
        load = await self._read(pool, instance, policy, limit)
        if load is None:
            instance.engine.unread()
            load = EngineLoad()
        if admission.tokens is not None and load.kv_tokens:
            instance.size_budget(load.kv_tokens, admission.tokens.overcommit)
        was = instance.engine.saturated
        saturated = vllm_saturated(
            load.waiting, load.cache_usage, policy.max_waiting, policy.max_cache_usage
        )
        unsaturated = instance.engine_read(load, saturated, policy.max_waiting)
        if saturated != was:
            log.info(
                "vllm load",
                extra={
                    "fields": {
                        "pool": instance.pool_name,
                        "instance": instance.name,
                        "saturated": saturated,
                        "waiting": load.waiting,
                        "cache_usage": load.cache_usage,
                        "engine_slots": instance.engine.slots if saturated else None,
                    }
                },
            )
        return unsaturated


async def _page(response: aiohttp.ClientResponse) -> bytes:
    """The whole page (a read returns what has arrived so far), at most `MAX_PAGE_BYTES`."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        chunks.append(chunk)
        size += len(chunk)
        if size >= MAX_PAGE_BYTES:
            break
    return b"".join(chunks)[:MAX_PAGE_BYTES]
