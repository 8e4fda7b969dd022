from __future__ import annotations

import pytest

from gateway.core.picker import round_robin


@pytest.mark.parametrize(
    ("start", "exclude", "expected"),
    [
        (0, [], ("a", 1)),
        (1, [], ("b", 2)),
        (3, [], ("a", 1)),  # wraps around
        (0, ["a"], ("b", 2)),
        (2, ["c", "a"], ("b", 2)),
        (1, ["a", "b", "c"], ("b", 2)),  # all tried: go back rather than fail
    ],
)
def test_round_robin(start: int, exclude: list[str], expected: tuple[str, int]) -> None:
    assert round_robin(["a", "b", "c"], start, exclude) == expected


def test_round_robin_spreads_evenly() -> None:
    counts = {"a": 0, "b": 0, "c": 0}
    index = 0
    for _ in range(300):
        choice, index = round_robin(["a", "b", "c"], index)
        counts[choice] += 1
    assert counts == {"a": 100, "b": 100, "c": 100}
