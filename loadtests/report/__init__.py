"""The chaos report: `python -m loadtests.report RUN_DIR` writes RUN_DIR/report.md and charts.

A scenario is run in two modes, `direct` (clients straight to the instances) and `gateway`;
each leaves `<mode>/ledger.jsonl`, `events.jsonl` and `meta.json` (see `loadtests.ledger`).
The report puts the modes side by side: a summary, per model and per instance tables, the fault
timeline, a cross-check of the gateway's own counters, and charts over time. Either mode may be
missing; the ledger is streamed into flat columns, never held as Records.
"""

from __future__ import annotations

from pathlib import Path

from loadtests.report.charts import render_charts
from loadtests.report.data import load_run
from loadtests.report.markdown import render

__all__ = ["build_report"]


def build_report(run_dir: Path) -> Path:
    """Writes `run_dir/report.md` and `run_dir/charts/*.png`; returns the report's path."""
    run = load_run(run_dir)
    charts = render_charts(run, run_dir / "charts")
    path = run_dir / "report.md"
    path.write_text(render(run, charts), encoding="utf-8")
    return path
