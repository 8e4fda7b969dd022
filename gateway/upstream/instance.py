"""One backend instance's state, and the only code that changes it.

Every other module reads an instance's fields and calls its methods: an attempt that starts or
ends, a byte that arrives, an engine read, a Retry-After, a reload. So each rule about what an
instance may do next (`takes_traffic`, `room`) reads fields that only this class writes, and a
test (`tests/test_ownership.py`) fails when another module assigns one.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from yarl import URL

from gateway.config import InstancePolicy, PoolPolicy
from gateway.config.models import TokenBudgetPolicy
from gateway.config.routes import KNOWN_ROUTES
from gateway.core.breaker import ADMITTING, BreakerState
from gateway.core.concurrency import Limiter, TokenBudget, limiter_for
from gateway.core.health import HealthState
from gateway.core.latency import LatencyState
from gateway.core.timeouts import MAX_DOUBLINGS
from gateway.core.vllm_metrics import EngineLoad
from gateway.upstream.engine_pacing import EnginePacing
from gateway.upstream.price import Price
from gateway.upstream.stall import STALL_FLOOR_S, Stall
from gateway.upstream.stats import InstanceStats

# An instance's room when nothing caps it (no concurrency limiter).
UNCAPPED = 1 << 30


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
        "engine",
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
        "pool_name",
        "price",
        "progress_at",
        "races_lost",
        "rate_limits_in_row",
        "requests",
        "stall",
        "stats",
        "streaming",
        "tokens_held",
        "urls",
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
        self.stall = Stall()  # its last engine-wide stall (`progressed`)
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
        # What the balancer prices it at.
        self.price = Price(now)
        # Event-loop time before which it gets no new attempt (a Retry-After it asked for, or
        # the backoff after 429s without one), and those 429s in a row (`rate_limited`).
        self.not_before = 0.0
        self.rate_limits_in_row = 0
        self.stats = InstanceStats()
        # Its concurrency limit, when its pool has admission control (None: no cap).
        self.limiter = limiter
        # The KV-cache tokens of the requests it has in flight, when its pool counts them.
        self.budget = budget
        # Those tokens, counted whether or not it has a budget yet: what a budget made later
        # (its engine's first read, a reload) starts with.
        self.tokens_held = 0
        # What its engine's gauges say, when they are read.
        self.engine = EnginePacing()

    def reconfigured(self, policy: PoolPolicy, previous: PoolPolicy, now: float) -> None:
        """Its pool took a reloaded `policy` (it ran on `previous`) and kept this instance:
        the new settings apply to the state it has (breaker, estimates, in-flight counts)."""
        self.latency.set_smoothing(policy.timeouts.smoothing)
        health = policy.health
        if not health.enabled:
            if previous.health.enabled:
                self.health = HealthState.assumed_healthy(now)
                self.price.start_afresh(now, None, health.slow_start)
        else:
            self.health.set_thresholds(health.healthy_threshold, health.unhealthy_threshold)
        admission, was = policy.admission, previous.admission
        concurrency = admission.concurrency if admission else None
        if concurrency != (was.concurrency if was else None):
            self.limiter = limiter_for(concurrency) if concurrency else None
        tokens = admission.tokens if admission else None
        if tokens != (was.tokens if was else None):
            used = self.budget.used if self.budget is not None else self.tokens_held
            # Sized again by its engine's next read; tokens of requests in flight stay counted.
            self.budget = budget_for(tokens, used)
        if admission is None or admission.vllm_signals is None:
            self.engine.forget()

    def takes_traffic(self, now: float) -> bool:
        """Whether it takes a request at `now`, if it is routable (healthy): its breaker
        admits, no Retry-After pauses it, its engine is not saturated. The one rule that the
        balancer's helpers, hedges, retries and the isolation cap go by."""
        return (
            self.breaker.state == ADMITTING and self.not_before <= now and not self.engine.saturated
        )

    def available(self, now: float) -> bool:
        """Whether it could take traffic at `now` whatever its breaker says: healthy, not
        paused, not saturated (the isolation cap counts those that could not as out)."""
        return self.health.healthy is True and self.not_before <= now and not self.engine.saturated

    def paused(self, now: float) -> bool:
        """Whether a Retry-After it sent (or a 429's backoff) holds attempts off at `now`."""
        return self.not_before > now

    def pause_until(self, until: float) -> None:
        """It asked for no new attempt before `until` (a Retry-After, a 429's backoff)."""
        self.not_before = until

    def rate_limited(self, now: float) -> int:
        """It answered 429 at `now`: how many in a row now, or 0 while the pause an earlier
        one set still holds (answers to attempts sent before that pause are the same refusal,
        counted once, and the pause stands)."""
        if self.not_before > now:
            return 0
        self.rate_limits_in_row += 1
        return self.rate_limits_in_row

    def not_rate_limited(self) -> None:
        """It answered something else than a 429: its next 429's backoff starts over."""
        self.rate_limits_in_row = 0

    # -- attempts ----------------------------------------------------------------------------

    def attempt_started(self, tokens: int) -> int:
        """An attempt that holds `tokens` of its KV cache was sent to it: how many it has in
        flight now, that one included."""
        self.requests += 1
        self.in_flight += 1
        self.tokens_held += tokens
        budget = self.budget
        if budget is not None:
            budget.acquire(tokens)
        return self.in_flight

    def attempt_ended(self, tokens: int) -> None:
        """That attempt no longer occupies it (whole, failed, given up or moved)."""
        self.in_flight -= 1
        self.tokens_held -= tokens
        budget = self.budget
        if budget is not None:
            budget.release(tokens)

    def unreserve(self, tokens: int) -> None:
        """Tokens admission reserved here for a request are taken over by that request's
        attempt, wherever it went."""
        budget = self.budget
        if budget is not None:
            budget.release(tokens)

    def stream_started(self) -> None:
        """An attempt's stream is past its first byte: it holds a slot until it ends."""
        streaming = self.streaming + 1
        self.streaming = streaming
        if streaming > self.capacity_seen:
            self.capacity_seen = streaming

    def stream_ended(self) -> None:
        self.streaming -= 1

    def progressed(self, at: float) -> None:
        """A piece of a stream came at `at`: it works, and a silence of all its streams ends."""
        if at - self.progress_at > STALL_FLOOR_S and self.streaming > 1:
            self.stall.heard(self.progress_at, at, self.latency.gap)
        self.progress_at = at

    def answered_well(self) -> None:
        """An attempt succeeded: the hedges it lost in a row are forgotten."""
        self.races_lost = 0

    def lost_race(self) -> int:
        """A hedge answered before it: how many in a row now (an answer ends a row)."""
        self.races_lost += 1
        return self.races_lost

    def failed(self) -> None:
        """An attempt failed through its fault."""
        self.failures += 1

    def engine_read(self, load: EngineLoad, saturated: bool, max_waiting: float) -> bool:
        """A read of its engine's gauges (`EnginePacing.read`); True when it just stopped
        being saturated."""
        waiting, running = load.waiting, load.running
        if waiting and running and running > self.capacity_seen:
            # Requests wait inside the engine: it runs all it can at once.
            self.capacity_seen = int(running)
        return self.engine.read(load, saturated, max_waiting, self.in_flight)

    def size_budget(self, kv_tokens: int, overcommit: float) -> None:
        """Its token budget from its engine's own KV-cache size (which wins over the policy's
        `capacity`: one pool may mix GPU types); tokens in use stay counted, those its attempts
        hold even before it had a budget."""
        budget = self.budget
        if budget is not None and budget.capacity_tokens == kv_tokens:
            return
        used = budget.used if budget is not None else self.tokens_held
        self.budget = TokenBudget(kv_tokens, overcommit, used)

    def first_byte(self, sent_at: float, now: float) -> None:
        """An attempt sent at `sent_at` got its first byte at `now`: it answers (a busy engine
        answers new requests seldom, but does), and the races it lost before are forgiven."""
        self.progress_at = now
        self.races_lost = 0
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

        While its engine's gauges are read (`EnginePacing.paced`), what the engine has shown
        it runs (`EnginePacing.limit`), held to the engine's room while saturated. Both are
        most-ever-seen figures, so this never holds an engine below what it has run; the
        headroom lets it show more (which raises the cap), and keeps the engine's own queue
        to that headroom between two reads instead of a burst's full excess. The engine's own
        account is believed over the concurrency limiter's, which learns from latency and
        failures: those also rise when an instance is faulty rather than full, which its
        breaker and the balancer deal with, and a limit cut for them would shed requests the
        engines could serve.

        The policy's bound (a fixed limit, or the adaptive one's maximum) holds either way.

        Otherwise its concurrency limit (without one, no cap)."""
        limiter = self.limiter
        engine = self.engine
        if engine.paced:
            limit = engine.limit()
            if limiter is not None:
                limit = min(limit, limiter.cap)
        else:
            limit = limiter.limit if limiter is not None else UNCAPPED
        return min(limit, engine.slots) if engine.saturated else limit

    @property
    def room_guessed(self) -> bool:
        """Whether its room is only the adaptive limiter's guess: no engine gauges pace it or
        say it is saturated, and the policy fixes no limit. Such a room holds requests back
        only while they flood the pool (`gateway.pipeline.admit`)."""
        limiter = self.limiter
        engine = self.engine
        return limiter is not None and limiter.learned and not engine.paced and not engine.saturated

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


def budget_for(tokens: TokenBudgetPolicy | None, used: int = 0) -> TokenBudget | None:
    """The token budget the policy gives an instance before its engine says its size
    (`used`: tokens its requests in flight hold already)."""
    if tokens is None or tokens.capacity is None:
        return None
    return TokenBudget(tokens.capacity, tokens.overcommit, used)
