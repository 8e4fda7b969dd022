"""The gateway's runtime: state built from a policy, the request pipeline, and the two ASGI apps."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import aiohttp
from starlette.types import ASGIApp

from gateway.admin import admin_token, build_admin_app, build_metrics_app
from gateway.cluster import build_store
from gateway.config import Policy
from gateway.core.breaker import ADMITTING, ISOLATED, Transition
from gateway.ingress.asgi import DataPlane
from gateway.ingress.auth import ClientAuth
from gateway.metrics import Observed
from gateway.operations import Operations
from gateway.pipeline.admit import PoolAdmission
from gateway.reload import PolicyDiff, Reloader, ReloadStats
from gateway.request_path import RequestPath, build_pipeline
from gateway.runtime import Clock
from gateway.telemetry.logs import AccessLogSwitch, LogFormat
from gateway.telemetry.tracing import setup_tracing, traced_transitions
from gateway.upstream.clients import new_client, new_session
from gateway.upstream.discovery import Discovery
from gateway.upstream.feedback import OnTransition
from gateway.upstream.health import HealthChecker
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.registry import Registry
from gateway.upstream.vllm_load import VllmLoadScraper
from gateway.upstream.watchdog import Watchdog

log = logging.getLogger("gateway.reload")


class Gateway:
    """Everything one gateway process serves from. Create it inside the running event loop."""

    def __init__(
        self,
        policy: Policy,
        policy_path: str | None = None,
        log_format: LogFormat | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """`policy_path`: the file reloads read (None: reloads from a file are refused);
        `log_format`: the access log's (default: the policy's `telemetry.log_format`); `rng`:
        the randomness of every decision (balancing, jitter, backoff), seeded by the system
        unless given (a seeded one makes a run repeatable)."""
        self.policy = policy
        self.access_log = AccessLogSwitch(
            log_format or policy.telemetry.log_format, policy.telemetry.access_log
        )
        self.reloads = ReloadStats(loaded_at=time.time(), source=policy_path)
        self.reloader = Reloader(self, policy_path, self.reloads)
        self.tracing = setup_tracing(policy.telemetry)  # first: it may refuse the environment
        clock = self._clock = asyncio.get_running_loop().time  # the one clock, for every layer
        self.registry = Registry(policy, now=clock(), rng=rng)
        # Pools that discover their instances: sources started with the gateway (`start`).
        self.discovery = Discovery(self.registry, clock, self._rediscovered)
        self._serving = False  # health checks running: new instances are checked as they come
        self.session: aiohttp.ClientSession = new_session()  # health checks, vLLM scrapes
        self.upstream = new_client()  # the requests themselves
        self.health = HealthChecker(self.registry, self.session, self._clock)
        self.vllm_load = VllmLoadScraper(self.registry, self.session)
        self.decisions = build_store(policy, self.registry)
        self.watchdog = Watchdog()
        self.watchdog.start()
        path = self._request_path(clock)
        # Client authentication: as long-lived as the data plane, its keys swapped on reload.
        self.auth = ClientAuth(policy.auth)
        self.data_app = DataPlane(
            self.registry,
            path.handle,
            auth=self.auth,
            access_log=self.access_log.current,
            max_request_bytes=policy.limits.max_request_bytes,
            readiness=self.readiness,
            tracing=self.tracing,
            limits=policy.limits,
            resume_handler=path.resume,
        )
        self._admin_apps(policy, clock)

    def _request_path(self, clock: Clock) -> RequestPath:
        """The pipeline, with the pools' admission and the pools it accounts attempts in."""
        on_transition: OnTransition = self._on_transition
        if self.tracing is not None:
            on_transition = traced_transitions(on_transition)
        self.admissions = {
            name: PoolAdmission(pool, pool.policy.admission)
            for name, pool in self.registry.pools.items()
            if pool.policy.admission is not None
        }
        # Admission objects replaced by a reload, kept until their running requests and
        # waiters are done (they still listen to their pool's capacity).
        self._retired_admissions: list[PoolAdmission] = []
        # The pools the account layer records into: the current ones and those a reload
        # dropped while requests were in flight on them (until those have finished).
        self._account_pools: dict[str, PoolState] = dict(self.registry.pools)
        return build_pipeline(  # the request path: gateway.request_path
            admissions=self.admissions,
            account_pools=self._account_pools,
            on_transition=on_transition,
            client=self.upstream,
            watchdog=self.watchdog,
            clock=clock,
            tracing=self.tracing,
        )

    def _admin_apps(self, policy: Policy, clock: Clock) -> None:
        """The operator's side: the admin API and the metrics, over what the data plane runs."""
        self.operations = Operations(
            self.registry.pools,
            self.admissions,
            self.decisions,
            self.reloads,
            self.data_app.refusals,
            self._on_transition,
            lambda: self.draining,
            clock,
        )
        observed = Observed(
            pools=self.registry.pools,
            admissions=self.admissions,
            refusals=self.data_app.refusals,
            shared=self.decisions.status,
            reloads=self.reloads,
            upstream=self.upstream,
        )
        self.admin_app: ASGIApp = build_admin_app(
            self.operations, self.reloader, observed, admin_token(policy.admin.token_env)
        )
        self.metrics_app: ASGIApp = build_metrics_app(observed)  # served when metrics.listen

    def _on_transition(self, pool: str, transition: Transition, operator: bool = False) -> None:
        """Share a breaker's transition; one back to ADMITTING makes room for waiting requests;
        an operator's isolation, or one for timeouts (`silent`), moves the instance's streams
        that can go on elsewhere (when another instance can take them: a pool of one keeps its
        streams where they are). An isolation for failures the instance answered (errors, out
        of memory) leaves its flowing streams where they are: moving one costs its client a
        new prefill elsewhere, and one that then slows or stalls moves anyway (the relay's
        pace and idle watch)."""
        self.decisions.record(pool, transition, operator)
        state = self.registry.pools.get(pool)  # None: dropped by a reload meanwhile
        if state is None:
            return
        if transition.to == ADMITTING and transition.state_from != ADMITTING:
            state.capacity_changed()
        elif (
            transition.to == ISOLATED
            and not transition.suppressed
            and (operator or transition.silent)
        ):
            instance = state.instance_named(transition.instance)
            if instance is not None and not state.alone(instance, self._clock()):
                self.data_app.streams.migrate(instance)

    async def start(self) -> None:
        """Know which instances there are (discovery, bounded), which are healthy, and what
        other replicas decided (bounded: Redis being down must not keep us from serving),
        before serving; then keep checking."""
        self.discovery.follow(self.registry)
        await asyncio.gather(self.discovery.first_answers(), self.decisions.start())
        async with self.reloader.lock:  # discovery's changes meanwhile wait, then follow
            await self.health.first_round()
            self.health.start()
            self.vllm_load.start()
            self._serving = True
        self.reloader.watch()

    async def _rediscovered(self, pool: PoolState) -> None:
        """Discovery changed what a pool found: the instances that stay keep their state and
        their checks; new ones join and are checked at once; then gone ones leave (they
        finish what they run). Until the new ones are checked the gone ones stay, so a set
        replaced whole never leaves the pool with nothing known healthy. Serialised with
        reloads; only this pool's health checks change."""
        async with self.reloader.lock:
            if self.registry.pools.get(pool.name) is not pool:
                return  # dropped or replaced by a reload meanwhile
            before = {(inst.name, inst.base_url) for inst in pool.instances}
            added = pool.rediscovered(self._clock(), keep_gone=True)
            if added:
                self.decisions.follow(self.registry)
                if self._serving:
                    await self.health.check_instances(added)
            pool.rediscovered(self._clock())
            after = {(inst.name, inst.base_url) for inst in pool.instances}
            if after == before and not added:
                return  # already applied (a reload took it meanwhile)
            self.decisions.follow(self.registry)
            if self._serving:
                self.health.follow_pool(pool)
            fields = {
                "pool": pool.name,
                "added": ",".join(sorted(name for name, _ in after - before)),
                "removed": ",".join(sorted(name for name, _ in before - after)),
                "instances": len(after),
            }
            log.warning("discovery changed the instances", extra={"fields": fields})

    async def close(self) -> None:
        await self.reloader.close()  # first: a reload waiting would start sources again
        await self.discovery.close()
        await self.health.close()
        await self.vllm_load.close()
        await self.decisions.close()
        await self.watchdog.close()
        await self.session.close()
        self.upstream.close()
        if self.tracing is not None:
            await self.tracing.close()
        self.access_log.flush()

    # Set by the process on SIGTERM (gateway.drain): not ready from then on, while it drains.
    draining = False

    # -- policy reload (`gateway.reload.Reloader` decides when, these what) -------------------

    def swap(self, policy: Policy, diff: PolicyDiff) -> list[InstanceState]:
        """A reload's change, in one synchronous step so no request sees half of it (requests
        in flight keep the pool and instance objects they hold and finish on them). Returns
        the instances it added."""
        self._apply_settings(policy)
        added: list[InstanceState] = []
        if diff.pools_or_auth:
            now = asyncio.get_running_loop().time()
            added, dropped = self.registry.apply(policy, now)
            self.auth.update(policy.auth)
            self._sync_account_pools(dropped)
            self._sync_admissions()
            self.decisions.follow(self.registry)
            self.discovery.follow(self.registry)  # sources of new or changed discovery
            self.data_app.refresh_models()  # /v1/models lists the reloaded pools' models
        self.policy = policy  # the drain reads its settings here when SIGTERM comes
        return added

    async def follow(self, added: list[InstanceState]) -> None:
        """After a reload that changed the pools: the background work follows the new pools.
        New instances are checked at once and take traffic only once healthy (as at start)."""
        old_health, old_load = self.health, self.vllm_load
        self.health = HealthChecker(self.registry, self.session, self._clock)
        self.vllm_load = VllmLoadScraper(self.registry, self.session)
        await asyncio.gather(old_health.close(), old_load.close())
        await self.health.check_instances(added)
        self.health.start()
        self.vllm_load.start()

    def _apply_settings(self, policy: Policy) -> None:
        """The reloadable settings outside the pools (before `self.policy` is replaced): the
        data plane's limits, and the access log turned on or off."""
        if policy.limits != self.policy.limits:
            self.data_app.set_limits(policy.limits)
        enabled = policy.telemetry.access_log
        if enabled != self.policy.telemetry.access_log:
            self.data_app.set_access_log(self.access_log.set(enabled))

    def _sync_account_pools(self, dropped: list[PoolState]) -> None:
        """Current pools, plus dropped ones while requests are in flight on them."""
        keep = {
            name: pool
            for name, pool in self._account_pools.items()
            if name not in self.registry.pools and any(i.in_flight for i in pool.instances)
        }
        keep.update({pool.name: pool for pool in dropped})
        self._account_pools.clear()
        self._account_pools.update(keep)
        self._account_pools.update(self.registry.pools)

    def _sync_admissions(self) -> None:
        """Admission follows the pools. A pool that keeps an admission section keeps its
        PoolAdmission, reconfigured in place (running count, queues and waiters intact), so
        its slots are never counted twice. A pool that loses its section, or is dropped,
        retires its PoolAdmission: the requests it runs and holds finish through it (it keeps
        listening to the pool's capacity) and it is forgotten at a later reload once empty;
        should the pool get a section back meanwhile, that same PoolAdmission serves again."""
        pools = self.registry.pools
        for name, current in list(self.admissions.items()):
            pool = pools.get(name)
            if pool is None or current.pool is not pool or pool.policy.admission is None:
                del self.admissions[name]
                self._retired_admissions.append(current)
        for name, pool in pools.items():
            policy = pool.policy.admission
            if policy is None:
                continue
            kept = self.admissions.get(name)
            if kept is None:
                kept = next((r for r in self._retired_admissions if r.pool is pool), None)
                if kept is None:
                    self.admissions[name] = PoolAdmission(pool, policy)
                    continue
                self._retired_admissions.remove(kept)
                self.admissions[name] = kept
            if kept.policy != policy:
                kept.reconfigure(policy)
        still: list[PoolAdmission] = []
        for retired in self._retired_admissions:
            if retired.running or retired.over or len(retired.queues):
                still.append(retired)
            elif retired.dispatch in retired.pool.capacity_listeners:
                retired.pool.capacity_listeners.remove(retired.dispatch)
        self._retired_admissions = still

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when the policy is loaded, the process is not draining and every pool has an
        instance that is up: its health checks pass, and no operator isolated it.

        A breaker's isolation does not count: it answers a partial error rate, and a sidecar
        turning not-ready for one would let a bad model version everywhere take every pod out
        of its Service. A sidecar's pod leaves only while its vLLM is really down.

        A pool whose discovery answered that it has no instance (a Deployment scaled to zero)
        does not count either: every replica sees the same, and turning them all not-ready
        would take the other pools' models away too."""
        if self.draining:
            return False, {"ready": False, "draining": True}
        pools = {
            name: any(not i.breaker.forced for i in pool.routable) or _known_empty(pool)
            for name, pool in self.registry.pools.items()
        }
        ready = all(pools.values())
        return ready, {"ready": ready, "pools": pools}


def _known_empty(pool: PoolState) -> bool:
    found = pool.found
    return not pool.instances and found is not None and found.refreshed_at is not None
