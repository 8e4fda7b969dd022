"""`python -m loadtests.chaos SCENARIO [--requests N] [--rate R]`: a chaos run, both ways."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loadtests.chaos.placement import CHOICES
from loadtests.chaos.runner import MODES, run_scenario
from loadtests.chaos.scenario import load_scenario

OUT = Path(__file__).resolve().parent.parent / "out"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", help="a shipped scenario name or a YAML file")
    parser.add_argument("--requests", type=int, help="requests per mode (default: the scenario's)")
    parser.add_argument("--rate", type=float, help="requests per second (default: the scenario's)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated: direct, gateway (both)"
    )
    parser.add_argument(
        "--cpus",
        choices=CHOICES,
        default="auto",
        help="split: the gateway gets a CPU of its own, the engines and the load generator the "
        "rest (both modes); shared: every process on every CPU; auto (default): split for fake "
        "engines on four CPUs or more, shared otherwise",
    )
    parser.add_argument("--out", type=Path, help="run directory (default: loadtests/out/...)")
    args = parser.parse_args(argv)
    scenario = load_scenario(args.scenario).with_load(args.requests, args.rate)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    run_dir = args.out or OUT / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    report = run_scenario(scenario, run_dir, modes, args.cpus)
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
