"""The dynamic timeout of one attempt: `T = prediction + k·deviation + jitter`, per phase."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from gateway.core.ewma import Ewma
from gateway.core.latency import LatencyState


class TimeoutsConfig(Protocol):
    """The fields of `gateway.config.models.TimeoutsPolicy` this rule reads (seconds)."""

    @property
    def initial(self) -> float: ...
    @property
    def min_samples(self) -> int: ...
    @property
    def floor(self) -> float: ...
    @property
    def ceiling(self) -> float: ...
    @property
    def connect(self) -> float: ...
    @property
    def initial_per_token(self) -> float: ...
    @property
    def assumed_max_tokens(self) -> int: ...
    @property
    def token_headroom(self) -> float: ...
    @property
    def first_token_max(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class AttemptTimeouts:
    """What one attempt may wait for: the connection, the first byte, each gap between chunks.

    `idle_s` is None for a non-streamed request: its body comes in one piece after the first byte.
    `pause_s`: how long this request's prompt is expected to pause the streams the instance is
    already decoding (its prefill), when that is longer than their idle timeout; else 0 (also
    while the instance's prefill rate is unknown).
    """

    first_byte_s: float
    idle_s: float | None
    connect_s: float
    pause_s: float = 0.0
    # The instance's `timeouts_in_row` when this was worked out (see LatencyState.timed_out).
    backoff: int = 0
    # A stream's `idle_s` is the static `initial`: nothing learned of its gaps, by the
    # instance or its pool (the stream's own pace then tells a stall sooner: `UpstreamResponse`).
    idle_guessed: bool = False
    # The pool's `first_token_max` when it bounds this attempt (a streamed generation): its
    # first byte is not waited for past it, however the wait is stretched (the transport's
    # patience with a queue included). None: no such limit.
    limit_s: float | None = None

    @property
    def capped(self) -> bool:
        """Whether its first-byte time is the limit's, not a prediction's: the most any
        attempt of its request may wait, on any instance."""
        return self.limit_s is not None and self.first_byte_s >= self.limit_s


@dataclass(frozen=True, slots=True)
class Load:
    """What the gateway knows of the instance's load as the attempt is sent.

    `in_flight`: the gateway's other attempts on the instance; `capacity`: how many it was
    seen serving at once (streams past their first byte; 0 when never seen, taken as 1);
    `prompt_tokens`: this request's estimated prompt size; `quiet_s`: how long since the
    instance last sent a byte on any attempt.
    """

    in_flight: int = 0
    capacity: int = 0
    prompt_tokens: int = 0
    quiet_s: float = 0.0


NO_LOAD = Load()
# A last attempt (no retry may follow) waits up to this multiple of its learned first-byte time
# (never past what an unlearned instance would get): cutting it short only turns a slow answer
# into an error.
FINAL_ATTEMPT_HEADROOM = 4.0
# The prefill rate is learned from the streams an instance took at once, fewer than all: a few
# samples do (each errs high, see `LatencyState.prefill`), or a long prompt in a busy pool would
# go without its prefill for long.
PREFILL_MIN_SAMPLES = 3
# A prompt this many times the instance's usual size is a long one, whose prefill is a pause
# its running streams have not learned to expect.
LARGE_PROMPT = 2.0
# Positions in `LatencyState.estimators`.
_TTFB, _GAP, _PER_TOKEN, _PREFILL, _SERVICE = range(5)
# An instance timed from its pool's prior gets this multiple of the pool's figures (doubled
# after each timeout it has under the prior): a new or restarted instance is rescued from a
# hang within a small multiple of what its peers take, never left on the static initial value.
PRIOR_HEADROOM = 3.0
MAX_DOUBLINGS = 6


def _learned(
    estimate: Ewma, prior: Ewma | None, min_samples: int, headroom: float
) -> tuple[float, float] | None:
    """The (prediction, deviation) of an estimate: its own once it has `min_samples`, else the
    pool's prior (times `headroom`), else None (the caller decides: the configured guess)."""
    if estimate.samples >= min_samples:
        return estimate.mean, estimate.deviation
    if prior is not None and prior.samples >= min_samples:
        return prior.mean * headroom, prior.deviation * headroom
    return None


def attempt_timeouts(
    latency: LatencyState,
    policy: TimeoutsConfig,
    k: float,
    *,
    stream: bool,
    max_tokens: int | None,
    jitter_s: float,
    prior: LatencyState | None = None,
    load: Load = NO_LOAD,
    final: bool = False,
) -> AttemptTimeouts:
    """The timeouts of the next attempt on the instance whose estimators are `latency`.

    `k` comes from the retry tier; `jitter_s` is one draw of `rng.uniform(0, policy.jitter)`
    (one per attempt, so attempts started together do not all give up at the same instant).

    For an estimator with at least `min_samples` samples (the prefill rate: at least
    `min(min_samples, PREFILL_MIN_SAMPLES)`), `pred` and `dev` are its mean and deviation.
    With fewer, the pool's `prior` stands in (see `pool_prior`) when it has learned that
    estimate, with `h = PRIOR_HEADROOM · 2^timeouts_in_row` times its mean and deviation; else
    `pred = policy.initial` (`policy.initial_per_token` for the per-token rate) and `dev = 0`,
    and the prefill and service estimates count as 0. Every result is clamped to
    `[policy.floor, policy.ceiling]`. The steps, each with its rule:

    - `idle`: the longest gap a stream may wait between chunks (`_idle_s`); None for a
      non-streamed request: its body comes in one piece after the first byte;
    - `prefill`: the prompt's own prefill, and `pause`: what of it the instance's running
      streams will feel beyond what they tolerate anyway (`_prefill_s`);
    - `queue`: the wait behind the gateway's own attempts on a full instance (`_queue_s`);
    - stream: `first_byte = max(ttfb_pred, prefill) + k·ttfb_dev + queue + jitter`, never
      past `policy.first_token_max` when the pool sets it, stretched or not (`_clamped`);
    - non-streamed (the first byte is the whole generation): `first_byte = whole + queue +
      jitter`, `whole` the time of the whole answer (`_whole_answer_s`);
    - `final` (no retry may follow this attempt): the first byte is stretched
      (`_final_first_byte_s`);
    - `connect = policy.connect`, fixed.
    """
    floor = policy.floor
    min_samples = policy.min_samples
    doublings = min(latency.timeouts_in_row, MAX_DOUBLINGS)
    backoff = 2.0**doublings
    headroom = PRIOR_HEADROOM * backoff

    def estimate(index: int) -> tuple[float, float] | None:
        own = latency.estimators[index]
        return _learned(
            own, prior.estimators[index] if prior is not None else None, min_samples, headroom
        )

    ttfb = estimate(_TTFB)
    gap = estimate(_GAP)
    idle = _idle_s(gap, latency, policy, k, jitter_s)
    extra_s = jitter_s
    prefill_s = pause_s = 0.0
    if load is not NO_LOAD:
        prefill_s, pause_s = _prefill_s(latency, prior, policy, load.prompt_tokens, headroom, idle)
        extra_s += _queue_s(estimate(_SERVICE), k, load)
    if stream:
        ttfb_pred, ttfb_dev = ttfb if ttfb is not None else (policy.initial, 0.0)
        first_byte = max(ttfb_pred, prefill_s) + k * ttfb_dev + extra_s
        static_s = policy.initial
    else:
        n = policy.assumed_max_tokens if max_tokens is None else max(0, max_tokens)
        whole_s = _whole_answer_s(ttfb, estimate(_PER_TOKEN), n, policy, k, prefill_s)
        first_byte = whole_s + extra_s
        static_s = policy.initial + n * policy.initial_per_token * (1.0 + policy.token_headroom)
    if final:
        own = ttfb is not None and latency.ttfb.samples >= min_samples
        first_byte = _final_first_byte_s(first_byte, backoff if own else 1.0, floor, static_s)
    limit = policy.first_token_max if stream else None
    return AttemptTimeouts(
        _clamped(first_byte, policy, limit),
        idle if stream else None,
        policy.connect,
        pause_s,
        doublings,
        stream and gap is None,
        limit,
    )


def _clamped(first_byte: float, policy: TimeoutsConfig, limit: float | None) -> float:
    """A first-byte time clamped to `[policy.floor, policy.ceiling]`, then to `limit` (a
    stream's `first_token_max`) when there is one: below the floor too, for the limit is the
    operator's word on how long a first token may take, where the floor only keeps a learned
    prediction from cutting healthy answers."""
    first_byte = min(max(first_byte, policy.floor), policy.ceiling)
    return first_byte if limit is None or first_byte <= limit else limit


def _idle_s(
    gap: tuple[float, float] | None,
    latency: LatencyState,
    policy: TimeoutsConfig,
    k: float,
    jitter_s: float,
) -> float:
    """A stream's idle timeout: `gap_pred + k·gap_dev + jitter` (`gap` is the largest gap of a
    stream), doubled for each of the instance's `idle_timeouts_in_row` (never past
    `policy.initial`): an instance whose streams all turned slower would otherwise have every
    stream cut, and never finish one to learn from. Clamped as every timeout is."""
    gap_pred, gap_dev = gap if gap is not None else (policy.initial, 0.0)
    idle = gap_pred + k * gap_dev + jitter_s
    if latency.idle_timeouts_in_row:
        backed_off = idle * 2.0 ** min(latency.idle_timeouts_in_row, MAX_DOUBLINGS)
        idle = max(idle, min(backed_off, policy.initial))
    return min(max(idle, policy.floor), policy.ceiling)


def _prefill_s(
    latency: LatencyState,
    prior: LatencyState | None,
    policy: TimeoutsConfig,
    prompt_tokens: int,
    headroom: float,
    idle_s: float,
) -> tuple[float, float]:
    """`(prefill, pause)`: the prompt's own prefill, and the pause it will impose on the
    streams the instance is already decoding beyond their idle timeout `idle_s`; 0 for each
    while the instance's prefill rate is unknown.

    - `prefill = p·rate·(1 + h)` with `p = prompt_tokens`, `h = policy.token_headroom` and
      `rate` the slope of the instance's first byte on its prompt size (`PrefillFit`) or,
      where it cannot be told, `prefill_pred` (a long prompt waits for its prefill before any
      byte);
    - `pause = prefill` when the prompt is at least `LARGE_PROMPT` times the instance's usual
      size and `prefill` exceeds the stream idle timeout (`gap_pred + k·gap_dev + jitter`,
      clamped), else 0.
    """
    rate = latency.fit.slope()
    if rate is None:
        ratio = _learned(
            latency.estimators[_PREFILL],
            prior.prefill if prior is not None else None,
            min(policy.min_samples, PREFILL_MIN_SAMPLES),
            headroom,
        )
        rate = ratio[0] if ratio is not None else None
    if rate is None or prompt_tokens <= 0:
        return 0.0, 0.0
    prefill_s = prompt_tokens * rate * (1.0 + policy.token_headroom)
    # Only a prompt well beyond the usual ones pauses the streams more than they are
    # used to: usual prefills are in the gaps the idle timeout learned.
    large = prompt_tokens >= LARGE_PROMPT * latency.fit.mean_tokens
    return prefill_s, prefill_s if large and prefill_s > idle_s else 0.0


def _whole_answer_s(
    ttfb: tuple[float, float] | None,
    per_token: tuple[float, float] | None,
    n: int,
    policy: TimeoutsConfig,
    k: float,
    prefill_s: float,
) -> float:
    """How long a whole non-streamed answer of up to `n` tokens may take, before the queue and
    the jitter: `max(ttfb_pred, prefill) + m·tok_pred·(1 + h) + k·sqrt(ttfb_dev² +
    (m·tok_dev)²)`, with `m = n`: `max(0, max_tokens)` (0 for an embedding), or
    `policy.assumed_max_tokens` when the request sets none: decoding slows as a batch fills,
    far beyond what the deviation of past requests shows, and a healthy long generation must
    never time out. (The deviations add as independent errors would.) When only non-streamed
    responses taught the instance (`ttfb` unlearned, `per_token` learned),
    `ttfb_pred = ttfb_dev = 0`: their per-token rate already includes the prefill."""
    ttfb_pred, ttfb_dev = ttfb if ttfb is not None else (policy.initial, 0.0)
    tok_pred, tok_dev = per_token if per_token is not None else (policy.initial_per_token, 0.0)
    if ttfb is None and per_token is not None:
        # Learned from non-streamed responses only: their per-token rate already carries the
        # prefill (see LatencyState.observe_whole), so no separate first-byte guess is added.
        ttfb_pred, ttfb_dev = 0.0, 0.0
    tokens_s = n * tok_pred * (1.0 + policy.token_headroom)
    return max(ttfb_pred, prefill_s) + tokens_s + k * math.hypot(ttfb_dev, n * tok_dev)


def _final_first_byte_s(first_byte: float, backoff: float, floor: float, static_s: float) -> float:
    """The first-byte time of a last attempt: no retry may follow it, so giving up early gains
    nothing and a busy instance's late answer is worth waiting for. With `backoff = 2^n`, `n`
    the first-byte timeouts in a row on an instance timed from its own figures (1 for one timed
    from the prior, whose headroom counts them already), `s = FINAL_ATTEMPT_HEADROOM · backoff`
    and it becomes `max(first_byte, min(s · max(first_byte, policy.floor), static))`, where
    `static` is what it would be with nothing learned (`policy.initial`, plus the tokens at
    `initial_per_token` for a whole answer): an instance that turned slower than it was learns
    its new pace from the requests that have nowhere else to go, never waited on past what an
    unlearned instance gets. Earlier attempts keep their learned time: a retry elsewhere beats
    waiting on an instance that turned slow."""
    stretch = FINAL_ATTEMPT_HEADROOM * backoff
    if stretch > 1.0:
        # Stretched from what it would wait anyway (the floor included): four times a
        # learned 10 ms is still far below the floor, and would stretch nothing.
        first_byte = max(first_byte, min(stretch * max(first_byte, floor), static_s))
    return first_byte


def _queue_s(service: tuple[float, float] | None, k: float, load: Load) -> float:
    """The wait behind the attempts the gateway already put on a full instance: with
    `c = max(1, load.capacity)` and `n = load.in_flight + 1` (this attempt included),
    `waves = ceil((n - c) / c)` when `n > c`, else 0; `queue = waves · (service_pred +
    k·service_dev)`: each wave waits for a whole exchange to end and free a slot; 0 when the
    instance has been quiet (`load.quiet_s`) for longer than one such exchange: a queue that
    does not move is no reason to wait."""
    capacity = max(1, load.capacity)
    waiting = load.in_flight + 1 - capacity
    if waiting <= 0 or service is None:
        return 0.0
    turn_s = service[0] + k * service[1]
    # A queue is worth waiting on only while it moves: an instance that sent nothing for
    # longer than an exchange takes is not serving it (frozen, hung).
    if load.quiet_s > turn_s:
        return 0.0
    waves = -(-waiting // capacity)
    return waves * turn_s


def hedge_delay(
    latency: LatencyState,
    policy: TimeoutsConfig,
    k: float,
    *,
    stream: bool,
    max_tokens: int | None,
    prior: LatencyState | None = None,
    load: Load = NO_LOAD,
) -> float | None:
    """How long an attempt on the instance whose estimators are `latency` may go without its
    first byte before a hedged attempt is sent elsewhere: its predicted first byte plus `k`
    deviations (the EWMA's mean absolute deviation: `k = 2` puts it near the 95th
    percentile), learned as for `attempt_timeouts` (its own figures, else its pool's prior).
    No floor: the point is to act well before the timeout. None while nothing is learned:
    a guess would hedge every request or none. Plus the wait behind the gateway's own queue
    on the instance (`load`, as in `attempt_timeouts`): a queued attempt is late by design.

    - stream: `ttfb_pred + k·ttfb_dev`;
    - non-streamed: `ttfb_pred + m·tok_pred + k·sqrt(ttfb_dev² + (m·tok_dev)²)` with
      `m = max_tokens` (or `policy.assumed_max_tokens`), as `attempt_timeouts` times a whole
      answer, without its headroom."""
    min_samples = policy.min_samples
    headroom = PRIOR_HEADROOM

    def estimate(index: int) -> tuple[float, float] | None:
        own = latency.estimators[index]
        return _learned(
            own, prior.estimators[index] if prior is not None else None, min_samples, headroom
        )

    ttfb = estimate(_TTFB)
    # Behind the gateway's own queue on the instance, a late first byte is the expected one.
    queue_s = _queue_s(estimate(_SERVICE), k, load)
    if stream:
        if ttfb is None:
            return None
        return ttfb[0] + k * ttfb[1] + queue_s
    per_token = estimate(_PER_TOKEN)
    if per_token is None:
        return None
    ttfb_pred, ttfb_dev = ttfb if ttfb is not None else (0.0, 0.0)
    n = policy.assumed_max_tokens if max_tokens is None else max(0, max_tokens)
    return ttfb_pred + n * per_token[0] + k * math.hypot(ttfb_dev, n * per_token[1]) + queue_s


def large_prompt(latency: LatencyState, prompt_tokens: int) -> bool:
    """Whether a prompt is a long one for this instance (`LARGE_PROMPT` times its usual size):
    its prefill pauses what the instance is decoding, and it is not hedged (a second prefill
    elsewhere doubles that pause, and a cancelled one goes on in the engine for a while)."""
    usual = latency.fit.mean_tokens
    return usual > 0 and prompt_tokens >= LARGE_PROMPT * usual
