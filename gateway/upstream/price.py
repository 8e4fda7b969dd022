"""What the balancer prices an instance at: its answers' peak EWMA, a penalty, a slow start.

Owned by one `InstanceState` (its `price`): only this module assigns its fields.
"""

from __future__ import annotations

from gateway.core.balancer import (
    PENALTY_TAU_S,
    PeakEwma,
    priced_answer_s,
    priced_first_byte_s,
    slow_start_weight,
)
from gateway.core.latency import LatencyState


class Price:
    """An instance's latency as the balancer sees it, and its slow start."""

    __slots__ = ("peak", "penalty", "ramp_from", "ramp_s")

    def __init__(self, now: float) -> None:
        # Peak-EWMA of its answers' times, each priced as a short answer's: a stream's at its
        # first byte and at its end, an answer's at its end (`first_byte`, `answer`). The
        # balancer's latency, quick to see a slowdown.
        self.peak = PeakEwma.guessing(now)
        # The price of failures the isolation cap kept in rotation (`penalize`), apart from
        # `peak` so that it never prices another instance's failure (None: none now).
        self.penalty: PeakEwma | None = None
        # Its slow start after it came back into traffic (`start_afresh`): from when, and over
        # how long (0: none under way).
        self.ramp_from = float("-inf")
        self.ramp_s = 0.0

    def start_afresh(
        self, now: float, latency_s: float | None, ramp_s: float = 0.0, vouched: bool = False
    ) -> None:
        """Back in traffic: the estimate starts again at a guess, `latency_s` (None: kept;
        `PoolState.rejoined` says why and how much), which its first answer replaces
        (`vouched`: an operator's word, held as an answer of its own); any penalty is lifted,
        and its slow start runs over `ramp_s` from now (0: none, and one under way ends)."""
        if latency_s is not None:
            self.peak = PeakEwma(now, latency_s) if vouched else PeakEwma.guessing(now, latency_s)
        self.penalty = None
        self.ramp_from = now
        self.ramp_s = ramp_s

    def first_byte(
        self,
        now: float,
        waited_s: float,
        latency: LatencyState,
        pool_per_token_s: float,
        bound: bool = False,
    ) -> None:
        """A stream's first byte came after `waited_s` (`bound`: an attempt given up on had
        waited that long without one): what is learned of it now (`priced_first_byte_s`), at
        the instance's own pace per token (its `latency`), or `pool_per_token_s` (its pool's)
        while it has none: priced on its wait alone, an instance's first stream would make it
        look many times cheaper than its peers, priced on their pace too, and it would be
        drawn every time until that stream ended."""
        per_token = latency.per_token
        pace = per_token.mean if per_token.samples else pool_per_token_s
        price = priced_first_byte_s(waited_s, pace)
        if bound:
            self.peak.at_least(now, price)
        else:
            self.peak.observe(now, price)

    def answer(
        self,
        now: float,
        total_s: float,
        tokens: int | None,
        latency: LatencyState,
        first_byte_s: float | None = None,
    ) -> None:
        """An answer of `tokens` output tokens took `total_s`, `first_byte_s` of it to its
        first byte (None for a whole answer: its first byte was its end, so the instance's
        usual time to a first byte, in its `latency`, stands for that part): what is learned
        of it (`priced_answer_s`)."""
        if first_byte_s is None:
            first_byte_s = latency.ttfb.mean  # 0 until a stream taught it
        self.peak.observe(now, priced_answer_s(total_s, first_byte_s, tokens))

    def ramp(self, now: float) -> float:
        """Its slow start's weight now, in (0, 1]: 1 once over (`slow_start_weight`)."""
        if now - self.ramp_from >= self.ramp_s:
            return 1.0
        return slow_start_weight(now, self.ramp_from, self.ramp_s)

    def penalize(self, now: float, latency_s: float) -> None:
        """A failure its breaker could not act on (the isolation cap held): priced at
        `latency_s` (`failure_penalty_s`) until that fades, with a time constant of
        `PENALTY_TAU_S`: each further such failure renews it, and one that stops failing is
        soon priced by its own answers again. Kept apart from `peak`, which prices the other
        instances' penalties: priced on a penalty, one penalty would beget a larger one at
        each failure elsewhere, until every estimate is hours and latency no longer counts."""
        if self.penalty is None:
            self.penalty = PeakEwma(now, initial_s=latency_s, tau_s=PENALTY_TAU_S)
        else:
            self.penalty.observe(now, latency_s)

    def cost_latency(self, now: float) -> float:
        """The latency it is priced at: its peak EWMA, or its penalty while that is higher
        (then dropped once it is not)."""
        latency = self.peak.get(now)
        penalty = self.penalty
        if penalty is not None:
            priced = penalty.get(now)
            if priced > latency:
                return priced
            self.penalty = None
        return latency
