"""A pool's runtime state: its instances and the decisions it keeps about them as a whole."""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import Callable, Sequence

from gateway.config import InstancePolicy, PoolPolicy
from gateway.core.balancer import DEFAULT_RTT_S
from gateway.core.breaker import ADMITTING, BreakerState, PoolBreakers
from gateway.core.budget import RetryBudget
from gateway.core.concurrency import limiter_for
from gateway.core.discovery import DiscoveredSet, Endpoint
from gateway.core.failure_rate import FailureRateState
from gateway.core.health import HealthChange, HealthState
from gateway.core.histogram import Histogram
from gateway.core.tiers import TierTable
from gateway.upstream.instance import InstanceState, budget_for
from gateway.upstream.pool_timing import PoolTiming
from gateway.upstream.stats import PoolStats
from gateway.upstream.tls import client_ssl

# Client headers that carry API keys: never forwarded when the gateway authenticates clients
# itself or sends a credential of its own (a client's key must not reach a backend).
CLIENT_KEY_HEADERS = frozenset({"authorization", "x-api-key"})


class PoolState:
    """A pool's instances and the decisions it keeps about them as a whole."""

    __slots__ = (
        "breakers",
        "budget",
        "capacity_listeners",
        "credential_headers",
        "declared",
        "engines_wanted",
        "failure",
        "found",
        "in_use",
        "instances",
        "name",
        "name_header",
        "next_index",
        "policy",
        "resume_budget",
        "retry_on",
        "rng",
        "routable",
        "ssl",
        "stats",
        "strip_headers",
        "tiers",
        "timing",
    )

    def __init__(
        self,
        name: str,
        policy: PoolPolicy,
        rng: random.Random,
        now: float,
        client_auth: bool = False,
    ) -> None:
        self.name = name
        self.name_header = name.encode()  # `x-gateway-pool`, encoded once
        # The policy file's pool (`declared`), what its discovery source last told
        # (`found`), and the two together: the policy the pool runs on (`policy`).
        self.declared = policy
        self.found = _found_for(policy, None)
        self.in_use: tuple[Endpoint, ...] = ()  # the found endpoints among the instances
        policy = self.policy = self._with_found(())
        # Upstream TLS and credentials, computed once (again on reload), used per attempt, by
        # the health checks and by the vLLM scrapes alike.
        self.ssl: ssl.SSLContext | bool = client_ssl(policy.tls, name)
        self.credential_headers: tuple[tuple[str, str], ...] = ()
        self.strip_headers: frozenset[str] = frozenset()
        self.set_upstream_headers(client_auth)
        self.breakers = PoolBreakers(
            policy.breaker,
            [inst.name for inst in policy.instances],
            unavailable=self.unavailable_admitting,
        )
        self.instances = [
            _new_instance(name, inst, policy, self.breakers[inst.name], now)
            for inst in policy.instances
        ]
        self.next_index = 0
        # Its attempts' timeouts and hedge delays, and the prior they fall back on.
        self.timing = PoolTiming(self)
        self.failure = FailureRateState(policy.retries.failure_smoothing)
        self.tiers = TierTable(policy.retries.tiers)
        self.budget = RetryBudget.from_policy(policy.retries.budget)
        # Resumes of streams broken after their first byte have a budget of their own, so a
        # rolling restart's cut streams and the retries of the requests it refuses do not
        # starve each other (`ingress.resume`).
        self.resume_budget = _resume_budget(policy)
        self.retry_on: frozenset[str | int] = frozenset(policy.retries.on)
        self.rng = rng  # jitter and backoff draws
        self.stats = PoolStats(list(policy.models))
        self.routable: list[InstanceState] = []  # healthy instances, kept by `refresh_routable`
        # Told when the pool may take more work than before (admission lets waiters through).
        self.capacity_listeners: list[Callable[[], None]] = []
        # Set when admission has to queue: its engines' gauges are read now rather than at the
        # next interval (a slow start then grows as fast as the engines keep up).
        self.engines_wanted = asyncio.Event()
        self.refresh_routable()

    def set_upstream_headers(self, client_auth: bool) -> None:
        """The credential header the pool sends, and the client headers dropped for it: with a
        credential, its header and the clients' keys; with client authentication on, the keys
        clients gave the gateway. Neither: the client's headers pass as they are."""
        credentials = self.policy.credentials
        if credentials is not None:
            self.credential_headers = ((credentials.header, credentials.header_value()),)
            self.strip_headers = CLIENT_KEY_HEADERS | {credentials.header}
        else:
            self.credential_headers = ()
            self.strip_headers = CLIENT_KEY_HEADERS if client_auth else frozenset()

    def reconfigure(self, policy: PoolPolicy, now: float) -> list[InstanceState]:
        """Take a reloaded policy in place (one synchronous step: nothing runs in between).

        Instances whose name and url are unchanged keep their state object (breaker, EWMAs,
        in-flight counts, limiter, token budget, health), with the new settings applied; the
        others are new (and returned: they take no traffic before a passing health check,
        unless health checks are off). Dropped instances just leave the list: requests in
        flight on them hold their own reference and finish normally.

        A pool that keeps its discovery keeps what it found (a changed source replaces it with
        its first answer: until then the pool keeps serving on the last known set).
        """
        self.declared = policy
        self.found = _found_for(policy, self.found)
        return self._take(self._with_found(()), now)

    def rediscovered(self, now: float, keep_gone: bool = False) -> list[InstanceState]:
        """Follow what discovery found (`found` has changed): the instances that stay keep
        their state, new ones are returned (to health-check), gone ones finish what they run.
        `keep_gone`: those no longer found stay for now, so that a set replaced whole (a
        rollout, new addresses) is not left with nothing checked to route to; a second call
        without it lets them go once the new ones are checked."""
        kept = self.in_use if keep_gone else ()
        policy = self._with_found(kept)
        return [] if policy == self.policy else self._take(policy, now)

    def _with_found(self, kept: Sequence[Endpoint]) -> PoolPolicy:
        """The declared policy with the found instances (and `kept` ones besides); notes the
        found endpoints in use."""
        found = self.found
        endpoints: tuple[Endpoint, ...] = found.endpoints if found is not None else ()
        if kept:
            names = {e.name for e in endpoints}
            endpoints += tuple(e for e in kept if e.name not in names)
        policy, self.in_use = with_discovered(self.declared, found, endpoints)
        return policy

    def _take(self, policy: PoolPolicy, now: float) -> list[InstanceState]:
        old = {(inst.name, inst.base_url): inst for inst in self.instances}
        kept = {
            inst.name: old[(inst.name, inst.url)]
            for inst in policy.instances
            if (inst.name, inst.url) in old
        }
        breakers = PoolBreakers(
            policy.breaker,
            [inst.name for inst in policy.instances],
            existing={name: inst.breaker for name, inst in kept.items()},
            unavailable=self.unavailable_admitting,
        )
        previous = self.policy
        added: list[InstanceState] = []
        instances: list[InstanceState] = []
        for inst_policy in policy.instances:
            inst = kept.get(inst_policy.name)
            if inst is None:
                inst = _new_instance(
                    self.name, inst_policy, policy, breakers[inst_policy.name], now
                )
                added.append(inst)
                instances.append(inst)
                continue
            inst.reconfigured(policy, previous, now)
            instances.append(inst)
        retries, was_retries = policy.retries, previous.retries
        # The swap: plain assignments, no await in between.
        if policy.tls != previous.tls:  # same settings: same context, pooled connections kept
            self.ssl = client_ssl(policy.tls, self.name)
        self.policy = policy
        self.breakers = breakers
        self.instances = instances
        self.timing.forget_prior()  # worked out again from the new instances and settings
        self.failure.smoothing = retries.failure_smoothing
        if retries.tiers != was_retries.tiers:
            self.tiers = TierTable(retries.tiers)
        if retries.budget != was_retries.budget:
            self.budget = RetryBudget.from_policy(retries.budget)
        if policy.resume.budget != previous.resume.budget or retries.budget != was_retries.budget:
            self.resume_budget = _resume_budget(policy)
        self.retry_on = frozenset(retries.on)
        for model in policy.models:  # histograms of dropped models stay (in-flight requests)
            self.stats.duration.setdefault(model, Histogram())
            self.stats.ttfb.setdefault(model, Histogram())
        self.refresh_routable()
        return added

    def has_room(self, besides: InstanceState, now: float, avoid: Sequence[InstanceState]) -> bool:
        """Whether an instance other than `besides` (and those in `avoid`) takes traffic and
        has a free slot, as far as the gateway can tell: below its concurrency limit (in
        pools with admission), and not with every slot it was seen using busy streaming while
        more attempts wait for a first byte there (an engine's queue: a hedge would wait in it
        too). The most streams seen at once is what an instance did, not all it can do: only
        with a queue behind it does it mean full."""

        def free(inst: InstanceState) -> bool:
            busy = inst.in_flight + inst.ghosts_at(now)
            limiter = inst.limiter
            if limiter is not None and busy >= limiter.limit:
                return False
            slots = inst.capacity_seen
            return slots == 0 or inst.streaming < slots or busy <= inst.streaming

        return any(
            inst is not besides and inst not in avoid and inst.takes_traffic(now) and free(inst)
            for inst in self.routable
        )

    def sound_elsewhere(self, tried: Sequence[InstanceState], now: float) -> bool:
        """Whether an instance this request has not `tried` can take it at `now` (admitting,
        not paused, not saturated) and fails less often than `TierTable.sound_below`: the
        pool's failures sit on some of its instances, not on all of them."""
        bound = self.tiers.sound_below
        return any(
            inst not in tried
            and inst.takes_traffic(now)
            and inst.breaker.failure_share(now) < bound
            for inst in self.routable
        )

    def alone(
        self, instance: InstanceState, now: float, avoid: Sequence[InstanceState] = ()
    ) -> bool:
        """Whether no instance but `instance` can take a request at `now` (healthy, admitting,
        not paused, not saturated; those in `avoid` do not count)."""
        return not any(
            inst is not instance and inst not in avoid and inst.takes_traffic(now)
            for inst in self.routable
        )

    def unavailable_admitting(self, now: float, besides: str = "", back: str = "") -> int:
        """How many instances but `besides` whose breakers admit (or that are `back`, an
        isolated one the cap asks about as if let back) cannot take traffic at `now` all the
        same (unhealthy or not checked yet, paused by a Retry-After, saturated): the pool's
        isolation cap counts them as out (`PoolBreakers`)."""
        return sum(
            1
            for inst in self.instances
            if inst.name != besides
            and (inst.breaker.state == ADMITTING or inst.name == back)
            and not inst.available(now)
        )

    def instance_named(self, name: str) -> InstanceState | None:
        return next((inst for inst in self.instances if inst.name == name), None)

    def rejoined(
        self, instance: InstanceState, now: float, ramp: bool = True, healthy: bool = False
    ) -> None:
        """`instance` is back in traffic: its health checks pass again, or its breaker admits
        again (a probe answered, another replica lifted or withdrew its isolation). An
        operator's restore vouches for it more: `Operations.operator` costs it as the quickest
        of its peers.

        Its latency estimate still holds what it was before it left: slow answers, or the
        penalty of failures the isolation cap kept in rotation (`failure_penalty_s`). A peak
        EWMA forgets that only with its time constant (10 s), so power of two choices would
        pass it over for tens of seconds while the others carry its share and slow down. It
        starts again at the average estimate of the instances that take traffic with it, as
        an instance with no timed answer is costed: it gets its share at once, by what it has
        in flight, and its first answer replaces that guess (`PeakEwma.guessing`). With no
        such estimate to go by (it is alone, or none of the others has answered yet), it
        starts again as an instance that never answered.

        Its share then ramps up over `breaker.slow_start` (`pipeline.pick`): priced by what it
        has in flight alone, an instance back from a fault would take a whole queue's backlog
        within a few picks, the load that may have brought it down (an engine out of memory).
        Not a new instance's first health check (`ramp` False): it has no fault behind it. An
        instance whose health checks just passed (`healthy`), for the first time or again,
        ramps over `health.slow_start` as well, the longer of the two."""
        peers = self.peer_latencies(instance, now)
        latency = sum(peers) / len(peers) if peers else DEFAULT_RTT_S
        policy = self.policy
        ramp_s = policy.breaker.slow_start if ramp else 0.0
        if healthy and policy.health.slow_start > ramp_s:
            ramp_s = policy.health.slow_start
        instance.price.start_afresh(now, latency, ramp_s)

    def peer_latencies(
        self, instance: InstanceState, now: float, answered: bool = False
    ) -> list[float]:
        """The balancer's latency estimates (peak EWMAs, on their own answers) of the other
        instances that take traffic: what `instance` is priced against when it rejoins, fails
        under the isolation cap, or an operator restores it (`answered`: only those that have
        answered, whose estimate is no guess)."""
        return [
            inst.price.peak.get(now)
            for inst in self.routable
            if inst is not instance
            and inst.breaker.state == ADMITTING
            and (inst.price.peak.learned or not answered)
        ]

    def refused(self, instance: InstanceState, reason: str) -> HealthChange | None:
        """A request's connection to `instance` was refused: with health checks, it leaves
        rotation now (`HealthState.refused`), whatever the isolation cap, which bounds the
        breakers' passive verdicts only: a refused connection is no statistical guess. Its
        checks bring it back. Without health checks nothing would, so the breaker decides
        (`Account`). The change of verdict, or None."""
        if not self.policy.health.enabled:
            return None
        change = instance.health.refused(reason)
        if change is not None:
            self.refresh_routable()
        return change

    def refresh_routable(self) -> None:
        """Recompute the healthy instances (on every change of a health verdict)."""
        self.routable = [inst for inst in self.instances if inst.health.healthy]
        self.capacity_changed()

    def capacity_changed(self) -> None:
        """An instance came back, got unsaturated or was restored: tell whoever waits."""
        for listener in self.capacity_listeners:
            listener()


def _found_for(policy: PoolPolicy, found: DiscoveredSet | None) -> DiscoveredSet | None:
    """A pool's record of what discovery found: kept across reloads while it has discovery."""
    discovery = policy.discovery
    if discovery is None:
        return None
    if found is None:
        return DiscoveredSet(discovery.grace)
    found.grace_s = discovery.grace
    return found


def with_discovered(
    policy: PoolPolicy, found: DiscoveredSet | None, endpoints: Sequence[Endpoint]
) -> tuple[PoolPolicy, tuple[Endpoint, ...]]:
    """The pool's listed instances, then the found `endpoints`, and those of them in use. A
    found name that a listed instance has is left out (`DiscoveredSet.shadowed`): the list is
    the operator's word."""
    if found is None or policy.discovery is None:
        return policy, ()
    scheme = policy.discovery.scheme
    listed = {inst.name for inst in policy.instances}
    found.shadowed = tuple(e.name for e in found.endpoints if e.name in listed)
    used = tuple(e for e in endpoints if e.name not in listed)
    if not used:
        return policy, ()
    extra = tuple(InstancePolicy(name=e.name, url=e.url(scheme)) for e in used)
    return policy.model_copy(update={"instances": policy.instances + extra}), used


def _new_instance(
    pool_name: str, inst: InstancePolicy, policy: PoolPolicy, breaker: BreakerState, now: float
) -> InstanceState:
    """A new instance of a pool run on `policy`: unchecked while the pool has health checks,
    else healthy from the start, as if its first check had just passed (`health.slow_start`)."""
    health = policy.health
    admission = policy.admission
    state = InstanceState(
        pool_name,
        inst,
        policy.timeouts.smoothing,
        HealthState(now, health.healthy_threshold, health.unhealthy_threshold)
        if health.enabled
        else HealthState.assumed_healthy(now),
        breaker,
        now,
        limiter_for(admission.concurrency) if admission else None,
        budget_for(admission.tokens if admission else None),
    )
    if not health.enabled:
        state.price.start_afresh(now, None, health.slow_start)
    return state


def _resume_budget(policy: PoolPolicy) -> RetryBudget:
    """Resumes allowed: `resume.budget` of the streams that reached their first byte over the
    last 10 s, plus the retry budget's `min_per_second`."""
    return RetryBudget(policy.resume.budget, policy.retries.budget.min_per_second)
