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


@dataclass(frozen=True, slots=True)
class AttemptTimeouts:
    """What one attempt may wait for: the connection, the first byte, each gap between chunks.

    `idle_s` is None for a non-streamed request: its body comes in one piece after the first byte.
    """

    first_byte_s: float
    idle_s: float | None
    connect_s: float


def _learned(estimate: Ewma, min_samples: int, initial: float) -> tuple[float, float]:
    # Too few samples: trust the configured guess and add no spread (k·0) to it.
    if estimate.samples >= min_samples:
        return estimate.mean, estimate.deviation
    return initial, 0.0


def attempt_timeouts(
    latency: LatencyState,
    policy: TimeoutsConfig,
    k: float,
    *,
    stream: bool,
    max_tokens: int | None,
    jitter_s: float,
) -> AttemptTimeouts:
    """The timeouts of the next attempt on the instance whose estimators are `latency`.

    `k` comes from the retry tier; `jitter_s` is one draw of `rng.uniform(0, policy.jitter)`
    (one per attempt, so attempts started together do not all give up at the same instant).

    For an estimator with at least `min_samples` samples, `pred` and `dev` are its mean and
    deviation; with fewer, `pred = policy.initial` (`policy.initial_per_token` for the per-token
    rate) and `dev = 0`. Every result is clamped to `[policy.floor, policy.ceiling]`.

    - stream: `first_byte = ttfb_pred + k·ttfb_dev + jitter`,
      `idle = gap_pred + k·gap_dev + jitter` (`gap` is the largest gap of a stream);
    - non-streamed (the first byte is the whole generation):
      `first_byte = ttfb_pred + n·tok_pred·(1 + h) + k·sqrt(ttfb_dev² + (n·tok_dev)²) + jitter`,
      with `n = max(0, max_tokens)` (0 for an embedding), or `policy.assumed_max_tokens` when
      the request sets none, and `h = policy.token_headroom`: decoding slows as a batch fills,
      far beyond what the deviation of past requests shows, and a healthy long generation must
      never time out. `idle = None`. (The deviations add as independent errors would.) When
      only non-streamed responses taught the instance (`ttfb` unlearned, `per_token` learned),
      `ttfb_pred = ttfb_dev = 0`: their per-token rate already includes the prefill.
    - `connect = policy.connect`, fixed.
    """
    floor = policy.floor
    ceiling = policy.ceiling
    min_samples = policy.min_samples
    ttfb_pred, ttfb_dev = _learned(latency.ttfb, min_samples, policy.initial)
    if stream:
        gap_pred, gap_dev = _learned(latency.gap, min_samples, policy.initial)
        first_byte = ttfb_pred + k * ttfb_dev + jitter_s
        idle = gap_pred + k * gap_dev + jitter_s
        return AttemptTimeouts(
            min(max(first_byte, floor), ceiling), min(max(idle, floor), ceiling), policy.connect
        )
    n = policy.assumed_max_tokens if max_tokens is None else max(0, max_tokens)
    per_token = latency.per_token
    tok_pred, tok_dev = _learned(per_token, min_samples, policy.initial_per_token)
    if latency.ttfb.samples < min_samples and per_token.samples >= min_samples:
        # Learned from non-streamed responses only: their per-token rate already carries the
        # prefill (see LatencyState.observe_whole), so no separate first-byte guess is added.
        ttfb_pred, ttfb_dev = 0.0, 0.0
    tokens_s = n * tok_pred * (1.0 + policy.token_headroom)
    first_byte = ttfb_pred + tokens_s + k * math.hypot(ttfb_dev, n * tok_dev) + jitter_s
    return AttemptTimeouts(min(max(first_byte, floor), ceiling), None, policy.connect)
