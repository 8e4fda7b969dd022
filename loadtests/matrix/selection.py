"""Which scenarios a matrix runs, and at what load.

By default: every shipped scenario on fake backends, each at the matrix's load (fewer requests
than a full run). Scenarios on real engines (`backend: {engine: ...}`) are left out unless named:
they need a built engine, and they run at the engine's real speed, so the matrix's load would
swamp them; a named one keeps its own rate and request count unless `--requests`/`--rate` say
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtests.chaos.scenario import SCENARIO_DIR, Scenario, load_scenario

# ~300 requests per cell and mode at 60/s is 5 s of traffic: a fault window of 10 % of the run
# spans 30 requests and half a second, about a long generation's time.
REQUESTS = 300
RATE = 60.0


@dataclass(frozen=True)
class Selection:
    scenarios: list[Scenario]
    skipped: list[str]  # shipped scenarios left out of a default run, with why


def select(names: list[str] | None, requests: int | None, rate: float | None) -> Selection:
    skipped: list[str] = []
    if names:
        chosen = [load_scenario(name) for name in names]
    else:
        chosen = []
        for path in sorted(SCENARIO_DIR.glob("*.yaml")):
            scenario = load_scenario(str(path))
            if scenario.engine is None:
                chosen.append(scenario)
            else:
                skipped.append(f"{scenario.name} (real engines: name it to run it)")
    loaded = [
        s.with_load(requests, rate)
        if s.engine is not None
        else s.with_load(requests or REQUESTS, rate or RATE)
        for s in chosen
    ]
    return Selection(loaded, skipped)
