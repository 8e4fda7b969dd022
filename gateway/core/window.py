"""Two counters over a sliding window of one-second buckets (a fixed ring: no growth)."""

from __future__ import annotations

import math


class WindowPair:
    """Counts `first` and `second` events over the last `size` seconds.

    `advance(now)` moves the window's head to `now`'s second, emptying the buckets it leaves
    behind: O(1) amortised, and a gap of a whole window or more empties the ring at once. A
    `now` before the head (a clock that went back) counts in the newest bucket. Totals are kept
    as running sums, so reading them costs nothing.
    """

    __slots__ = ("_first", "_head", "_second", "_size", "first_total", "second_total")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a window needs at least one bucket, got {size}")
        self._size = size
        self._first = [0] * size
        self._second = [0] * size
        self.first_total = 0
        self.second_total = 0
        self._head = -(1 << 62)  # far in the past: the first advance empties nothing

    def advance(self, now: float) -> int:
        """Slide to `now`; returns the slot of `now`'s bucket."""
        second = math.floor(now)
        head = self._head
        size = self._size
        if second <= head:
            return head % size
        first = self._first
        other = self._second
        if second - head >= size:
            self.clear()
        else:
            for passed in range(head + 1, second + 1):
                slot = passed % size
                self.first_total -= first[slot]
                self.second_total -= other[slot]
                first[slot] = 0
                other[slot] = 0
        self._head = second
        return second % size

    def add_first(self, slot: int) -> None:
        self._first[slot] += 1
        self.first_total += 1

    def add_second(self, slot: int) -> None:
        self._second[slot] += 1
        self.second_total += 1

    def remove_second(self, at: float) -> bool:
        """Take back one `second` event counted at `at`, if its bucket is still in the window
        (an event whose bucket has left it is already forgotten). Returns whether it did."""
        head = self._head
        second = math.floor(at)
        if second > head or second <= head - self._size:
            return False
        slot = second % self._size
        if self._second[slot] == 0:
            return False
        self._second[slot] -= 1
        self.second_total -= 1
        return True

    def clear(self) -> None:
        for slot in range(self._size):
            self._first[slot] = 0
            self._second[slot] = 0
        self.first_total = 0
        self.second_total = 0
