"""The demo's scripted chaos: what happens to which fake vLLM instance, and when.

The script is written for a 46-second run and scaled to any other length (`--seconds`), so a
short run in the tests plays the same story faster. One fault at a time, each on its own
instance; a fourth instance stays healthy throughout.

The script becomes the chaos package's fault steps (`FaultStep`), played by its `Timeline`
against each side's own instances: both sides get the same faults at the same moments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadtests.chaos.scenario import FaultStep

BASE_S = 46.0  # the length the script is written for
POOL = "vllm"
INSTANCES = 4  # max_isolated_fraction 0.5: two of them may be isolated at once
NAMES = tuple(f"{POOL}-{i}" for i in range(INSTANCES))


@dataclass(frozen=True)
class Fault:
    """One fault on one instance over [start, end) seconds of the 46-second script."""

    start: float
    end: float
    target: str
    action: str  # a chaos timeline action: "set" merges fake backend knobs, reverted at the end
    knobs: dict[str, Any]
    short: str  # for the per-instance column: "50x slower"
    story: str  # for the chapter line and the plain output


@dataclass(frozen=True)
class Chapter:
    start: float
    label: str


FAULTS: tuple[Fault, ...] = (
    Fault(
        8.0,
        16.0,
        NAMES[1],
        "set",
        {"slow_factor": 50.0},
        "50x slower",
        f"{NAMES[1]} becomes 50x slower (a sick GPU)",
    ),
    Fault(
        16.0,
        26.0,
        NAMES[2],
        "set",
        {"oom_rate": 0.3},
        "30% CUDA OOM",
        f"{NAMES[2]} fails 30 % of requests with CUDA out of memory",
    ),
    Fault(
        26.0,
        36.0,
        NAMES[0],
        "set",
        {"hang_rate": 1.0},
        "hangs",
        f"{NAMES[0]} hangs: takes every request, never answers (a wedged GPU)",
    ),
)
CHAPTER_STARTS = (0.0, 8.0, 16.0, 26.0, 36.0)
FIRST, LAST = "all instances healthy", "every fault is over: all instances recovered"


class Script:
    """The script scaled to `seconds` of traffic."""

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError("seconds must be > 0")
        self.seconds = seconds
        self.scale = seconds / BASE_S
        self.faults = FAULTS
        labels = (FIRST, *(f.story for f in self.faults), LAST)
        self.chapters = tuple(map(Chapter, CHAPTER_STARTS, labels))

    def at(self, base_s: float) -> float:
        return round(base_s * self.scale, 3)

    def chapter_index(self, t: float) -> int:
        index = 0
        for i, chapter in enumerate(self.chapters):
            if t >= self.at(chapter.start):
                index = i
        return index

    def chapter(self, t: float) -> str:
        return self.chapters[self.chapter_index(t)].label

    def chapter_bounds(self, index: int) -> tuple[float, float]:
        start = self.at(self.chapters[index].start)
        last = index + 1 >= len(self.chapters)
        end = self.seconds if last else self.at(self.chapters[index + 1].start)
        return start, end

    def active(self, t: float) -> dict[str, str]:
        """Instance name -> the fault it is under at time t (absent: healthy)."""
        return {f.target: f.short for f in self.faults if self.at(f.start) <= t < self.at(f.end)}

    def events(self) -> list[tuple[float, str]]:
        """(time, what happens) for the plain output: each fault's start and end."""
        items = [(self.at(f.start), f.story) for f in self.faults]
        items += [(self.at(f.end), f"{f.target} is back to normal") for f in self.faults]
        return sorted(items)

    def steps(self) -> list[FaultStep]:
        """The chaos timeline's steps: each fault applied at its start and reverted at its end."""
        return [
            FaultStep.model_validate(
                {
                    "at": self.at(f.start),
                    "for": round(self.at(f.end) - self.at(f.start), 3),
                    "target": f.target,
                    "action": f.action,
                    **({"set": f.knobs} if f.action == "set" else {}),
                    "note": f.story,
                }
            )
            for f in self.faults
        ]
