"""Choosing the instance for an attempt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def round_robin(candidates: Sequence[T], start: int, exclude: Sequence[T] = ()) -> tuple[T, int]:
    """The first candidate at or after `start` (cyclically) that is not excluded.

    Returns the choice and the index to start from next time. When every candidate is
    excluded, the one at `start` is chosen anyway: a retry may go back to a tried instance
    rather than fail. `candidates` must not be empty.
    """
    count = len(candidates)
    for offset in range(count):
        index = (start + offset) % count
        if candidates[index] not in exclude:
            return candidates[index], index + 1
    index = start % count
    return candidates[index], index + 1
