"""A scenario with every pool resized to N instances, and its faults fitted to the new pools.

The rule, applied per pool and in the scenario's order:

1. Every pool gets exactly N instances, `pool-0` .. `pool-(N-1)`; everything else of the scenario
   (seed, backend, workload, gateway policy, Redis) is unchanged.
2. Fault steps on instances that still exist stay where they are; so do steps on `redis`. In a
   larger pool the added instances get no faults.
3. The steps of an instance that no longer exists (`pool-i`, i >= N) move together, as one
   story (a stop, then a slow start, then a clear belong together), to the first of
   `pool-(i mod N)`, `pool-(i+1 mod N)`, ... with which none of them clashes.
4. If they clash with every instance of the pool, they are dropped, all of them.

Two steps of different instances' stories clash on one instance when:
- both are `set` steps, active at the same time, sharing a fault knob: each restores the value
  it found when it reverts, so they would undo each other and could leave a knob set for good;
- both are `network` steps, active at the same time, sharing a knob of the proxy (same reason);
- both are process actions (kill, stop, start, restart, freeze, thaw, clear), whenever they
  happen: a process has one life story, and real actions outlast their planned moments (a stop
  first waits for the requests in flight, a start for the new process to serve), so two
  restart stories on one process run into each other (a start on a port still in use);
- one is a process action and the other a `set` active during it or within 5 s (`SETTLE_S`)
  after it: a `set` on a stopped, frozen or starting instance fails, and a restart or a clear drops
  the knobs of a `set` still active.
A `network` step never clashes with a `set` or a process action: the proxy is its own process.

A step is active from its `at` (an `at_request` counts at `at_request / rate`) for its `for:`;
without `for:`, until the next step on the same instance, or the end of the run.

So a pool of one keeps its own instance's faults and takes the others' that fit beside them, at
most one restart story among them, and a shape a scenario is about (one flaky instance; a flaky
one and a dying one) is kept wherever the pool is large enough for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from loadtests.chaos.scenario import REDIS, FaultStep, Scenario

Kind = Literal["knobs", "network", "process"]
# How long after its planned window a process action may still be under way: a stop drains the
# requests in flight (a long generation takes seconds), a start waits for the process to serve.
SETTLE_S = 5.0


@dataclass(frozen=True)
class Window:
    start: float
    end: float  # math.inf: until the end of the run

    def overlaps(self, other: Window) -> bool:
        return self.start < other.end and other.start < self.end

    def settled(self) -> Window:
        return Window(self.start, self.end + SETTLE_S)


@dataclass(frozen=True)
class Resized:
    scenario: Scenario
    size: int
    moved: dict[str, str]  # missing instance -> the instance its faults moved to
    dropped: dict[str, int]  # missing instance -> how many of its steps were dropped

    def notes(self) -> str:
        """One line for tables and reports: what the rule did, or an empty string."""
        parts = [f"{old} → {new}" for old, new in self.moved.items()]
        parts += [
            f"{old} dropped ({n} step{'s' if n != 1 else ''})" for old, n in self.dropped.items()
        ]
        return "; ".join(parts)


def kind(step: FaultStep) -> Kind:
    if step.action == "set":
        return "knobs"
    if step.action == "network":
        return "network"
    return "process"


def touched(step: FaultStep) -> frozenset[str]:
    if step.action == "set":
        return frozenset(step.set)
    if step.action == "network":
        return frozenset(step.network)
    return frozenset()


def clashes(a: FaultStep, wa: Window, b: FaultStep, wb: Window) -> bool:
    """Whether two steps of different stories would fight on one instance (see the rule)."""
    ka, kb = kind(a), kind(b)
    if "network" in (ka, kb):
        return ka == kb and wa.overlaps(wb) and bool(touched(a) & touched(b))
    if ka == kb == "knobs":
        return wa.overlaps(wb) and bool(touched(a) & touched(b))
    if ka == kb == "process":
        return True
    if ka == "process":
        wa = wa.settled()
    else:
        wb = wb.settled()
    return wa.overlaps(wb)


def windows(scenario: Scenario) -> list[Window]:
    """When each fault step is active, in the order of `scenario.faults`."""
    planned = scenario.planned_s(scenario.requests, scenario.rate)
    starts: list[float] = []
    for step in scenario.faults:
        at = step.when().resolve(planned)
        if at is None:  # a request-number trigger: when that request is due
            at = (step.at_request or 0) / scenario.rate
        starts.append(at)
    result: list[Window] = []
    for index, step in enumerate(scenario.faults):
        start = starts[index]
        duration = step.duration()
        length = None if duration is None else duration.resolve(planned)
        if length is not None:
            result.append(Window(start, start + length))
            continue
        later = [
            starts[j]
            for j, other in enumerate(scenario.faults)
            if other.target == step.target and starts[j] > start
        ]
        result.append(Window(start, min(later, default=math.inf)))
    return result


def _split(target: str, scenario: Scenario) -> tuple[str, int] | None:
    """`pool-i` as (pool, i), or None for a target that is no pool's instance (`redis`)."""
    pool, _, index = target.rpartition("-")
    if pool in scenario.pools and index.isdigit():
        return pool, int(index)
    return None


def resize(scenario: Scenario, size: int) -> Resized:
    """The scenario with `size` instances in every pool, its faults fitted by the module's rule."""
    if size < 1:
        raise ValueError("a pool needs at least one instance")
    steps = scenario.faults
    spans = windows(scenario)
    groups: dict[str, list[int]] = {}
    for index, step in enumerate(steps):
        groups.setdefault(step.target, []).append(index)
    placed: dict[str, list[int]] = {}  # instance -> indices of the steps it plays
    target_of: dict[int, str] = {}
    missing: list[tuple[str, str, int]] = []
    for target, indices in groups.items():
        where = _split(target, scenario)
        if target == REDIS or where is None or where[1] < size:
            placed.setdefault(target, []).extend(indices)
            target_of.update(dict.fromkeys(indices, target))
        else:
            missing.append((target, *where))
    moved: dict[str, str] = {}
    dropped: dict[str, int] = {}
    pool_order = list(scenario.pools)
    for target, pool, i in sorted(missing, key=lambda m: (pool_order.index(m[1]), m[2])):
        indices = groups[target]
        for k in range(size):
            candidate = f"{pool}-{(i + k) % size}"
            there = placed.get(candidate, [])
            if not any(
                clashes(steps[a], spans[a], steps[b], spans[b]) for a in indices for b in there
            ):
                placed.setdefault(candidate, []).extend(indices)
                target_of.update(dict.fromkeys(indices, candidate))
                moved[target] = candidate
                break
        else:
            dropped[target] = len(indices)
    faults = [
        steps[i].model_copy(update={"target": target_of[i]})
        for i in range(len(steps))
        if i in target_of
    ]
    return Resized(_rebuilt(scenario, size, faults), size, moved, dropped)


def _rebuilt(scenario: Scenario, size: int, faults: list[FaultStep]) -> Scenario:
    # Validated again, so a rule gone wrong (a target that does not exist) fails here and not
    # in the middle of a run.
    data: dict[str, Any] = scenario.model_dump(mode="json", by_alias=True)
    for pool in data["pools"].values():
        pool["instances"] = size
    data["faults"] = [step.model_dump(mode="json", by_alias=True) for step in faults]
    nice = data["backend"].get("nice")
    if nice:
        # A slower engine the smaller pool does not have is left out, as its faults are.
        names = {f"{pool}-{i}" for pool in data["pools"] for i in range(size)}
        data["backend"]["nice"] = {name: level for name, level in nice.items() if name in names}
    return Scenario.model_validate(data)
