"""Run `python -m loadtests.chaos` on a scenario file as a user would, for the short-run tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_chaos(scenario: str | Path, requests: int, out: Path, timeout_s: float) -> Path:
    """Both modes of `scenario` with `requests` each, into `out`; fails with the run's output
    unless it exits 0. Returns `out`."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "loadtests.chaos", str(scenario)),
            *("--requests", str(requests), "--out", str(out)),
            # Tests run side by side: a split would pile both workers' engines onto one CPU.
            *("--cpus", "shared"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out
