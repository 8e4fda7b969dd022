"""Retry tiers: how many retries, how long a backoff and how wide a timeout, by failure rate."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config.models import TierPolicy


@dataclass(frozen=True, slots=True)
class Tier:
    """The retry parameters for the current failure rate; `index` is the tier's position."""

    index: int
    max_retries: int
    backoff_s: float
    k: float


class TierTable:
    """A pool's tiers, prepared once so that `choose` is a bisect and one multiply-add.

    Tier i covers `[below[i-1], below[i])` (`below[-1]` = 0); the last tier also covers every
    rate from its lower bound up to 1.0 inclusive (and beyond, should its `below` be lower).
    """

    __slots__ = ("_belows", "_rows", "most_retries", "sound_below")

    def __init__(self, tiers: Sequence[TierPolicy]) -> None:
        if not tiers:
            raise ValueError("at least one retry tier is needed")
        belows: list[float] = []
        rows: list[tuple[int, float, float, float, float, float]] = []
        low = 0.0
        for tier in tiers:
            if tier.below <= low:
                raise ValueError(f"tier bounds must increase: {tier.below:g} after {low:g}")
            k_low, k_high = tier.k
            width = tier.below - low
            rows.append(
                (tier.max_retries, tier.backoff, low, width, k_low, (k_high - k_low) / width)
            )
            belows.append(tier.below)
            low = tier.below
        # Only the bounds between tiers are searched: at or above the last one, the last tier.
        self._belows = tuple(belows[:-1])
        self._rows = tuple(rows)
        # The most retries any tier allows: what a request may spend on a lone instance.
        self.most_retries = max(tier.max_retries for tier in tiers)
        # The failure rate below which an instance is sound: the upper bound of the first tier
        # that allows the most retries. A retry that would go to a sound instance the request
        # has not tried may go past its tier's count (`PoolState.sound_elsewhere`).
        self.sound_below = next(t.below for t in tiers if t.max_retries == self.most_retries)

    def choose(self, rate: float) -> Tier:
        """The tier for `rate`; see `choose_tier`."""
        index = bisect_right(self._belows, rate)
        max_retries, backoff_s, low, width, k_low, slope = self._rows[index]
        # Clamped: a rate past the last bound (when it is below 1.0) keeps k at its high end.
        k = k_low + slope * min(max(rate - low, 0.0), width)
        return Tier(index, max_retries, backoff_s, k)


def choose_tier(rate: float, tiers: TierTable) -> Tier:
    """The tier for the pool's failure `rate`, with `k` placed within the tier's range.

    The tier is the first whose `below` is greater than `rate` (a rate exactly equal to a bound
    belongs to the next tier); the last tier takes every higher rate. Within tier i,
    `k = k_low + (k_high - k_low)·(rate - below[i-1]) / (below[i] - below[i-1])`, with
    `below[-1] = 0` and the fraction clamped to [0, 1]: k rises linearly across the tier.
    """
    return tiers.choose(rate)
