"""The report's charts: matplotlib figures (Agg, no pyplot state) saved as PNG, 1200x500 px.

Every chart renders even without data (an empty mode, all requests failed, no latencies): it
then says so in the plot area, so the report never links a missing file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from loadtests.report.data import NO_INSTANCE, Floats, ModeData, Run
from loadtests.report.stats import (
    Buckets,
    Marker,
    bucket_counts,
    bucket_instance_counts,
    bucket_percentiles,
    make_buckets,
    markers,
)

SIZE = (12.0, 5.0)
DPI = 100
MODE_COLORS = {"direct": "tab:orange", "gateway": "tab:blue"}
ACTION_COLORS = {
    "kill": "tab:red",
    "die": "tab:red",
    "stop": "tab:red",
    "set": "tab:olive",
    "clear": "tab:olive",
    "freeze": "tab:purple",
    "thaw": "tab:purple",
    "start": "tab:green",
    "restart": "tab:green",
    "network": "teal",
    "partition": "teal",
    "heal": "teal",
}
INSTANCE_PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#17becf",
    "#bcbd22",
    "#8c564b",
)


@dataclass
class Chart:
    file: str  # name under charts/
    title: str


@dataclass
class TimeAxis:
    scale: float  # seconds per displayed unit
    label: str


def _time_axis(buckets: Buckets) -> TimeAxis:
    if buckets.step * buckets.count > 1800:
        return TimeAxis(60.0, "time since the run's start (min)")
    return TimeAxis(1.0, "time since the run's start (s)")


def _time_chart(buckets: Buckets, *, grid: bool) -> tuple[Figure, Axes, TimeAxis]:
    """A blank chart of the report's size, with its time axis."""
    fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    if grid:
        ax.grid(True, alpha=0.3)
    return fig, ax, _time_axis(buckets)


def _bucket_words(buckets: Buckets) -> str:
    step = buckets.step
    if step >= 60 and step % 60 == 0:
        return f"{int(step // 60)} min buckets"
    return f"{step:g} s buckets"


def _no_data(ax: Axes, text: str) -> None:
    ax.text(
        0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=14, color="grey"
    )


def _draw_markers(
    ax: Axes, marks: Sequence[Marker], axis: TimeAxis, span: float, over: bool = False
) -> None:
    """Fault events: dashed lines or shaded spans, each with a short rotated label.

    `over`: the plot is opaque (a stacked area), so spans are drawn as their two edges only.
    """
    gap = max(span / axis.scale, 1e-9) * 0.012
    last_x: float | None = None
    row = 0
    for mark in marks:
        color = ACTION_COLORS.get(mark.action, "dimgrey")
        x = mark.start / axis.scale
        if mark.end is None:
            ax.axvline(x, color="black" if over else color, linestyle="--", linewidth=1.2, zorder=3)
        else:
            end = mark.end / axis.scale
            if not over:
                ax.axvspan(x, end, color=color, alpha=0.12, linewidth=0, zorder=0.5)
            for edge in (x, end):
                ax.axvline(
                    edge,
                    color=color if not over else "black",
                    linestyle=":" if not over else "--",
                    linewidth=1.2,
                    alpha=0.9 if not over else 0.6,
                    zorder=3,
                )
        row = row + 1 if last_x is not None and x - last_x < gap else 0
        last_x = x
        if row > 2:
            continue  # too crowded to label: the report's timeline lists every event
        ax.text(
            x + gap * 0.15 + row * gap * 0.9,
            0.98,
            mark.label,
            transform=ax.get_xaxis_transform(),
            rotation=90,
            ha="left",
            va="top",
            fontsize=8,
            color=color,
            zorder=4,
            bbox={"facecolor": "white", "alpha": 0.85 if over else 0.6, "linewidth": 0, "pad": 1},
        )


def _log_if_wide(ax: Axes, arrays: Sequence[Floats]) -> None:
    values = np.concatenate([a[np.isfinite(a) & (a > 0)] for a in arrays] or [np.array([])])
    if values.size and values.max() / values.min() > 100:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)


def _legend(fig: Figure, handles: list[Any], labels: list[str]) -> None:
    if handles:
        fig.legend(
            handles,
            labels,
            loc="outside lower center",
            ncol=min(len(labels), 5),
            fontsize=9,
            frameon=False,
        )


def _line_style(buckets: Buckets) -> dict[str, Any]:
    return {"marker": "o", "markersize": 3} if buckets.count <= 60 else {}


def latency_chart(
    mode: ModeData, buckets: Buckets, marks: list[Marker], span: float, path: Path
) -> None:
    fig, ax, axis = _time_chart(buckets, grid=True)
    x = buckets.centers / axis.scale
    p50, p99 = (a * 1000.0 for a in bucket_percentiles(mode, buckets, (50.0, 99.0)))
    failed = bucket_counts(mode, buckets, ~mode.ok)
    ax2 = ax.twinx()
    bars = ax2.bar(
        x,
        failed,
        width=buckets.step / axis.scale,
        color="tab:red",
        alpha=0.35,
        label="failed requests",
    )
    ax2.set_ylabel(f"failed requests per bucket ({_bucket_words(buckets)})", color="tab:red")
    ax2.set_ylim(bottom=0, top=max(1.0, float(failed.max(initial=0))) * 1.15)
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_zorder(ax2.get_zorder() + 1)
    ax.patch.set_visible(False)
    style = _line_style(buckets)
    (l99,) = ax.plot(x, p99, color="tab:purple", linewidth=1.6, label="p99 latency", **style)
    (l50,) = ax.plot(x, p50, color="tab:blue", linewidth=1.4, label="p50 latency", **style)
    _log_if_wide(ax, [p50, p99])
    ax.set_xlim(0, buckets.count * buckets.step / axis.scale)
    _draw_markers(ax, marks, axis, span)
    ax.set_xlabel(axis.label)
    ax.set_ylabel("total latency (ms), all requests")
    ax.set_title(
        f"{mode.name}: latency over time (by send time, {_bucket_words(buckets)}) and failures"
    )
    if mode.count == 0:
        _no_data(ax, "no records")
    elif not np.isfinite(p50).any():
        _no_data(ax, "no latencies recorded")
    _legend(fig, [l50, l99, bars], ["p50 latency", "p99 latency", "failed requests"])
    fig.savefig(path, dpi=DPI)


def latency_compare_chart(
    modes: Sequence[ModeData], buckets: Buckets, marks: list[Marker], span: float, path: Path
) -> None:
    fig, ax, axis = _time_chart(buckets, grid=True)
    x = buckets.centers / axis.scale
    series: list[Floats] = []
    handles: list[Any] = []
    labels: list[str] = []
    style = _line_style(buckets)
    for mode in modes:
        (p99,) = bucket_percentiles(mode, buckets, (99.0,))
        p99 = p99 * 1000.0
        series.append(p99)
        (line,) = ax.plot(
            x, p99, color=MODE_COLORS.get(mode.name), linewidth=1.6, label=mode.name, **style
        )
        handles.append(line)
        labels.append(f"{mode.name} p99")
    _log_if_wide(ax, series)
    ax.set_xlim(0, buckets.count * buckets.step / axis.scale)
    _draw_markers(ax, marks, axis, span)
    ax.set_xlabel(axis.label)
    ax.set_ylabel("p99 total latency (ms), all requests")
    ax.set_title(f"p99 latency over time: {' vs '.join(m.name for m in modes) or 'no modes'}")
    if not any(np.isfinite(s).any() for s in series):
        _no_data(ax, "no latencies recorded")
    _legend(fig, handles, labels)
    fig.savefig(path, dpi=DPI)


def failures_compare_chart(
    modes: Sequence[ModeData], buckets: Buckets, marks: list[Marker], span: float, path: Path
) -> None:
    fig, ax, axis = _time_chart(buckets, grid=True)
    handles: list[Any] = []
    labels: list[str] = []
    top = 0.0
    edges = np.arange(buckets.count + 1, dtype=np.float64) * buckets.step / axis.scale
    for mode in modes:
        sent = bucket_counts(mode, buckets)
        failed = bucket_counts(mode, buckets, ~mode.ok)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(sent > 0, 100.0 * failed / sent, np.nan)
        top = max(top, float(np.nanmax(rate, initial=0.0)) if np.isfinite(rate).any() else 0.0)
        (line,) = ax.plot(
            edges,
            np.append(rate, rate[-1]),
            color=MODE_COLORS.get(mode.name),
            linewidth=1.6,
            drawstyle="steps-post",
        )
        total = int(sent.sum())
        overall = 100.0 * int(failed.sum()) / total if total else 0.0
        handles.append(line)
        labels.append(f"{mode.name} (overall {overall:.3f} %)")
    ax.set_ylim(0, max(top * 1.1, 1.0))
    ax.set_xlim(0, buckets.count * buckets.step / axis.scale)
    _draw_markers(ax, marks, axis, span)
    ax.set_xlabel(axis.label)
    ax.set_ylabel(f"failed requests (% of sent, {_bucket_words(buckets)})")
    ax.set_title(f"failure rate over time: {' vs '.join(m.name for m in modes) or 'no modes'}")
    if not any(m.count for m in modes):
        _no_data(ax, "no records")
    _legend(fig, handles, labels)
    fig.savefig(path, dpi=DPI)


def share_chart(
    mode: ModeData,
    buckets: Buckets,
    marks: list[Marker],
    span: float,
    colors: dict[str, str],
    path: Path,
) -> None:
    fig, ax, axis = _time_chart(buckets, grid=False)
    edges = np.arange(buckets.count + 1, dtype=np.float64) * buckets.step / axis.scale
    grid = bucket_instance_counts(mode, buckets)
    sums = grid.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(sums > 0, 100.0 * grid / np.where(sums > 0, sums, 1.0), 0.0)
    names = mode.instances or [NO_INSTANCE]
    order = [i for i, n in enumerate(names) if n != NO_INSTANCE] + [
        i for i, n in enumerate(names) if n == NO_INSTANCE
    ]
    handles: list[Any] = []
    labels: list[str] = []
    if mode.count:
        shown = share[order]
        polys = ax.stackplot(
            edges,
            np.concatenate([shown, shown[:, -1:]], axis=1),
            colors=[colors.get(names[i], "lightgrey") for i in order],
            step="post",
            alpha=0.9,
        )
        for poly, i in zip(polys, order, strict=True):
            label = "no instance (gateway answered)" if names[i] == NO_INSTANCE else names[i]
            handles.append(poly)
            labels.append(f"{label} ({100.0 * grid[i].sum() / mode.count:.1f} %)")
    else:
        _no_data(ax, "no records")
    ax.set_ylim(0, 100)
    ax.set_xlim(0, buckets.count * buckets.step / axis.scale)
    _draw_markers(ax, marks, axis, span, over=True)
    ax.set_xlabel(axis.label)
    ax.set_ylabel(f"share of requests (%, {_bucket_words(buckets)})")
    ax.set_title(f"{mode.name}: traffic share per instance over time (final attempt)")
    _legend(fig, handles, labels)
    fig.savefig(path, dpi=DPI)


def instance_colors(modes: Sequence[ModeData]) -> dict[str, str]:
    """One color per instance, the same in every mode's chart."""
    colors: dict[str, str] = {NO_INSTANCE: "lightgrey"}
    for mode in modes:
        for name in mode.instances:
            if name not in colors:
                colors[name] = INSTANCE_PALETTE[(len(colors) - 1) % len(INSTANCE_PALETTE)]
    return colors


def render_charts(run: Run, out_dir: Path) -> list[Chart]:
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = list(run.modes.values())
    buckets = make_buckets(modes)
    span = buckets.count * buckets.step
    colors = instance_colors(modes)
    charts: list[Chart] = []
    for mode in modes:
        marks = markers(mode.events)
        file = f"latency_{mode.name}.png"
        latency_chart(mode, buckets, marks, span, out_dir / file)
        charts.append(Chart(file, f"{mode.name}: latency and failures over time"))
    # Compared charts mark the faults of one run (the schedule is the same in both).
    reference = run.modes.get("gateway") or (modes[0] if modes else None)
    shared_marks = markers(reference.events) if reference else []
    latency_compare_chart(modes, buckets, shared_marks, span, out_dir / "latency_compare.png")
    charts.append(Chart("latency_compare.png", "p99 latency over time, compared"))
    failures_compare_chart(modes, buckets, shared_marks, span, out_dir / "failures_compare.png")
    charts.append(Chart("failures_compare.png", "failure rate over time, compared"))
    for mode in modes:
        file = f"share_{mode.name}.png"
        share_chart(mode, buckets, markers(mode.events), span, colors, out_dir / file)
        charts.append(Chart(file, f"{mode.name}: traffic share per instance"))
    return charts
