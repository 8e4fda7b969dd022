"""When to send: absolute send times, in seconds from the run's start, from a seeded generator.

`fixed` sends every 1/rate seconds; `poisson` draws exponential gaps of mean 1/rate (a Poisson
process), the arrival pattern of many independent clients. Both start at 0.0 and never end.

A schedule of `(start_s, rate)` steps makes the rate piecewise constant (step-load tests): the
last step lasts forever. `fixed` restarts its grid at each step's start; `poisson` is the
non-homogeneous Poisson process: a gap that crosses a step boundary is dropped and drawn again
from the boundary at the new rate, which is exact because exponential gaps are memoryless.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from typing import Literal

Arrival = Literal["fixed", "poisson"]
ARRIVALS: tuple[Arrival, ...] = ("fixed", "poisson")

Schedule = tuple[tuple[float, float], ...]  # ((start_s, rate), ...), first start 0


def arrival_times(
    arrival: Arrival,
    rate: float,
    seed: int,
    schedule: Sequence[tuple[float, float]] | None = None,
) -> Iterator[float]:
    """The endless send times; checks its arguments at once (not at the first `next`).

    A `schedule` replaces `rate`. With one step `((0, r),)` the times are exactly those of
    `rate=r` without a schedule.
    """
    if schedule is None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        steps: Schedule = ((0.0, rate),)
    else:
        steps = check_schedule(schedule)
    if arrival == "fixed":
        return _fixed(steps)
    if arrival == "poisson":
        return _poisson(steps, random.Random(f"arrivals-{seed}"))
    raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, not {arrival!r}")


def check_schedule(schedule: Sequence[tuple[float, float]]) -> Schedule:
    """`schedule` as floats, checked: not empty, starts at 0, increasing starts, rates > 0."""
    steps = tuple((float(start), float(rate)) for start, rate in schedule)
    if not steps:
        raise ValueError("a rate schedule needs at least one step")
    if steps[0][0] != 0.0:
        raise ValueError(f"the first rate step must start at 0, not {steps[0][0]:g}")
    for (before, _), (after, _) in itertools.pairwise(steps):
        if not after > before:
            raise ValueError(f"rate step starts must increase, got {before:g} then {after:g}")
    for start, rate in steps:
        if not (rate > 0 and math.isfinite(rate) and math.isfinite(start)):
            raise ValueError(f"a rate step needs a finite start and a rate > 0, got {start}:{rate}")
    return steps


def parse_rate_steps(text: str) -> Schedule:
    """`0:100,20:300` (start seconds:rate per second, ...) -> a checked schedule."""
    steps = []
    for item in text.split(","):
        start, sep, rate = item.partition(":")
        try:
            if not sep:
                raise ValueError
            steps.append((float(start), float(rate)))
        except ValueError:
            raise ValueError(f"expected START:RATE, got {item!r}") from None
    return check_schedule(steps)


def mean_rate(schedule: Sequence[tuple[float, float]], until: float) -> float:
    """The schedule's average rate over [0, until]; the first rate when `until` <= 0."""
    if until <= 0 or len(schedule) == 1:  # exact, with no rounding, for a plain rate
        return float(schedule[0][1])
    area = 0.0
    for k, (start, rate) in enumerate(schedule):
        end = schedule[k + 1][0] if k + 1 < len(schedule) else math.inf
        if start >= until:
            break
        area += rate * (min(end, until) - start)
    return area / until


def _fixed(steps: Schedule) -> Iterator[float]:
    for k, (start, rate) in enumerate(steps):
        end = steps[k + 1][0] if k + 1 < len(steps) else math.inf
        i = 0
        # start + i / rate rather than a running sum: no floating-point drift over hours.
        while (t := start + i / rate) < end:
            yield t
            i += 1


def _poisson(steps: Schedule, rng: random.Random) -> Iterator[float]:
    t = 0.0
    yield t
    for k, (_, rate) in enumerate(steps):
        end = steps[k + 1][0] if k + 1 < len(steps) else math.inf
        while (next_t := t + rng.expovariate(rate)) < end:
            t = next_t
            yield t
        t = end  # the gap crossed the boundary: redraw from it at the next step's rate
