"""How much concurrent work one instance is given: an adaptive limit, a KV-cache token budget,
and vLLM's own saturation signals.

Pure: `now` (monotonic seconds) is an argument; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
from typing import Protocol

from gateway.config.models import ConcurrencyPolicy

# Products such as 0.29 * 100 land a hair under the integer they mean.
_EPSILON = 1e-9
# The gradient's floor: one sample can at most halve the (unsmoothed) target.
MIN_GRADIENT = 0.5
# Slow samples in a row (each beyond its tolerance, the gradient below 1) after which a cut
# starts from twice the load.
SNAP_AFTER = 4
# How long after an instance's engine last refused a request for load (an out-of-memory error,
# 429, 503, 529) its learned limit is the engine's word rather than a guess.
REFUSAL_HOLD_S = 10.0


class Limiter(Protocol):
    """What the shell needs of a concurrency limiter (`GradientLimiter`, `FixedLimiter`)."""

    @property
    def limit(self) -> int:
        """How many requests the instance may have in flight."""
        ...

    @property
    def cap(self) -> int:
        """The most it may ever allow: the policy's bound, whatever it learns."""
        ...

    @property
    def learned(self) -> bool:
        """Whether the limit is learned from latency and failures (a guess at the instance's
        capacity) rather than set by the policy."""
        ...

    def record(
        self,
        now: float,
        latency_s: float | None,
        in_flight: int,
        overloaded: bool = False,
        per_token_s: float | None = None,
        refused: bool = False,
    ) -> None:
        """Learn from one finished request."""
        ...

    def admits(self, in_flight: int) -> bool:
        """Whether one more request may be sent with `in_flight` already in flight."""
        ...

    def refused_lately(self, now: float) -> bool:
        """Whether the engine refused a request for load within `REFUSAL_HOLD_S`."""
        ...


class Signal:
    """One latency signal of a `GradientLimiter`: a fast `recent` and a slow `baseline`, and
    the gradient `clamp(tolerance · baseline / recent, 0.5, 1.0)` they give (rules in the
    limiter's docstring)."""

    __slots__ = ("baseline", "last_sample", "recent", "samples", "tolerance")

    def __init__(self, tolerance: float) -> None:
        if not tolerance >= 1.0:
            raise ValueError(f"tolerance must be at least 1, got {tolerance}")
        self.tolerance = tolerance
        self.recent = 0.0
        self.baseline = 0.0
        self.samples = 0
        self.last_sample = 0.0

    def slow(self, value: float) -> bool:
        """Whether one sample, on its own, is beyond the tolerance of the baseline."""
        return self.samples > 0 and value > self.tolerance * self.baseline

    def observe(self, now: float, value: float, recent_weight: float, half_life: float) -> float:
        """Take one sample (finite, > 0); the gradient after it."""
        if self.samples == 0:
            self.recent = value
            self.baseline = value
        else:
            self.recent += recent_weight * (value - self.recent)
            elapsed = max(0.0, now - self.last_sample)
            weight = 1.0 - 2.0 ** (-elapsed / half_life)
            self.baseline += weight * (self.recent - self.baseline)
        self.last_sample = now
        self.samples += 1
        return min(1.0, max(MIN_GRADIENT, self.tolerance * self.baseline / self.recent))


def _usable(value: float | None) -> bool:
    return value is not None and 0.0 < value < math.inf


class GradientLimiter:
    """An adaptive concurrency limit for one instance (after Netflix's Gradient2 and Envoy's
    adaptive concurrency). The rules, exactly:

    **Signals.** `record(now, latency_s, in_flight, per_token_s=...)` takes one successful
    request's latency figures and the load it saw: the requests in flight on the instance
    (this one included; the shell gives the more of when it was sent and when it finished).
    Two signals, each a `Signal` with its own tolerance:

    - **first token** (`latency_s`): a stream's time to first token. It grows once the engine
      starts queueing;
    - **per token** (`per_token_s`): a whole answer's latency over its output tokens, for
      answers that stream no first token. It grows with the engine's queue too (amortised over
      the answer), and with a fuller batch decoding each token more slowly, which is the engine
      trading latency for throughput as designed: hence its larger tolerance.

    Per signal:

    - `recent` (fast): `recent += recent_weight · (sample - recent)`, per sample;
    - `baseline` (slow, per second rather than per sample): `baseline += w · (recent -
      baseline)` with `w = 1 - 2^(-Δt / baseline_half_life)`, Δt the seconds since the
      signal's previous sample (0 if the clock went back). It moves halfway to the recent
      latency every `baseline_half_life` seconds, however many requests there are: an instance
      that became slower for good is relearned, and the limit it allows grows back. The price:
      queueing that lasts that long is taken for the instance's new normal too.

    A signal's first sample sets both to it. A sample that is not finite and > 0 (or None) is
    ignored; a successful request with neither counts as a gradient of 1 (no sign of
    congestion: the additive increase that heals overload cuts on traffic that never measures
    latency, such as embeddings).

    **How they combine.** Both move one shared estimate: a request's gradient is its signal's
    `clamp(tolerance · baseline / recent, 0.5, 1.0)` (the smaller of the two when it carries
    both), so whichever kind of traffic sees the engine congested pulls the limit down, and
    traffic of the other kind cannot hold it up for long: its gradient of 1 only lets the
    estimate grow by its square root.

    **Limit** (a float `estimate`, published as `limit = max(min_limit, ⌊estimate⌋)`). After
    each sample:

    - when this is the `SNAP_AFTER`th sample in a row that is slow on its own (beyond its
      signal's `tolerance · baseline`) with a gradient below 1 (or a later one of that run) and
      the estimate is above `2 · in_flight`, the estimate is first brought
      down to `max(min_limit, 2 · in_flight)`: the part of a limit above twice the load held
      nothing back while the queue grew, and a cut that has to eat through it one sample at a
      time (a limit that starts open at 1024) comes seconds too late. One slow sample (a long
      prompt) never does this;
    - `target = estimate · gradient + sqrt(estimate)` (the square root is the headroom that
      lets it probe for more);
    - if `target > estimate` and the instance was not busy (`2 · in_flight < limit`), nothing
      changes: an instance used at less than half its limit says nothing about a higher one
      (it may still shrink);
    - else `estimate += smoothing · (target - estimate)`, clamped to `[min_limit, max_limit]`.

    So, past any such snap, the estimate shrinks only when `gradient < 1 - 1/sqrt(estimate)`
    (recent latency above `tolerance · baseline / (1 - 1/sqrt(estimate))`) and settles, under
    sustained load, where `estimate · (1 - gradient) = sqrt(estimate)`. With the gradient's
    floor at 0.5, an estimate of 4 or less never shrinks by the gradient, only by overload.

    **Overload.** `record(..., overloaded=True)` (a 503, 429, out-of-memory, timeout: the
    instance is past its capacity) learns no latency; it cuts `estimate ← max(min_limit,
    estimate · backoff_ratio)`, at most once per `backoff_interval` seconds (the failures of one
    burst are one signal, not one per request). `cuts` counts them. When the engine itself
    refused the request for load (`refused`: an out-of-memory error, 429, 503, 529, not a
    timeout, which a frozen instance gives too), the cut starts from the load that request saw
    if that is lower: `estimate ← max(min_limit, min(estimate, in_flight) · backoff_ratio)`.
    A limit that starts open (1024) is then where the engine stops coping after one round
    trip, not after a dozen cuts a second apart; and `refused_lately(now)` says for
    `REFUSAL_HOLD_S` after each such refusal that the limit is the engine's word, not a guess.
    Meanwhile a success that would raise the limit raises it by `1 / estimate` only (one per
    limit's worth of successes: one per round trip, as AIMD's additive increase), so the limit
    stays below where the engine refused for seconds rather than growing back past it within
    one; the next refusal cuts it again: AIMD around what the engine runs.
    """

    __slots__ = (
        "_backoff_interval",
        "_backoff_ratio",
        "_baseline_half_life",
        "_congested_run",
        "_last_cut",
        "_max_limit",
        "_min_limit",
        "_recent_weight",
        "_refused_at",
        "_smoothing",
        "cuts",
        "estimate",
        "first_token",
        "per_token",
    )

    def __init__(
        self,
        initial_limit: float = 32.0,
        min_limit: int = 4,
        max_limit: int = 256,
        tolerance: float = 1.5,
        smoothing: float = 0.2,
        recent_weight: float = 0.2,
        baseline_half_life: float = 600.0,
        backoff_ratio: float = 0.8,
        backoff_interval: float = 1.0,
        per_token_tolerance: float = 2.0,
    ) -> None:
        if not 1 <= min_limit <= initial_limit <= max_limit:
            raise ValueError(
                "limits must satisfy 1 <= min_limit <= initial_limit <= max_limit, got "
                f"{min_limit}, {initial_limit}, {max_limit}"
            )
        for name, weight in (("smoothing", smoothing), ("recent_weight", recent_weight)):
            if not 0.0 < weight <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {weight}")
        if not baseline_half_life > 0.0:
            raise ValueError(f"baseline_half_life must be > 0, got {baseline_half_life}")
        if not 0.0 < backoff_ratio < 1.0:
            raise ValueError(f"backoff_ratio must be in (0, 1), got {backoff_ratio}")
        if not backoff_interval >= 0.0:
            raise ValueError(f"backoff_interval must be >= 0, got {backoff_interval}")
        self.first_token = Signal(tolerance)
        self.per_token = Signal(per_token_tolerance)
        self.estimate = float(initial_limit)
        self._min_limit = min_limit
        self._max_limit = max_limit
        self._smoothing = smoothing
        self._recent_weight = recent_weight
        self._baseline_half_life = baseline_half_life
        self._backoff_ratio = backoff_ratio
        self._backoff_interval = backoff_interval
        self.cuts = 0
        self._last_cut = -math.inf
        self._refused_at = -math.inf  # when the engine last refused a request for load
        self._congested_run = 0  # slow samples in a row with a gradient below 1

    # The first-token signal's figures, as they were before there were two.
    @property
    def recent(self) -> float:
        return self.first_token.recent

    @property
    def baseline(self) -> float:
        return self.first_token.baseline

    @property
    def samples(self) -> int:
        return self.first_token.samples + self.per_token.samples

    @property
    def cap(self) -> int:
        """`max_limit`."""
        return self._max_limit

    @property
    def learned(self) -> bool:
        """True: the limit is learned."""
        return True

    @property
    def limit(self) -> int:
        """`max(min_limit, ⌊estimate⌋)`."""
        return max(self._min_limit, math.floor(self.estimate + _EPSILON))

    def admits(self, in_flight: int) -> bool:
        """`in_flight < limit`."""
        return in_flight < self.limit

    def refused_lately(self, now: float) -> bool:
        """Whether the engine refused a request for load less than `REFUSAL_HOLD_S` ago."""
        return now - self._refused_at < REFUSAL_HOLD_S

    def record(
        self,
        now: float,
        latency_s: float | None,
        in_flight: int,
        overloaded: bool = False,
        per_token_s: float | None = None,
        refused: bool = False,
    ) -> None:
        """Learn from one finished request (rules in the class docstring)."""
        if overloaded or refused:
            if refused:
                self._refused_at = now
            if now - self._last_cut >= self._backoff_interval:
                self._last_cut = now
                self.cuts += 1
                base = min(self.estimate, float(in_flight)) if refused else self.estimate
                self.estimate = max(float(self._min_limit), base * self._backoff_ratio)
            return
        gradient = math.inf
        slow = False  # this sample on its own beyond a tolerance
        weight, half_life = self._recent_weight, self._baseline_half_life
        if _usable(latency_s):
            assert latency_s is not None
            slow = self.first_token.slow(latency_s)
            gradient = self.first_token.observe(now, latency_s, weight, half_life)
        if _usable(per_token_s):
            assert per_token_s is not None
            slow = slow or self.per_token.slow(per_token_s)
            gradient = min(gradient, self.per_token.observe(now, per_token_s, weight, half_life))
        if gradient == math.inf:
            # A success without latency figures (an embedding, an answer without usage): no
            # sign of congestion, so it counts as a gradient of 1, as an additive increase
            # does: cuts by overload heal on traffic that never measures latency.
            gradient = 1.0
        estimate = self.estimate
        if gradient < 1.0 and slow:
            self._congested_run += 1
            if self._congested_run >= SNAP_AFTER and estimate > 2 * in_flight:
                # Congested for a while, with a limit above twice the load: that much of it
                # held nothing back, so the cut starts from there rather than eating through it
                # one sample at a time while the queue grows. (Not on one slow sample: a long
                # prompt's first token is no congestion.)
                estimate = float(max(self._min_limit, 2 * in_flight))
        else:
            self._congested_run = 0
        target = estimate * gradient + math.sqrt(estimate)
        if target > estimate and 2 * in_flight < self.limit:
            return  # app-limited: no evidence for a higher limit
        if target > estimate and self.refused_lately(now):
            # Near where the engine refused work: grow by one per limit's worth of successes
            # (one a round trip, as AIMD), not the square root per sample, which would be
            # back past the refusal within a second.
            estimate += 1.0 / max(estimate, 1.0)
        else:
            estimate += self._smoothing * (target - estimate)
        self.estimate = min(float(self._max_limit), max(float(self._min_limit), estimate))

    def __repr__(self) -> str:
        return (
            f"GradientLimiter(limit={self.limit}, estimate={self.estimate:.6g}, "
            f"first_token={self.first_token.recent:.6g}/{self.first_token.baseline:.6g}, "
            f"per_token={self.per_token.recent:.6g}/{self.per_token.baseline:.6g})"
        )


class FixedLimiter:
    """A constant limit (for policies that fix the cap): `admits(in_flight)` is
    `in_flight < limit`; `record` learns nothing."""

    __slots__ = ("_limit",)

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the limit must be at least 1, got {limit}")
        self._limit = limit

    @property
    def limit(self) -> int:
        """The fixed limit."""
        return self._limit

    @property
    def cap(self) -> int:
        """The fixed limit."""
        return self._limit

    @property
    def learned(self) -> bool:
        """False: the policy set it."""
        return False

    def admits(self, in_flight: int) -> bool:
        """`in_flight < limit`."""
        return in_flight < self._limit

    def refused_lately(self, now: float) -> bool:
        """False: a fixed limit binds whatever the engine says."""
        return False

    def record(
        self,
        now: float,
        latency_s: float | None,
        in_flight: int,
        overloaded: bool = False,
        per_token_s: float | None = None,
        refused: bool = False,
    ) -> None:
        """Nothing to learn."""

    def __repr__(self) -> str:
        return f"FixedLimiter({self._limit})"


class TokenBudget:
    """The KV-cache tokens one instance is trusted with: `budget = ⌊capacity_tokens ·
    overcommit⌋`.

    `try_acquire(tokens)` admits when `used + tokens ≤ budget`, and also, so that it is not
    refused forever, a request larger than the whole budget when nothing is in use
    (`used == 0`); admitted tokens count in `used` until `release`. The overcommit (1.3 by
    default) bets that requests rarely reach their `max_tokens`, and that vLLM preempts or
    queues what does not fit rather than failing it.
    """

    __slots__ = ("budget", "capacity_tokens", "overcommit", "used")

    def __init__(self, capacity_tokens: int, overcommit: float = 1.3, used: int = 0) -> None:
        """`used`: tokens already held when it is made (a budget sized again, its requests in
        flight still counted)."""
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be at least 1, got {capacity_tokens}")
        if not 0.0 < overcommit < math.inf:
            raise ValueError(f"overcommit must be > 0, got {overcommit}")
        self.capacity_tokens = capacity_tokens
        self.overcommit = overcommit
        self.budget = max(1, math.floor(capacity_tokens * overcommit + _EPSILON))
        self.used = used

    @property
    def available(self) -> int:
        """`max(0, budget - used)` (0 while an oversized request holds more than the budget)."""
        return max(0, self.budget - self.used)

    def fits(self, tokens: int) -> bool:
        """Whether `tokens` more fit (rule in the class docstring)."""
        used = self.used
        return used + tokens <= self.budget or used == 0

    def acquire(self, tokens: int) -> None:
        """Count `tokens` as in use (the caller checked `fits`, or chose to over-commit)."""
        self.used += tokens

    def try_acquire(self, tokens: int) -> bool:
        """Whether `tokens` more fit (rule in the class docstring); when they do, they count.

        Raises ValueError for a negative count.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if self.fits(tokens):
            self.used += tokens
            return True
        return False

    def release(self, tokens: int) -> None:
        """Give back what a finished request acquired; `used` is clamped at 0 (releasing more
        than is held is a caller's bug, and must not leave a negative count)."""
        self.used = max(0, self.used - tokens)

    def __repr__(self) -> str:
        return f"TokenBudget(used={self.used}, budget={self.budget})"


def prompt_tokens(prompt_bytes: int) -> int:
    """A request body's prompt size in tokens, roughly: `⌈prompt_bytes / 4⌉` (about four bytes
    a token); negative counts as 0."""
    return -(-max(0, prompt_bytes) // 4)


def estimate_tokens(prompt_bytes: int, max_tokens: int | None, assumed_max_tokens: int) -> int:
    """A request's KV-cache need: `prompt_tokens(prompt_bytes)` plus `max_tokens`, or
    `assumed_max_tokens` when the request sets none (None). Negative inputs count as 0."""
    prompt = prompt_tokens(prompt_bytes)
    completion = assumed_max_tokens if max_tokens is None else max_tokens
    return prompt + max(0, completion)


def vllm_saturated(
    waiting: float | None,
    cache_usage: float | None,
    max_waiting: float,
    max_cache_usage: float,
) -> bool:
    """Whether vLLM's own signals say the instance should get no new work now.

    True when `waiting > max_waiting` (`vllm:num_requests_waiting`) or `cache_usage >
    max_cache_usage` (`vllm:gpu_cache_usage_perc`, 0..1). A signal that is unknown (None, not
    scraped yet or stale) or NaN never saturates; a threshold of `inf` (or 1 for the cache)
    turns that test off.
    """
    if waiting is not None and waiting > max_waiting:
        return True
    return cache_usage is not None and cache_usage > max_cache_usage


def limiter_for(policy: ConcurrencyPolicy) -> Limiter:
    """The limiter a pool's `admission.concurrency` asks for, for one of its instances."""
    if policy.mode == "fixed":
        return FixedLimiter(policy.limit)
    return GradientLimiter(
        initial_limit=float(min(max(policy.initial, policy.min), policy.limit)),
        min_limit=policy.min,
        max_limit=policy.limit,
        tolerance=policy.tolerance,
        per_token_tolerance=policy.per_token_tolerance,
    )
