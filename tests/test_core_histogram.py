from __future__ import annotations

import math

import pytest

from gateway.core.histogram import Histogram


def test_values_land_in_the_first_bucket_whose_bound_they_do_not_exceed() -> None:
    h = Histogram((0.1, 1.0, 10.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0, 11.0, 600.0):
        h.observe(value)
    assert h.cumulative() == [(0.1, 2), (1.0, 4), (10.0, 5), (math.inf, 7)]
    assert h.sum == pytest.approx(615.65)


def test_bounds_must_increase() -> None:
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))
