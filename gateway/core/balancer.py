"""Load balancing: power of two choices over a peak-EWMA cost, with Envoy-style slow start.

Pure: `now` (monotonic seconds) and a `random.Random` are arguments.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

# tower's default: with no sample yet, assume 1 s, so a new instance is not flooded before it
# has a baseline (and the guess decays, so it is tried soon if the others are slower).
DEFAULT_RTT_S = 1.0
# How fast the estimate forgets: e^(-Δt/τ); 10 s as in tower's and Linkerd's defaults.
DEFAULT_TAU_S = 10.0
# Envoy's slow start begins new hosts at 10 % of their weight (min_weight_percent).
SLOW_START_FLOOR = 0.1


class PeakEwma:
    """Peak-EWMA latency, exactly as tower's `peak_ewma` (after Finagle): fast up, slow down.

    State: `value` and the time `stamp` of the last update. With `w = exp(-max(0, now -
    stamp) / tau_s)`, an update with a sample s at `now` sets

    - `value = s` when `s > value` (the peak: one slow answer counts at once, fully);
    - otherwise `value = value·w + s·(1 - w)` (decay toward the sample),

    then `stamp = now` (unless `now` is earlier: a clock that went back decays nothing).
    `get(now)` is an update with s = 0: between samples the estimate decays toward 0 by
    `e^(-Δt/τ)`, however often it is read, so an idle or long-unused instance is tried again.
    As in tower, a sample below the estimate weighs `1 - w` with Δt counted from the last
    update, read or sample: on an instance read often, low samples move it little and the
    estimate follows the recent peaks, each fading with time constant τ.

    Starts at `initial_s` (default 1 s) stamped at `now`: a first sample like any other. One
    made by `guessing` starts at a guess instead, which its first sample replaces whatever its
    size (`learned` then turns True).
    """

    __slots__ = ("_guess", "_stamp", "_tau_s", "_value")

    def __init__(
        self, now: float, initial_s: float = DEFAULT_RTT_S, tau_s: float = DEFAULT_TAU_S
    ) -> None:
        if tau_s <= 0.0:
            raise ValueError(f"tau_s must be positive, got {tau_s}")
        if initial_s < 0.0:
            raise ValueError(f"initial_s must not be negative, got {initial_s}")
        self._value = initial_s
        self._stamp = now
        self._tau_s = tau_s
        self._guess = False

    @classmethod
    def guessing(
        cls, now: float, guess_s: float = DEFAULT_RTT_S, tau_s: float = DEFAULT_TAU_S
    ) -> PeakEwma:
        """An estimate that starts at `guess_s`, a guess its first sample replaces.

        A guess is no measurement: held as one, it fades only with `tau_s`, and every answer
        faster than it weighs almost nothing meanwhile (see above). Before its first answer an
        instance is costed by its peers (`pipeline.pick`), so for the 10 to 20 s a 1 s guess
        took to fade, an instance five times slower than its peers was priced as they were:
        the first seconds after a gateway starts, or after an instance comes back, spread
        traffic evenly over a slow instance and fast ones."""
        ewma = cls(now, guess_s, tau_s)
        ewma._guess = True
        return ewma

    @property
    def learned(self) -> bool:
        """Whether it holds a sample (one made by `guessing`: not until its first)."""
        return not self._guess

    def observe(self, now: float, sample_s: float) -> float:
        """Fold one latency sample (seconds) in at `now` (rule in the class docstring)."""
        if self._guess:
            self._guess = False
            self._value = sample_s
            if now > self._stamp:
                self._stamp = now
            return sample_s
        return self._fold(now, sample_s)

    def at_least(self, now: float, bound_s: float) -> float:
        """What took at least `bound_s` without answering (an attempt given up on): the
        estimate is raised to `bound_s` if below it (a guess stays a guess), and left as it is
        otherwise. A lower bound is no measurement: taken as one, an instance whose first
        attempt lost a hedge race after 5 ms would be priced at 5 ms and drawn every time; and
        folded in as a sample, the same loss on an instance not read for a while pulled its
        estimate most of the way down to 5 ms."""
        value = self.get(now)  # compared with what it is now, not when last updated
        if bound_s <= value:
            return value
        self._value = bound_s  # a peak, as a sample above would be; a guess stays one
        return bound_s

    def _fold(self, now: float, sample_s: float) -> float:
        value = self._value
        elapsed = now - self._stamp
        if sample_s > value:
            value = sample_s
        elif elapsed > 0.0:
            decay = math.exp(-elapsed / self._tau_s)
            value = value * decay + sample_s * (1.0 - decay)
        self._value = value
        if elapsed > 0.0:
            self._stamp = now
        return value

    def get(self, now: float) -> float:
        """The estimate at `now`, decayed toward 0 since the last update (and stored so)."""
        elapsed = now - self._stamp
        if elapsed > 0.0:
            self._value *= math.exp(-elapsed / self._tau_s)
            self._stamp = now
        return self._value

    def peek(self, now: float) -> float:
        """What `get(now)` would return, without updating (for /admin/state)."""
        elapsed = now - self._stamp
        if elapsed <= 0.0:
            return self._value
        return self._value * math.exp(-elapsed / self._tau_s)

    def __repr__(self) -> str:
        return f"PeakEwma(value={self._value:.6g}, stamp={self._stamp:.6g}, tau={self._tau_s:g})"


# The answer the balancer prices every instance by: its first byte, then this many tokens.
# An exchange's whole time grows with the tokens it was asked for, which say nothing of the
# instance: priced on whole times, one long answer made its instance look many times dearer
# than the rest for tens of seconds (a peak fades with `DEFAULT_TAU_S`), however fast it was.
# Few enough tokens that the wait for a first byte (a queue, a slow prefill) still weighs.
REFERENCE_TOKENS = 64


def priced_answer_s(total_s: float, first_byte_s: float, tokens: int | None) -> float:
    """The balancer's latency sample for an answer of `tokens` output tokens that took
    `total_s`, `first_byte_s` of it before its first token: its time as if it had generated
    at most `REFERENCE_TOKENS` (`first + (total - first) * REFERENCE_TOKENS / tokens`). An
    answer of unknown or fewer tokens is priced at its whole time."""
    if tokens is None or tokens <= REFERENCE_TOKENS:
        return total_s
    first = min(max(first_byte_s, 0.0), total_s)
    return first + (total_s - first) * REFERENCE_TOKENS / tokens


def priced_first_byte_s(first_byte_s: float, per_token_s: float) -> float:
    """The balancer's latency sample at a stream's first byte (or for an attempt still
    without one after `first_byte_s`): that wait, then `REFERENCE_TOKENS` at the instance's
    usual `per_token_s`. Taken at once, not only when the stream ends (`priced_answer_s`,
    at the pace it had): an instance that turned slow is priced so within one first byte."""
    return first_byte_s + per_token_s * REFERENCE_TOKENS


def load_cost(latency_s: float, in_flight: int, weight: float = 1.0) -> float:
    """The cost P2C compares: `latency_s * (in_flight + 1) / weight`.

    `latency_s` is `PeakEwma.get(now)`; `+ 1` counts the request being placed, so an idle
    instance still costs its latency; `weight` is the slow-start weight in (0, 1].
    """
    return latency_s * (in_flight + 1) / weight


# How fast a failure penalty fades: each failure under the cap renews it, so only an instance
# that stopped failing sees it go, within seconds rather than the tens a peak EWMA's time
# constant would take from a price many times its peers' latency.
PENALTY_TAU_S = 2.0


# The least share of its attempts a failing instance is priced as answering: one that answers
# none is priced at twenty times its peers' latency, not out for good (the breaker's business).
MIN_ANSWERED_SHARE = 0.05


def failure_penalty_s(
    elapsed_s: float, peers_latency: Sequence[float], failure_rate: float
) -> float:
    """The latency sample the balancer takes for a failure the breaker could not act on (the
    pool's isolation cap held): the average latency of its peers (their peak EWMAs, priced on
    their own answers, never on a penalty of theirs: see `InstanceState.penalize`), or the
    attempt's own time if longer (a timeout), divided by the share of its attempts it answers
    (`1 - failure_rate`, at least `MIN_ANSWERED_SHARE`). That is the time per answer it
    offers: an instance failing half its requests costs twice what its peers do per attempt
    in flight, so power of two choices gives it about half their concurrency, where its fast
    failures would otherwise make it look the cheapest of all and draw ever more traffic.
    With no peer to compare with, the attempt's own time.

    Priced on the peers' latency, not on their load: a price on their load (twice the dearest
    peer's cost) rose as the failing instance's share moved to them, and again at each of its
    failures, until it held almost nothing while its peers queued hundreds (seen under
    chaos-mix: 255 attempts in flight on one instance, 2 on the one the cap kept in). The cap
    keeps an instance in rotation so that the rest do not carry its share; a price that
    follows the rest's load takes the share away all the same."""
    if not peers_latency:
        return elapsed_s
    answered = max(1.0 - failure_rate, MIN_ANSWERED_SHARE)
    return max(elapsed_s, sum(peers_latency) / len(peers_latency)) / answered


# Two costs this close (relative to the dearer) are a tie for `choose`.
TIE_MARGIN = 0.02
_CLEARLY_CHEAPER = 1.0 - TIE_MARGIN  # worked out once, not at every pick


def choose(candidates: Sequence[T], cost: Callable[[T], float], rng: random.Random) -> T | None:
    """Power of two choices: draw two distinct candidates uniformly, keep the cheaper one.

    Ties go to the first drawn (not the first in the sequence: that would send every tie to
    the same instance), and costs within `TIE_MARGIN` of each other are a tie: estimates that
    close say nothing of which instance is faster, and with two candidates the cheaper by a
    hair would otherwise take every request, one after another, until the hair moved (the
    other instance neither learning its timing nor sharing the load). One candidate: it,
    without calling `cost` or the rng. None: None. `cost` is called exactly twice otherwise.
    The caller filters out isolated and tried ones.
    """
    count = len(candidates)
    if count < 2:
        return candidates[0] if count else None
    # int(random() * n) rather than randrange: a tenth of the cost, and for any n below 2^52
    # it is uniform to within 2^-53 and never reaches n.
    first = int(rng.random() * count)
    second = int(rng.random() * (count - 1))
    if second >= first:
        second += 1  # skip `first`: the pair is distinct and every pair equally likely
    a = candidates[first]
    b = candidates[second]
    return b if cost(b) < cost(a) * _CLEARLY_CHEAPER else a


def slow_start_weight(
    now: float, healthy_since: float, window_s: float, floor: float = SLOW_START_FLOOR
) -> float:
    """Envoy's slow start: the weight of an instance that became healthy at `healthy_since`.

    `floor + (1 - floor) * (now - healthy_since) / window_s`, clamped to `[floor, 1]`: `floor`
    (0.1) at the moment it became healthy (and before, should the clock say so), rising
    linearly to 1 at `healthy_since + window_s` and staying there. `window_s ≤ 0`: always 1.
    """
    if window_s <= 0.0:
        return 1.0
    elapsed = now - healthy_since
    if elapsed >= window_s:
        return 1.0
    if elapsed <= 0.0:
        return floor
    return floor + (1.0 - floor) * elapsed / window_s
