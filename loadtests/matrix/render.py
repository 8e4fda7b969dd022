"""The matrix's outputs: matrix.md (one table), matrix.json and matrix.png (grouped bars)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from loadtests.matrix.cells import Cell, ModeFigures
from loadtests.report.charts import DPI, MODE_COLORS
from loadtests.report.markdown import NA, pct, secs, table

HEADERS = (
    "scenario",
    "instances",
    "direct failed",
    "gateway failed",
    "direct p99",
    "gateway p99",
    "OOMs direct / gateway",
    "gateway ≤ direct",
)
CHART = "matrix.png"


@dataclass(frozen=True)
class RunInfo:
    started_at: str
    wall_s: float
    sizes: list[int]
    scenarios: list[str]
    skipped: list[str]  # shipped scenarios a default run leaves out, with why
    # The checkout measured, at the start and at the end (`abc1234`, `+dirty` with local
    # changes): a gateway changed under a long run is said in the report.
    code: tuple[str | None, str | None]


def verdict(cell: Cell) -> str:
    worse = cell.gateway_worse
    if cell.error is not None and worse is None:
        return "error"
    return NA if worse is None else ("NO" if worse else "yes")


def _mode(cell: Cell, name: str) -> ModeFigures | None:
    return cell.modes.get(name)


def row(cell: Cell) -> list[str]:
    direct, gateway = _mode(cell, "direct"), _mode(cell, "gateway")

    def rate(m: ModeFigures | None) -> str:
        return NA if m is None else pct(m.failure_rate_pct, 2)

    def p99(m: ModeFigures | None) -> str:
        return NA if m is None else secs(m.p99_s)

    def ooms(m: ModeFigures | None) -> str:
        return NA if m is None else str(m.ooms)

    return [
        cell.scenario,
        str(cell.size),
        rate(direct),
        rate(gateway),
        p99(direct),
        p99(gateway),
        f"{ooms(direct)} / {ooms(gateway)}",
        verdict(cell),
    ]


def table_lines(cells: Sequence[Cell]) -> list[str]:
    return table(HEADERS, [row(c) for c in cells], left=1)


def worse_cells(cells: Sequence[Cell]) -> list[Cell]:
    return [c for c in cells if c.gateway_worse]


def summary_line(cells: Sequence[Cell]) -> str:
    worse = worse_cells(cells)
    errors = [c for c in cells if c.error is not None]
    if worse:
        text = (
            f"gateway failed MORE than direct in {len(worse)} of {len(cells)} cells: "
            + ", ".join(c.key for c in worse)
        )
    else:
        text = f"gateway failed no more than direct in every cell ({len(cells)} cells)"
    if errors:
        text += f"; {len(errors)} cell(s) had run errors: " + ", ".join(c.key for c in errors)
    return text


def markdown(cells: Sequence[Cell], info: RunInfo) -> str:
    lines = [
        "# Fault matrix: direct vs gateway, per scenario and pool size",
        "",
        f"- **Started**: {info.started_at}; **wall time**: {info.wall_s / 60:.1f} min",
        f"- **Load per cell and mode**: {_loads(cells)} (same seed, requests and faults both "
        "ways; direct = client-side round robin, no retries; gateway = the chaos runner's "
        "default policy)",
        f"- **Pool sizes**: {', '.join(map(str, info.sizes))} instances in every pool of the "
        "scenario; faults of missing instances moved or dropped by the rule of "
        "`loadtests/matrix/resize.py`",
        "- **Failed**: not HTTP 200 with a proper body or stream end; **p99**: over every "
        "request, failures included",
        f"- **Code**: {_code(info.code)}",
        *([f"- **Skipped**: {', '.join(info.skipped)}"] if info.skipped else []),
        "",
        f"**{summary_line(cells)}**",
        "",
        *table_lines(cells),
        "",
        f"![failure rate per cell]({CHART})",
        "",
        "## Cells",
        "",
    ]
    details = []
    for cell in cells:
        notes = [cell.faults] if cell.faults else []
        failed = {name: m.fault_errors for name, m in cell.modes.items() if m.fault_errors}
        if failed:
            counts = ", ".join(f"{n} in {name}" for name, n in failed.items())
            notes.append(f"fault actions failed: {counts} (see the report)")
        if cell.error:
            notes.append(f"run error: {cell.error}")
        report = Path(cell.run_dir) / "report.md"
        details.append(
            [
                cell.key,
                f"{cell.wall_s:.0f} s",
                "; ".join(notes) or "faults as in the scenario",
                f"[report]({_relative(report, Path(cell.run_dir).parent)})",
            ]
        )
    lines += table(("cell", "wall time", "faults", "report"), details, left=4)
    return "\n".join(lines) + "\n"


def _loads(cells: Sequence[Cell]) -> str:
    loads = sorted({(c.requests, c.rate) for c in cells})
    return ", ".join(f"{n} requests at {r:g}/s" for n, r in loads) or NA


def _code(code: tuple[str | None, str | None]) -> str:
    start, end = code
    if start == end:
        return f"`{start}`" if start else NA
    return f"`{start}` at the start, `{end}` at the end: the code changed during the run"


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def as_json(cells: Sequence[Cell], info: RunInfo) -> dict[str, Any]:
    return {
        **info.__dict__,
        "summary": summary_line(cells),
        "gateway_worse": [c.key for c in worse_cells(cells)],
        "cells": [c.as_dict() for c in cells],
    }


def chart(cells: Sequence[Cell], path: Path) -> None:
    """Grouped bars: per cell, the failure rate direct and through the gateway; the labels of
    cells where the gateway failed more are red."""
    width_in = max(12.0, 0.45 * len(cells) + 2.0)
    fig = Figure(figsize=(width_in, 6.0), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(cells), dtype=np.float64)
    bar = 0.4
    for offset, mode in ((-bar / 2, "direct"), (bar / 2, "gateway")):
        values = [
            m.failure_rate_pct
            if (m := c.modes.get(mode)) and m.failure_rate_pct is not None
            else np.nan
            for c in cells
        ]
        ax.bar(x + offset, values, bar, label=mode, color=MODE_COLORS[mode])
    ax.set_xticks(x, [f"{c.scenario} ({c.size})" for c in cells], rotation=60, ha="right")
    for label, cell in zip(ax.get_xticklabels(), cells, strict=True):
        if cell.gateway_worse:
            label.set_color("tab:red")
    ax.set_ylabel("failed requests (% of sent)")
    ax.set_title(
        "failure rate per scenario (pool size in brackets); red label: the gateway failed more"
    )
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(bottom=0)
    if cells:
        ax.legend(loc="upper left")
    else:
        ax.text(0.5, 0.5, "no cells", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=DPI)


def write(cells: Sequence[Cell], info: RunInfo, out: Path) -> Path:
    """Writes matrix.md, matrix.json and matrix.png into `out`; returns matrix.md."""
    out.mkdir(parents=True, exist_ok=True)
    chart(cells, out / CHART)
    (out / "matrix.json").write_text(json.dumps(as_json(cells, info), indent=2) + "\n")
    path = out / "matrix.md"
    path.write_text(markdown(cells, info), encoding="utf-8")
    return path
