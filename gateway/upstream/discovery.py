"""Discovery's background work: one task per pool with `discovery`, running its source.

A source (DNS: `gateway.upstream.dns_records`; Kubernetes EndpointSlices:
`gateway.upstream.endpoint_slices`) reports answers and errors; the pool's record
(`PoolState.found`, `gateway.core.discovery.DiscoveredSet`) decides what each one changes, and
a change is handed to `apply` (the gateway swaps the pool's instances and starts checking the
new ones). An error changes nothing: it is counted, kept for `/admin/state` and logged once per
interval per pool.

A policy reload that changes a pool's discovery restarts its source (`follow`); the pool keeps
serving on what it had found until the new source answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from gateway.config.models import DiscoveryPolicy
from gateway.core.discovery import Endpoint
from gateway.runtime import Clock, cancel_and_wait
from gateway.telemetry.logs import LogThrottle
from gateway.upstream.dns_records import DnsSource
from gateway.upstream.pool import PoolState
from gateway.upstream.registry import Registry

log = logging.getLogger("gateway.discovery")

# One error line per pool per this long (a resolver down fails every refresh).
ERROR_LOG_INTERVAL_S = 30.0
# How long the gateway waits at startup for every pool's first answer before it serves (a
# source that cannot answer leaves its pool with its listed instances, if any).
FIRST_ANSWER_WAIT_S = 10.0
# A source that failed for good is started again after this, doubling to the max.
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0

Apply = Callable[[PoolState], Awaitable[None]]


class Source(Protocol):
    kind: str

    @property
    def target(self) -> str: ...

    async def run(
        self,
        answered: Callable[[Sequence[Endpoint]], Awaitable[None]],
        failed: Callable[[str], None],
        clock: Clock,
    ) -> None: ...


def source_for(policy: DiscoveryPolicy) -> Source:
    if policy.dns is not None:
        return DnsSource(policy.dns)
    assert policy.kubernetes is not None  # the policy has exactly one source
    # Imported only by a pool that watches Kubernetes: its client library takes seconds of
    # CPU to import, which every other gateway would pay at each start.
    from gateway.upstream.endpoint_slices import EndpointSliceSource

    return EndpointSliceSource(policy.kubernetes)


class _Runner:
    """One pool's source and the task running it."""

    def __init__(self, pool: PoolState, discovery: Discovery) -> None:
        assert pool.declared.discovery is not None and pool.found is not None
        self.pool = pool
        self.policy = pool.declared.discovery
        self.source = source_for(self.policy)
        self.first = asyncio.Event()  # the first answer or error
        self._discovery = discovery
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Run the source; one that fails for good is an error, and is started again."""
        delay = RESTART_FIRST_S
        while True:
            try:
                await self.source.run(self._answered, self._failed, self._discovery.clock)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("discovery source failed", extra={"fields": {"pool": self.pool.name}})
                self._failed(f"source failed: {type(exc).__name__}: {exc}")
            await asyncio.sleep(delay)
            delay = min(RESTART_MAX_S, delay * 2)
            self.source = source_for(self.policy)

    async def _answered(self, endpoints: Sequence[Endpoint]) -> None:
        found = self.pool.found
        if found is None:
            return
        changed = found.answered(self._discovery.clock(), endpoints)
        self.first.set()
        if changed:
            try:
                await self._discovery.apply(self.pool)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the next answer tries again: never stop the source
                found.not_applied()
                log.exception(
                    "discovery change not applied", extra={"fields": {"pool": self.pool.name}}
                )
                self._failed(f"change not applied: {type(exc).__name__}: {exc}")

    def _failed(self, error: str) -> None:
        found = self.pool.found
        if found is None:
            return
        found.failed(self._discovery.clock(), error)
        self.first.set()
        held_back = self._discovery.errors_logged.admit(self.pool.name)
        if held_back is not None:
            fields = {
                "pool": self.pool.name,
                "source": self.source.kind,
                "target": self.source.target,
                "error": error,
                "errors_not_logged": held_back,
                "instances_kept": len(found.endpoints),
            }
            log.warning("discovery failed, the last known instances stay", extra={"fields": fields})


class Discovery:
    """The sources of every pool with discovery (see the module docstring)."""

    def __init__(self, registry: Registry, clock: Clock, apply: Apply) -> None:
        self.registry = registry
        self.clock = clock
        self.apply = apply
        self.errors_logged = LogThrottle(ERROR_LOG_INTERVAL_S, time.monotonic)
        self._runners: dict[str, _Runner] = {}
        self._stopped: list[asyncio.Task[None]] = []
        self._closed = False

    def follow(self, registry: Registry) -> None:
        """Start, restart or stop sources to match the pools (synchronous: a reload's swap).
        A stopped source's task is cancelled here and awaited at `close`."""
        if self._closed:
            return
        self.registry = registry
        for name, runner in list(self._runners.items()):
            pool = registry.pools.get(name)
            if pool is not runner.pool or pool.declared.discovery != runner.policy:
                runner.task.cancel()
                self._stopped.append(runner.task)
                del self._runners[name]
        for name, pool in registry.pools.items():
            if pool.declared.discovery is not None and name not in self._runners:
                self._runners[name] = _Runner(pool, self)
        self._stopped = [task for task in self._stopped if not task.done()]

    async def first_answers(self, timeout_s: float = FIRST_ANSWER_WAIT_S) -> None:
        """Wait (bounded) until every source has answered or failed once."""
        waits = [runner.first.wait() for runner in self._runners.values()]
        if waits:
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.gather(*waits)
            except TimeoutError:
                slow = [n for n, r in self._runners.items() if not r.first.is_set()]
                log.warning(
                    "discovery: no first answer yet, serving without",
                    extra={"fields": {"pools": ",".join(slow)}},
                )

    async def close(self) -> None:
        self._closed = True
        tasks = [runner.task for runner in self._runners.values()] + self._stopped
        self._runners.clear()
        self._stopped = []
        await cancel_and_wait(tasks)
