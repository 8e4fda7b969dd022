"""When to send: absolute send times, in seconds from the run's start, from a seeded generator.

`fixed` sends every 1/rate seconds; `poisson` draws exponential gaps of mean 1/rate (a Poisson
process), the arrival pattern of many independent clients. Both start at 0.0 and never end.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

Arrival = Literal["fixed", "poisson"]
ARRIVALS: tuple[Arrival, ...] = ("fixed", "poisson")


def arrival_times(arrival: Arrival, rate: float, seed: int) -> Iterator[float]:
    """The endless send times; checks its arguments at once (not at the first `next`)."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if arrival == "fixed":
        return _fixed(rate)
    if arrival == "poisson":
        return _poisson(rate, random.Random(f"arrivals-{seed}"))
    raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, not {arrival!r}")


def _fixed(rate: float) -> Iterator[float]:
    i = 0
    while True:
        # i / rate rather than a running sum: no floating-point drift over hours.
        yield i / rate
        i += 1


def _poisson(rate: float, rng: random.Random) -> Iterator[float]:
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)
