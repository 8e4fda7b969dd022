from __future__ import annotations

import pytest

from gateway.core.window import WindowPair


def test_counts_slide_out_after_the_window() -> None:
    window = WindowPair(3)
    window.add_first(window.advance(10.2))
    window.add_second(window.advance(10.9))
    window.add_first(window.advance(12.5))
    assert (window.first_total, window.second_total) == (2, 1)
    window.advance(13.0)  # second 10 left the window [11, 13]
    assert (window.first_total, window.second_total) == (1, 0)
    window.advance(100.0)  # a long gap empties it at once
    assert (window.first_total, window.second_total) == (0, 0)


def test_a_clock_that_goes_back_counts_in_the_newest_bucket() -> None:
    window = WindowPair(5)
    window.advance(50.0)
    slot = window.advance(49.0)
    window.add_first(slot)
    assert slot == 50 % 5 and window.first_total == 1


def test_a_window_needs_a_bucket() -> None:
    with pytest.raises(ValueError):
        WindowPair(0)
