"""CLI: `python -m loadtests.report RUN_DIR` -> RUN_DIR/report.md and RUN_DIR/charts/*.png."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loadtests.report import build_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.report",
        description="Render a chaos run directory (direct vs gateway) as report.md + charts.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (holds direct/, gateway/)")
    args = parser.parse_args(argv)
    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        print(f"error: {run_dir} is not a directory", file=sys.stderr)
        return 2
    path = build_report(run_dir)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
