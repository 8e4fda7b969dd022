"""Runtime state of pools and instances, built once from a policy."""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from yarl import URL

from gateway.config import InstancePolicy, Policy, PoolPolicy
from gateway.config.models import TokenBudgetPolicy
from gateway.config.routes import KNOWN_ROUTES
from gateway.core.balancer import (
    DEFAULT_RTT_S,
    PENALTY_TAU_S,
    PeakEwma,
    priced_answer_s,
    priced_first_byte_s,
    slow_start_weight,
)
from gateway.core.breaker import ADMITTING, BreakerState, PoolBreakers
from gateway.core.budget import RetryBudget
from gateway.core.concurrency import Limiter, TokenBudget, limiter_for
from gateway.core.discovery import DiscoveredSet, Endpoint
from gateway.core.failure_rate import FailureRateState
from gateway.core.health import HealthChange, HealthState
from gateway.core.histogram import Histogram
from gateway.core.latency import LatencyState, pool_prior
from gateway.core.tiers import TierTable
from gateway.core.timeouts import (
    MAX_DOUBLINGS,
    NO_LOAD,
    AttemptTimeouts,
    Load,
    attempt_timeouts,
    hedge_delay,
)
from gateway.upstream.stats import InstanceStats, PoolStats
from gateway.upstream.tls import client_ssl

# Client headers that carry API keys: never forwarded when the gateway authenticates clients
# itself or sends a credential of its own (a client's key must not reach a backend).
CLIENT_KEY_HEADERS = frozenset({"authorization", "x-api-key"})
# An instance's room when nothing caps it (no concurrency limiter).
UNCAPPED = 1 << 30
# What an engine whose gauges are read is given before it has shown what it runs, and how much
# more than the most it was seen running until it has been seen queueing (a read every 500 ms:
# from 16 to 1024 in 1.5 s).
ENGINE_START = 16
SLOW_START_GROWTH = 4


class InstanceState:
    """One backend instance: identity, precomputed URLs, and live counters."""

    __slots__ = (
        "_base_path",
        "_base_url",
        "answered_sent_at",
        "base_url",
        "breaker",
        "budget",
        "capacity_seen",
        "engine_batch",
        "engine_gauges",
        "engine_paced",
        "engine_peak",
        "engine_slots",
        "failures",
        "ghosts",
        "ghosts_until",
        "health",
        "health_wanted",
        "hold_released_at",
        "hold_started_at",
        "hold_until",
        "holds",
        "in_flight",
        "latency",
        "limiter",
        "name",
        "name_header",
        "not_before",
        "peak",
        "penalty",
        "pool_name",
        "progress_at",
        "races_lost",
        "ramp_from",
        "ramp_s",
        "requests",
        "saturated",
        "stats",
        "streaming",
        "tokens_held",
        "urls",
        "vllm_cache_usage",
        "vllm_waiting",
    )

    def __init__(
        self,
        pool_name: str,
        policy: InstancePolicy,
        smoothing: float,
        health: HealthState,
        breaker: BreakerState,
        now: float,
        limiter: Limiter | None = None,
        budget: TokenBudget | None = None,
    ) -> None:
        self.pool_name = pool_name
        self.name = policy.name
        self.base_url = policy.url
        self.name_header = policy.name.encode()
        self._base_path = urlsplit(policy.url).path.rstrip("/")
        self._base_url = URL(policy.url)
        # The upstream target of each known route, worked out once: the policy's URL and the
        # route's path, never anything else of the client's request target.
        self.urls: dict[str, URL] = {
            path: self._base_url.with_path(self._base_path + path) for path in KNOWN_ROUTES
        }
        self.in_flight = 0
        # Streams past their first byte, and the most seen at once: how many requests the
        # instance serves at a time (an engine's slots; those beyond wait for a first byte).
        self.streaming = 0
        self.capacity_seen = 0
        # Attempts given up on before their first byte, which the engine may still be running
        # or holding in its queue until it notices (llama.cpp notices only once a slot takes
        # them): counted as in flight until `ghosts_until`.
        self.ghosts = 0
        self.ghosts_until = 0.0
        # Event-loop time of the last byte it sent on any attempt: proof that it works.
        self.progress_at = -1.0
        # When the latest-sent attempt that has had its first byte was sent: an attempt sent
        # before it and still waiting was overtaken (stuck, not waiting its turn).
        self.answered_sent_at = -1.0
        # Prompts sent to it whose prefill will pause its running streams (`holds` of them in
        # flight, the latest first-byte deadline among them), and when the last one ended:
        # idle deadlines of its streams wait for those pauses (`Watchdog`).
        self.holds = 0
        self.hold_until = 0.0
        self.hold_started_at = -1.0
        self.hold_released_at = -1.0
        # Hedges that answered before it, in a row (`pipeline.account`): reset by an answer.
        self.races_lost = 0
        self.requests = 0  # attempts sent
        self.failures = 0  # attempts that failed through the instance's fault
        self.latency = LatencyState(smoothing)
        self.health = health
        # Set when a request saw a sign that it may be down (a timeout, a refused or broken
        # connection): its health checker checks it early.
        self.health_wanted = asyncio.Event()
        self.breaker = breaker
        # Peak-EWMA of its answers' times, each priced as a short answer's: a stream's at its
        # first byte (`price_first_byte`) and at its end, an answer's at its end
        # (`price_answer`). The balancer's latency, quick to see a slowdown.
        self.peak = PeakEwma.guessing(now)
        # The price of failures the isolation cap kept in rotation (`penalize`), apart from
        # `peak` so that it never prices another instance's failure (None: none now).
        self.penalty: PeakEwma | None = None
        # Event-loop time before which it gets no new attempt (a Retry-After it asked for).
        self.not_before = 0.0
        # Its slow start after it came back into traffic (`start_afresh`): from when, and over
        # how long (0: none under way).
        self.ramp_from = float("-inf")
        self.ramp_s = 0.0
        self.stats = InstanceStats()
        # Its concurrency limit, when its pool has admission control (None: no cap).
        self.limiter = limiter
        # The KV-cache tokens of the requests it has in flight, when its pool counts them.
        self.budget = budget
        # Those tokens, counted whether or not it has a budget yet: what a budget made later
        # (its engine's first read, a reload) starts with.
        self.tokens_held = 0
        # vLLM's own gauges (None: not scraped, or the last scrape failed) and their verdict.
        self.vllm_waiting: float | None = None
        self.vllm_cache_usage: float | None = None
        self.saturated = False
        # While saturated, the attempts it may have in flight: what it had at the read less
        # the requests beyond the engine's room, at least one (so a queue that other clients
        # keep full still lets this gateway's requests through, as they would go directly).
        self.engine_slots = 1
        # The most requests its engine was seen running at once (its gauges read), and the
        # same counted from the first read that found requests waiting there (0: none yet):
        # its batch, as far as it has shown.
        self.engine_peak = 0
        self.engine_batch = 0
        # Whether its engine exports load gauges (None: not read yet, or the read failed).
        self.engine_gauges: bool | None = None
        # Paced by its engine's gauges (`room`): since a read found them, until one finds none.
        # A read that fails changes nothing: a faulty network is no reason to fall back to a
        # limit learned from the same faults.
        self.engine_paced = False

    def start_afresh(
        self, now: float, latency_s: float | None, ramp_s: float = 0.0, vouched: bool = False
    ) -> None:
        """Back in traffic: the balancer's latency estimate starts again at a guess,
        `latency_s` (None: kept; `PoolState.rejoined` says why and how much), which its first
        answer replaces (`vouched`: an operator's word, held as an answer of its own); any
        penalty is lifted, and its slow start runs over `ramp_s` from now (0: none, and one
        under way ends)."""
        if latency_s is not None:
            self.peak = PeakEwma(now, latency_s) if vouched else PeakEwma.guessing(now, latency_s)
        self.penalty = None
        self.ramp_from = now
        self.ramp_s = ramp_s

    def ramp(self, now: float) -> float:
        """Its slow start's weight now, in (0, 1]: 1 once over (`slow_start_weight`)."""
        if now - self.ramp_from >= self.ramp_s:
            return 1.0
        return slow_start_weight(now, self.ramp_from, self.ramp_s)

    def price_first_byte(
        self, now: float, waited_s: float, pool_per_token_s: float, bound: bool = False
    ) -> None:
        """A stream's first byte came after `waited_s` (`bound`: an attempt given up on had
        waited that long without one): what the balancer learns of it now
        (`priced_first_byte_s`), at its own pace per token, or `pool_per_token_s` (its
        pool's) while it has none: priced on its wait alone, an instance's first stream
        would make it look many times cheaper than its peers, priced on their pace too, and
        it would be drawn every time until that stream ended."""
        per_token = self.latency.per_token
        pace = per_token.mean if per_token.samples else pool_per_token_s
        price = priced_first_byte_s(waited_s, pace)
        if bound:
            self.peak.at_least(now, price)
        else:
            self.peak.observe(now, price)

    def price_answer(
        self, now: float, total_s: float, tokens: int | None, first_byte_s: float | None = None
    ) -> None:
        """An answer of `tokens` output tokens took `total_s`, `first_byte_s` of it to its
        first byte (None for a whole answer: its first byte was its end, so its usual time to
        a first byte stands for that part): what the balancer learns of it
        (`priced_answer_s`)."""
        if first_byte_s is None:
            first_byte_s = self.latency.ttfb.mean  # 0 until a stream taught it
        self.peak.observe(now, priced_answer_s(total_s, first_byte_s, tokens))

    def penalize(self, now: float, latency_s: float) -> None:
        """A failure its breaker could not act on (the isolation cap held): the balancer
        prices it at `latency_s` (`failure_penalty_s`) until that fades, with a time constant
        of `PENALTY_TAU_S`: each further such failure renews it, and one that stops failing is
        soon priced by its own answers again. Kept apart from `peak`, which prices the other
        instances' penalties: priced on a penalty, one penalty would beget a larger one at
        each failure elsewhere, until every estimate is hours and latency no longer counts."""
        if self.penalty is None:
            self.penalty = PeakEwma(now, initial_s=latency_s, tau_s=PENALTY_TAU_S)
        else:
            self.penalty.observe(now, latency_s)

    def cost_latency(self, now: float) -> float:
        """The latency the balancer prices it at: its peak EWMA, or its penalty while that is
        higher (then dropped once it is not)."""
        latency = self.peak.get(now)
        penalty = self.penalty
        if penalty is not None:
            priced = penalty.get(now)
            if priced > latency:
                return priced
            self.penalty = None
        return latency

    def first_byte(self, sent_at: float, now: float) -> None:
        """An attempt sent at `sent_at` got its first byte at `now`."""
        self.progress_at = now
        if sent_at > self.answered_sent_at:
            self.answered_sent_at = sent_at

    def overtaken(self, sent_at: float) -> bool:
        """Whether an attempt sent after `sent_at` got its first byte: one sent at `sent_at`
        and still waiting is stuck there (a hung request), not waiting its turn."""
        return self.answered_sent_at > sent_at

    def over_capacity(self, now: float) -> bool:
        """Whether it holds more attempts (those given up on but still in its engine included)
        than it was ever seen serving at once: one more waits for a slot there."""
        return self.in_flight + self.ghosts_at(now) > max(1, self.capacity_seen)

    def serving_a_queue(self, now: float, since: float, quiet_s: float) -> bool:
        """Whether an attempt sent at `since` that has no first byte yet waits in this
        instance's queue while the instance works through it: more attempts on it (that one
        included) than it was ever seen serving at once, a byte sent on another attempt since
        then and within the last `quiet_s`, and it still takes traffic (healthy, admitting).
        An engine that stopped sending anything is stalled, not queueing."""
        return (
            self.over_capacity(now)
            and since < self.progress_at
            and now - self.progress_at < quiet_s
            and self.health.healthy is True
            and self.breaker.state == ADMITTING
        )

    def url_of(self, path: str) -> URL:
        """The upstream target of a request on `path`: a known route's, worked out once, else
        built now (the paths of routes the gateway does not know are the clients' to choose:
        none is kept). `path` is one `config.routes.route_for` accepted."""
        url = self.urls.get(path)
        if url is None:
            url = self._base_url.with_path(self._base_path + path)
        return url

    def room(self) -> int:
        """How many attempts it may have in flight now.

        While its engine's gauges are read (`engine_paced`), what the engine has shown it
        runs: its batch plus a quarter (at least 2) once it has queued, else
        `SLOW_START_GROWTH` times the most it was seen running (at least `ENGINE_START`), as a
        slow start does; held to the engine's room while saturated.
        Both are most-ever-seen figures, so this never holds an engine below what it has run;
        the headroom lets it show more (which raises the cap), and keeps the engine's own queue
        to that headroom between two reads instead of a burst's full excess. The engine's own
        account is believed over the concurrency limiter's, which learns from latency and
        failures: those also rise when an instance is faulty rather than full, which its
        breaker and the balancer deal with, and a limit cut for them would shed requests the
        engines could serve.

        The policy's bound (a fixed limit, or the adaptive one's maximum) holds either way.

        Otherwise its concurrency limit (without one, no cap)."""
        limiter = self.limiter
        if self.engine_paced:
            batch = self.engine_batch
            if batch:
                limit = batch + max(2, -(-batch // 4))
            else:
                limit = max(ENGINE_START, SLOW_START_GROWTH * self.engine_peak)
            if limiter is not None:
                limit = min(limit, limiter.cap)
        else:
            limit = limiter.limit if limiter is not None else UNCAPPED
        return min(limit, self.engine_slots) if self.saturated else limit

    @property
    def room_guessed(self) -> bool:
        """Whether its room is only the adaptive limiter's guess: no engine gauges pace it or
        say it is saturated, and the policy fixes no limit. Such a room holds requests back
        only while they flood the pool (`gateway.pipeline.admit`)."""
        limiter = self.limiter
        return (
            limiter is not None and limiter.learned and not self.engine_paced and not self.saturated
        )

    @property
    def idle_stretch(self) -> float:
        """How far its streams' idle timeouts are backed off after cuts (see LatencyState)."""
        cuts = self.latency.idle_timeouts_in_row
        return 2.0 ** min(cuts, MAX_DOUBLINGS) if cuts else 1.0

    def abandoned(self, now: float, for_s: float) -> None:
        """An attempt was given up on before its first byte: count it for `for_s` more."""
        self.ghosts = self.ghosts_at(now) + 1
        self.ghosts_until = max(self.ghosts_until, now + for_s)

    def ghosts_at(self, now: float) -> int:
        return self.ghosts if now < self.ghosts_until else 0

    def hold(self, now: float, until: float) -> None:
        """A prompt long enough to pause the streams was sent; it will prefill by `until`."""
        if self.holds == 0:
            self.hold_started_at = now
        self.holds += 1
        if until > self.hold_until:
            self.hold_until = until

    def release_hold(self, now: float) -> None:
        """That prompt's first byte came (its prefill is over), or its attempt ended."""
        self.holds -= 1
        if self.holds <= 0:
            self.holds = 0
            self.hold_until = 0.0
            self.hold_released_at = now


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
        "next_index",
        "policy",
        "prior",
        "prior_at",
        "resume_budget",
        "retry_on",
        "rng",
        "routable",
        "ssl",
        "stats",
        "strip_headers",
        "tiers",
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
        # The pool's latency figures for instances that have not learned their own, and when
        # they were last worked out (they move slowly: once a second is plenty).
        self.prior: LatencyState | None = None
        self.prior_at = -1.0
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
        admission, was = policy.admission, previous.admission
        health = policy.health
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
            inst.latency.set_smoothing(policy.timeouts.smoothing)
            if not health.enabled:
                if previous.health.enabled:
                    inst.health = HealthState.assumed_healthy(now)
                    inst.start_afresh(now, None, health.slow_start)
            else:
                inst.health.set_thresholds(health.healthy_threshold, health.unhealthy_threshold)
            concurrency = admission.concurrency if admission else None
            if concurrency != (was.concurrency if was else None):
                inst.limiter = limiter_for(concurrency) if concurrency else None
            tokens = admission.tokens if admission else None
            if tokens != (was.tokens if was else None):
                used = inst.budget.used if inst.budget is not None else inst.tokens_held
                inst.budget = _budget(tokens)  # sized again by its engine's next read
                if inst.budget is not None:
                    inst.budget.used = used  # tokens of requests in flight stay counted
            if admission is None or admission.vllm_signals is None:
                inst.saturated = False  # nobody scrapes it any more
                inst.vllm_waiting = inst.vllm_cache_usage = inst.engine_gauges = None
                inst.engine_batch = inst.engine_peak = 0
                inst.engine_paced = False
            instances.append(inst)
        retries, was_retries = policy.retries, previous.retries
        # The swap: plain assignments, no await in between.
        if policy.tls != previous.tls:  # same settings: same context, pooled connections kept
            self.ssl = client_ssl(policy.tls, self.name)
        self.policy = policy
        self.breakers = breakers
        self.instances = instances
        self.prior = None  # worked out again from the new instances and settings
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

    def latency_prior(self, now: float) -> LatencyState:
        """What the pool's learned instances say about one that has not learned (cached 1 s)."""
        prior = self.prior
        if prior is None or now - self.prior_at >= 1.0:
            policy = self.policy.timeouts
            prior = pool_prior(
                (inst.latency for inst in self.instances), policy.min_samples, policy.smoothing
            )
            self.prior = prior
            self.prior_at = now
        return prior

    def timeouts_for(
        self,
        inst: InstanceState,
        k: float,
        now: float,
        *,
        stream: bool,
        max_tokens: int | None,
        jitter_s: float = 0.0,
        load: Load = NO_LOAD,
        final: bool = False,
    ) -> AttemptTimeouts:
        """The timeouts an attempt on `inst` gets (`attempt_timeouts`), from its own figures or,
        while they are young, its pool's prior."""
        policy = self.policy.timeouts
        latency = inst.latency
        prior = self.latency_prior(now) if latency.young(policy.min_samples) else None
        return attempt_timeouts(
            latency,
            policy,
            k,
            stream=stream,
            max_tokens=max_tokens,
            jitter_s=jitter_s,
            prior=prior,
            load=load,
            final=final,
        )

    def hedge_delay(
        self, inst: InstanceState, now: float, *, stream: bool, max_tokens: int | None
    ) -> float | None:
        """When an attempt about to be sent to `inst` gets a hedge if it has no first byte
        (`hedge_delay`), counting the attempts the gateway already has there."""
        policy = self.policy.timeouts
        latency = inst.latency
        prior = self.latency_prior(now) if latency.young(policy.min_samples) else None
        load = Load(
            inst.in_flight + inst.ghosts_at(now),
            inst.capacity_seen,
            0,
            now - inst.progress_at,
        )
        return hedge_delay(
            latency,
            policy,
            self.policy.hedging.k,
            stream=stream,
            max_tokens=max_tokens,
            prior=prior,
            load=load,
        )

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
            inst is not besides and inst not in avoid and _takes_traffic(inst, now) and free(inst)
            for inst in self.routable
        )

    def sound_elsewhere(self, tried: Sequence[InstanceState], now: float) -> bool:
        """Whether an instance this request has not `tried` can take it at `now` (admitting,
        not paused, not saturated) and fails less often than `TierTable.sound_below`: the
        pool's failures sit on some of its instances, not on all of them."""
        bound = self.tiers.sound_below
        return any(
            inst not in tried
            and _takes_traffic(inst, now)
            and inst.breaker.failure_share(now) < bound
            for inst in self.routable
        )

    def alone(
        self, instance: InstanceState, now: float, avoid: Sequence[InstanceState] = ()
    ) -> bool:
        """Whether no instance but `instance` can take a request at `now` (healthy, admitting,
        not paused, not saturated; those in `avoid` do not count)."""
        return not any(
            inst is not instance and inst not in avoid and _takes_traffic(inst, now)
            for inst in self.routable
        )

    def unavailable_admitting(self, now: float, besides: str = "") -> int:
        """How many instances but `besides` whose breakers admit cannot take traffic at `now`
        all the same (unhealthy or not checked yet, paused by a Retry-After, saturated): the
        pool's isolation cap counts them as out (`PoolBreakers`)."""
        return sum(
            1
            for inst in self.instances
            if inst.name != besides
            and inst.breaker.state == ADMITTING
            and not _otherwise_available(inst, now)
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
        instance.start_afresh(now, latency, ramp_s)

    def peer_latencies(self, instance: InstanceState, now: float) -> list[float]:
        """The balancer's latency estimates (peak EWMAs, on their own answers) of the other
        instances that take traffic: what `instance` is priced against when it rejoins or
        fails under the isolation cap."""
        return [
            inst.peak.get(now)
            for inst in self.routable
            if inst is not instance and inst.breaker.state == ADMITTING
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


def _takes_traffic(inst: InstanceState, now: float) -> bool:
    """Whether a routable (healthy) instance takes a request at `now`: its breaker admits,
    no Retry-After pauses it, its engine is not saturated."""
    return inst.breaker.state == ADMITTING and inst.not_before <= now and not inst.saturated


def _otherwise_available(inst: InstanceState, now: float) -> bool:
    return inst.health.healthy is True and inst.not_before <= now and not inst.saturated


def _new_instance(
    pool_name: str, inst: InstancePolicy, policy: PoolPolicy, breaker: BreakerState, now: float
) -> InstanceState:
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
        _budget(admission.tokens if admission else None),
    )
    if not health.enabled:
        # Healthy from the start, as if its first check had just passed: `health.slow_start`.
        state.start_afresh(now, None, health.slow_start)
    return state


def _budget(tokens: TokenBudgetPolicy | None) -> TokenBudget | None:
    """The token budget the policy gives an instance before its engine says its size."""
    if tokens is None or tokens.capacity is None:
        return None
    return TokenBudget(tokens.capacity, tokens.overcommit)


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


def _resume_budget(policy: PoolPolicy) -> RetryBudget:
    """Resumes allowed: `resume.budget` of the streams that reached their first byte over the
    last 10 s, plus the retry budget's `min_per_second`."""
    return RetryBudget(policy.resume.budget, policy.retries.budget.min_per_second)
