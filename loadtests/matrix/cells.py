"""One cell of the matrix: a resized scenario run both ways by the chaos runner, then summed up.

The run itself is the chaos runner's (`run_scenario`: fresh instances per mode, same seed, same
requests, same faults), so each cell directory is an ordinary chaos run with its own report.md;
the figures come from the report's own loader and summary, so a cell and its report agree.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtests.chaos.runner import MODES, run_scenario
from loadtests.matrix.resize import Resized
from loadtests.report.data import load_run
from loadtests.report.stats import summarize


@dataclass(frozen=True)
class ModeFigures:
    requests: int
    failed: int
    failure_rate_pct: float | None
    p99_s: float | None  # every request with a total, failures included (as in the report)
    ooms: int
    retries: int | None
    # Fault actions that failed (the run's timeline_errors): the cell did not play every fault.
    fault_errors: int


@dataclass(frozen=True)
class Cell:
    scenario: str
    size: int
    requests: int  # per mode
    rate: float
    run_dir: str
    faults: str  # what the resize rule did, empty when nothing had to change
    wall_s: float
    modes: dict[str, ModeFigures]
    error: str | None = None

    @property
    def key(self) -> str:
        return f"{self.scenario}/{self.size}"

    @property
    def gateway_worse(self) -> bool | None:
        """Whether the gateway failed more requests than direct; None without both figures."""
        direct, gateway = self.modes.get("direct"), self.modes.get("gateway")
        if direct is None or gateway is None:
            return None
        if direct.failure_rate_pct is None or gateway.failure_rate_pct is None:
            return None
        return gateway.failure_rate_pct > direct.failure_rate_pct

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gateway_le_direct"] = None if self.gateway_worse is None else not self.gateway_worse
        return data


def figures(run_dir: Path) -> dict[str, ModeFigures]:
    run = load_run(run_dir)
    result: dict[str, ModeFigures] = {}
    for name, mode in run.modes.items():
        summary = summarize(mode)
        result[name] = ModeFigures(
            requests=summary.requests,
            failed=summary.failed,
            failure_rate_pct=summary.failure_rate,
            p99_s=summary.latency["p99"],
            ooms=summary.ooms,
            retries=summary.retries,
            fault_errors=len(mode.meta.get("timeline_errors") or []),
        )
    return result


def run_cell(resized: Resized, run_dir: Path) -> Cell:
    """Runs one cell; a failure of the run is recorded in the cell, never raised, so one broken
    cell does not cost the rest of the matrix."""
    started = time.monotonic()
    error: str | None = None
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        run_scenario(resized.scenario, run_dir, MODES)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        (run_dir / "error.txt").write_text(traceback.format_exc())
    try:
        modes = figures(run_dir)
    except Exception as exc:  # a half-written run directory
        modes = {}
        error = error or f"{type(exc).__name__}: {exc}"
    return Cell(
        scenario=resized.scenario.name,
        size=resized.size,
        requests=resized.scenario.requests,
        rate=resized.scenario.rate,
        run_dir=str(run_dir),
        faults=resized.notes(),
        wall_s=round(time.monotonic() - started, 1),
        modes=modes,
        error=error,
    )
