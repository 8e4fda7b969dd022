from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from gateway.core.backoff import backoff_s, rate_limit_pause_s, retry_after_s


@pytest.mark.parametrize(
    ("attempt", "base_s", "cap_s", "bound_s"),
    [
        (1, 0.025, 1.0, 0.025),
        (2, 0.025, 1.0, 0.05),
        (3, 0.025, 1.0, 0.1),
        (6, 0.025, 1.0, 0.8),
        (7, 0.025, 1.0, 1.0),  # 1.6 s capped
        (1, 0.1, 0.05, 0.05),  # a cap below the base
        (10_000, 0.1, 2.0, 2.0),  # no float overflow on absurd retry numbers
    ],
)
def test_backoff_bounds(attempt: int, base_s: float, cap_s: float, bound_s: float) -> None:
    rng = random.Random(7)
    draws = [backoff_s(attempt, base_s, cap_s, rng) for _ in range(5000)]
    assert all(0.0 <= d <= bound_s for d in draws)
    # Full jitter: the draws fill the whole range, not just its top.
    assert min(draws) < 0.01 * bound_s and max(draws) > 0.99 * bound_s
    assert sum(draws) / len(draws) == pytest.approx(bound_s / 2, rel=0.05)


def test_a_fixed_share_of_the_backoff_is_always_waited() -> None:
    rng = random.Random(7)
    draws = [backoff_s(2, 0.25, 1.0, rng, fixed=0.5) for _ in range(5000)]
    assert all(0.25 <= d <= 0.5 for d in draws)
    assert min(draws) < 0.26 and max(draws) > 0.49


def test_backoff_is_deterministic_given_the_rng() -> None:
    first = [backoff_s(n, 0.05, 5.0, random.Random(42)) for n in range(1, 6)]
    second = [backoff_s(n, 0.05, 5.0, random.Random(42)) for n in range(1, 6)]
    assert first == second


def test_backoff_numbers_retries_from_one() -> None:
    with pytest.raises(ValueError):
        backoff_s(0, 0.05, 5.0, random.Random(0))


NOW = datetime(2015, 10, 21, 7, 27, 30, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("retry_after", "retry_after_ms", "cap_s", "expected"),
    [
        (None, None, 60.0, None),
        ("5", None, 60.0, 5.0),
        (" 5 ", None, 60.0, 5.0),
        ("0", None, 60.0, 0.0),
        ("1.5", None, 60.0, 1.5),  # not RFC delta-seconds, but clients accept it
        ("120", None, 60.0, 60.0),  # capped
        ("Wed, 21 Oct 2015 07:28:00 GMT", None, 60.0, 30.0),  # IMF-fixdate, 30 s after NOW
        ("Wednesday, 21-Oct-15 07:28:00 GMT", None, 60.0, 30.0),  # RFC 850
        ("Wed Oct 21 07:28:00 2015", None, 60.0, 30.0),  # asctime, no zone: GMT
        ("Wed, 21 Oct 2015 07:37:30 GMT", None, 60.0, 60.0),  # 10 min away: capped
        ("Wed, 21 Oct 2015 07:27:00 GMT", None, 60.0, None),  # in the past
        ("-1", None, 60.0, None),
        ("soon", None, 60.0, None),
        ("", None, 60.0, None),
        ("nan", None, 60.0, None),
        ("inf", None, 60.0, None),
        ("5", "250", 60.0, 0.25),  # retry-after-ms wins
        (None, "1500.5", 60.0, 1.5005),
        (None, "90000", 60.0, 60.0),
        ("5", "soon", 60.0, 5.0),  # an unusable ms header falls back to Retry-After
        ("5", "-3", 60.0, 5.0),
        (None, "garbage", 60.0, None),
    ],
)
def test_retry_after(
    retry_after: str | None, retry_after_ms: str | None, cap_s: float, expected: float | None
) -> None:
    result = retry_after_s(retry_after, retry_after_ms, now_wall=NOW, cap_s=cap_s)
    if expected is None:
        assert result is None
    else:
        assert result == pytest.approx(expected)


@pytest.mark.parametrize(
    ("in_row", "low_s", "high_s"),
    [
        (1, 0.5, 1.0),
        (2, 1.0, 2.0),
        (3, 2.0, 4.0),
        (4, 4.0, 8.0),
        (5, 5.0, 10.0),  # 16 s capped at 10: half of it at least
        (1_000, 5.0, 10.0),
    ],
)
def test_a_rate_limit_pause_doubles_from_its_base_with_jitter(
    in_row: int, low_s: float, high_s: float
) -> None:
    """A 429 without Retry-After: at least the base (0.5 s), doubled per such answer in a
    row, spread over up to twice that, within the cap (10 s)."""
    rng = random.Random(7)
    draws = [rate_limit_pause_s(in_row, 0.5, 10.0, rng) for _ in range(2000)]
    assert all(low_s <= d <= high_s for d in draws)
    assert max(draws) - min(draws) > 0.9 * (high_s - low_s)  # jittered, not one value


def test_a_rate_limit_pause_counts_from_one() -> None:
    with pytest.raises(ValueError):
        rate_limit_pause_s(0, 0.5, 10.0, random.Random(7))
