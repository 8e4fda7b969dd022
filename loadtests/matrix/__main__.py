"""`python -m loadtests.matrix [--requests N] [--rate R] [--scenarios a,b] [--sizes 1,2,3]`."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from loadtests.matrix.cells import Cell, run_cell
from loadtests.matrix.render import RunInfo, summary_line, table_lines, write
from loadtests.matrix.resize import resize
from loadtests.matrix.selection import RATE, REQUESTS, select

ROOT = Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "loadtests" / "out"
SIZES = (1, 2, 3)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of sizes: {text!r}") from None
    if not sizes or any(not 1 <= s <= 32 for s in sizes):
        raise argparse.ArgumentTypeError("sizes are instance counts from 1 to 32")
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.matrix", description=__doc__)
    parser.add_argument("--requests", type=int, help=f"per cell and mode (default {REQUESTS})")
    parser.add_argument("--rate", type=float, help=f"requests per second (default {RATE:g})")
    parser.add_argument(
        "--scenarios", type=_csv, help="comma-separated names or YAML files (default: all shipped)"
    )
    parser.add_argument("--sizes", type=_sizes, default=list(SIZES), help="e.g. 1,2,3")
    parser.add_argument("--out", type=Path, help="default: loadtests/out/matrix-<time>/")
    args = parser.parse_args(argv)
    if (args.requests is not None and args.requests < 1) or (
        args.rate is not None and args.rate <= 0
    ):
        parser.error("--requests and --rate must be positive")
    return args


def code_version() -> str | None:
    """The checkout's commit, `+dirty` when files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(ROOT), "status", "--porcelain", "-uno"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if changes else head


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selection = select(args.scenarios, args.requests, args.rate)
    chosen = selection.scenarios
    for skipped in selection.skipped:
        print(f"[matrix] skipped: {skipped}")
    code_at_start = code_version()
    out: Path = args.out or OUT / f"matrix-{time.strftime('%Y%m%d-%H%M%S')}"
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    started = time.monotonic()
    total = len(chosen) * len(args.sizes)
    cells: list[Cell] = []
    for scenario in chosen:
        for size in args.sizes:
            resized = resize(scenario, size)
            print(
                f"[matrix {len(cells) + 1}/{total}] {scenario.name}, {size} instance(s)", flush=True
            )
            cell = run_cell(resized, out / f"{scenario.name}-n{size}")
            if cell.error:
                print(f"[matrix] {cell.key}: run error: {cell.error}", flush=True)
            cells.append(cell)
    info = RunInfo(
        started_at=started_at,
        wall_s=round(time.monotonic() - started, 1),
        sizes=list(args.sizes),
        scenarios=[s.name for s in chosen],
        skipped=selection.skipped,
        code=(code_at_start, code_version()),
    )
    path = write(cells, info, out)
    print()
    print("\n".join(table_lines(cells)))
    print()
    print(f"matrix: {path} ({info.wall_s / 60:.1f} min)")
    print(summary_line(cells))
    return 0  # a report: what the gateway did is in the table, not in the exit code


if __name__ == "__main__":
    sys.exit(main())
