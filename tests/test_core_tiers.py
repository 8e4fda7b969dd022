from __future__ import annotations

import pytest

from gateway.config.models import DEFAULT_TIERS, TierPolicy
from gateway.core.tiers import Tier, TierTable, choose_tier

TABLE = TierTable(DEFAULT_TIERS)  # <0.5%: 2 retries, 25 ms, k 1.2-1.8; <5%: 3, 50 ms, 1.8-3.0; rest


@pytest.mark.parametrize(
    ("rate", "expected"),
    [
        (0.0, Tier(0, 2, 0.025, 1.2)),  # the low end of the first tier
        (0.0025, Tier(0, 2, 0.025, 1.5)),  # the middle
        (0.004999999, Tier(0, 2, 0.025, 1.8)),  # just below the bound: still tier 0, k ~ high
        (0.005, Tier(1, 3, 0.05, 1.8)),  # exactly the bound: the next tier, at its low end
        (0.0275, Tier(1, 3, 0.05, 2.4)),  # middle of [0.005, 0.05)
        (0.05, Tier(2, 1, 0.1, 3.0)),
        (0.525, Tier(2, 1, 0.1, 3.5)),  # middle of [0.05, 1.0]
        (1.0, Tier(2, 1, 0.1, 4.0)),  # the last tier includes 1.0
    ],
)
def test_default_tiers(rate: float, expected: Tier) -> None:
    tier = choose_tier(rate, TABLE)
    assert (tier.index, tier.max_retries, tier.backoff_s) == (
        expected.index,
        expected.max_retries,
        expected.backoff_s,
    )
    assert tier.k == pytest.approx(expected.k, abs=1e-6)


def test_k_never_leaves_the_tier_range() -> None:
    # A last bound below 1.0 (only possible without the policy checks): k stays at its high end.
    table = TierTable(
        [
            TierPolicy(below=0.1, max_retries=2, backoff=0.01, k=(1.0, 2.0)),
            TierPolicy(below=0.5, max_retries=1, backoff=0.02, k=(2.0, 3.0)),
        ]
    )
    assert choose_tier(0.9, table) == Tier(1, 1, 0.02, 3.0)
    assert choose_tier(-0.5, table) == Tier(0, 2, 0.01, 1.0)


def test_a_single_tier_covers_everything() -> None:
    table = TierTable([TierPolicy(below=1.0, max_retries=1, backoff=0.1, k=(2.0, 2.0))])
    assert [choose_tier(rate, table) for rate in (0.0, 0.5, 1.0)] == [Tier(0, 1, 0.1, 2.0)] * 3


@pytest.mark.parametrize(
    "tiers",
    [
        [],
        [
            TierPolicy(below=0.5, max_retries=1, backoff=0.1, k=(1.0, 2.0)),
            TierPolicy(below=0.5, max_retries=1, backoff=0.1, k=(2.0, 3.0)),
        ],
    ],
)
def test_bad_tables_are_refused(tiers: list[TierPolicy]) -> None:
    with pytest.raises(ValueError):
        TierTable(tiers)
