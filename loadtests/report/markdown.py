"""report.md: GitHub-flavoured markdown built from the loaded run and its figures."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np

from loadtests.report.charts import Chart
from loadtests.report.data import NO_INSTANCE, ModeData, Run
from loadtests.report.stats import (
    ColdStart,
    Summary,
    cold_starts,
    gateway_counters,
    instance_pool,
    model_instances,
    number,
    percentile,
    succeeded_everywhere,
    summarize,
)

NA = "n/a"


# ---- formatting ----------------------------------------------------------------------------


def count(value: int | None) -> str:
    return NA if value is None else f"{value:,}"


def pct(value: float | None, digits: int = 3) -> str:
    return NA if value is None else f"{value:.{digits}f} %"


def per_100k(value: float | None) -> str:
    return NA if value is None else f"{value:,.1f}"


def ms(seconds: float | None) -> str:
    return NA if seconds is None else f"{seconds * 1000.0:,.1f}"


def secs(value: float | None, digits: int = 2) -> str:
    return NA if value is None else f"{value:,.{digits}f} s"


def meta_num(meta: dict[str, Any], key: str, digits: int = 1) -> str:
    value = number(meta.get(key))
    if value is None:
        return NA
    if value == int(value) and digits == 0:
        return f"{int(value):,}"
    return f"{value:,.{digits}f}"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """A markdown table; the first `left` columns left-aligned, the others right-aligned."""
    align = ["---" if i < left else "--:" for i in range(len(headers))]
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "|".join(align) + "|"]
    lines.extend("| " + " | ".join(cell(c) for c in row) + " |" for row in rows)
    return lines


def cold_text(entry: ColdStart | None) -> str:
    if entry is None:
        return NA
    worst = entry.worst
    if worst is None:
        return f"{NA} (never served after {entry.events} start/restart)"
    text = f"{worst:.2f} s"
    notes = []
    if entry.events > 1:
        notes.append(f"max of {len(entry.delays)}")
    missing = entry.events - len(entry.delays)
    if missing:
        notes.append(f"{missing} never served")
    return text + (f" ({', '.join(notes)})" if notes else "")


# ---- sections ------------------------------------------------------------------------------


def _first_meta(run: Run, key: str) -> Any:
    for mode in run.modes.values():
        if key in mode.meta:
            return mode.meta[key]
    return None


def header(run: Run) -> list[str]:
    scenario = run.scenario
    name = scenario.get("name") or _first_meta(run, "scenario") or run.directory.name
    lines = [f"# Chaos report: {name}", ""]
    description = scenario.get("description")
    if description:
        lines += [str(description).strip(), ""]
    seed = scenario.get("seed")
    date = run.date.strftime("%Y-%m-%d %H:%M UTC") if run.date else NA
    lines.append(f"- **Scenario**: `{name}`, seed `{seed if seed is not None else NA}`")
    lines.append(f"- **Run date**: {date}")
    engine = _first_meta(run, "engine")
    if isinstance(engine, dict):
        # Real engines: their own timings, nothing compressed.
        lines.append(f"- **Backend**: {engine_text(engine)}")
    else:
        compression = compression_text(_first_meta(run, "time_compression"))
        lines.append(f"- **Time compression**: {compression}")
    cpus = _first_meta(run, "cpus")
    if cpus:
        lines.append(f"- **CPUs**: {cpus}")
    modes = list(run.modes.values())
    if not modes:
        lines += ["", "**No mode was run**: neither `direct/` nor `gateway/` exists.", ""]
        return lines
    lines += ["", "### Load", ""]
    rows: list[list[str]] = []

    def row(label: str, fn: Callable[[ModeData], str]) -> None:
        rows.append([label, *(fn(m) for m in modes)])

    row("target rate (req/s)", lambda m: meta_num(m.meta, "target_rate"))
    row("achieved rate (req/s)", lambda m: meta_num(m.meta, "achieved_rate"))
    row("requests planned", lambda m: meta_num(m.meta, "requests_planned", 0))
    row("requests sent", lambda m: meta_num(m.meta, "requests_sent", 0))
    row("records in the ledger", lambda m: count(m.count) if m.ledger_found else "no ledger")
    row("duration (s)", lambda m: meta_num(m.meta, "duration_s"))
    row("load generator CPU", _cpu_text)
    row("load generator peak RSS (MB)", lambda m: meta_num(m.meta, "loadgen_peak_rss_mb"))
    row("send lag p99 / max (ms)", _lag_text)
    lines += table(["", *(m.name for m in modes)], rows)
    for mode in modes:
        target = number(mode.meta.get("target_rate"))
        achieved = number(mode.meta.get("achieved_rate"))
        if target and achieved is not None and achieved < 0.95 * target:
            lines.append("")
            lines.append(
                f"> **Warning** ({mode.name}): the achieved rate is {achieved / target:.0%} of "
                "the target: the load generator fell behind, figures are at a lower load."
            )
        if mode.skipped_records or mode.skipped_events:
            lines.append("")
            lines.append(
                f"> **Note** ({mode.name}): skipped {mode.skipped_records} malformed ledger "
                f"line(s) and {mode.skipped_events} malformed event line(s)."
            )
    lines.append("")
    return lines


def engine_text(value: dict[str, Any]) -> str:
    name = value.get("engine") or NA
    text = (
        f"real engine {name}, `{value.get('preset', NA)}` model, {value.get('slots', NA)} slots "
        "per instance (no time compression)"
    )
    nice = value.get("nice") or {}
    if isinstance(nice, dict) and nice:
        lowered = ", ".join(f"`{name}` at niceness {level}" for name, level in sorted(nice.items()))
        text += f"; lower CPU priority: {lowered}"
    return text


def compression_text(value: Any) -> str:
    if not isinstance(value, dict):
        return NA
    parts = []
    ttft = number(value.get("ttft_s"))
    per_token = number(value.get("per_token_s"))
    per_event = number(value.get("tokens_per_event"))
    if per_token is not None:
        parts.append(f"1 token = {per_token * 1000.0:g} ms")
    if ttft is not None:
        parts.append(f"time to first token {ttft * 1000.0:g} ms")
    if per_event is not None:
        parts.append(f"{per_event:g} tokens per SSE event")
    return ", ".join(parts) or NA


def _cpu_text(mode: ModeData) -> str:
    cpu = number(mode.meta.get("loadgen_cpu_s"))
    if cpu is None:
        return NA
    wall = number(mode.meta.get("duration_s"))
    if wall:
        return f"{cpu:,.1f} s ({100.0 * cpu / wall:.0f} % of a core)"
    return f"{cpu:,.1f} s"


def _lag_text(mode: ModeData) -> str:
    finite = mode.lag[np.isfinite(mode.lag)]
    if finite.size == 0:
        return NA
    return f"{np.percentile(finite, 99) * 1000:,.1f} / {finite.max() * 1000:,.1f}"


def summary_section(run: Run, summaries: dict[str, Summary]) -> list[str]:
    modes = list(run.modes.values())
    if not modes:
        return []
    colds = {m.name: cold_starts(m) for m in modes}
    rows: list[list[str]] = []

    def row(label: str, fn: Callable[[ModeData, Summary], str]) -> None:
        rows.append([label, *(fn(m, summaries[m.name]) for m in modes)])

    row("requests", lambda m, s: count(s.requests))
    row("succeeded", lambda m, s: count(s.succeeded))
    row("**failure rate**", lambda m, s: f"**{pct(s.failure_rate)}**")
    row("improper endings (200, truncated or error event)", lambda m, s: count(s.improper))
    row("… of which stream error events", lambda m, s: count(s.error_events))
    row("client-side errors (no response)", lambda m, s: count(s.client_errors))
    row("HTTP 4xx", lambda m, s: count(s.status_4xx))
    row("HTTP 5xx", lambda m, s: count(s.status_5xx))
    if any(s.status_other for s in summaries.values()):
        row("other statuses", lambda m, s: count(s.status_other))
    row("OOM errors", lambda m, s: count(s.ooms))
    row("failures per 100k requests", lambda m, s: per_100k(s.failures_per_100k))
    row("**OOM errors per 100k requests**", lambda m, s: f"**{per_100k(s.oom_per_100k)}**")
    for key in ("p50", "p95", "p99", "max"):
        row(f"total latency {key} (ms)", _percentile_text(key, lambda s: s.latency))
    row("total latency p99, succeeded only (ms)", lambda m, s: ms(s.latency_ok_p99))
    for key in ("p50", "p95", "p99"):
        row(f"TTFB {key} (ms, streams)", _percentile_text(key, lambda s: s.ttfb))
    row("retries (requests retried)", _retries_text)
    row("isolations", _isolations_text)
    cold_names = _ordered_instances(modes, {n for c in colds.values() for n in c})
    for name in cold_names:
        row(f"cold start {name}", _cold_start_text(colds, name))
    if not cold_names:
        row("cold start", lambda m, s: "no start/restart events")
    lines = ["## Summary", ""]
    lines += table(["", *(m.name for m in modes)], rows)
    lines += [
        "",
        "A request *failed* unless it got HTTP 200 with a complete body (or a stream ending in "
        "`[DONE]` without an error event). Latency percentiles cover every request with a "
        "measured total, failures included (a refused connection fails fast), by linear "
        "interpolation. *Cold start*: from a `start`/`restart` event to the completion of the "
        "first successful request the instance served among those sent after the event.",
        "",
    ]
    return lines


def reasons_section(run: Run) -> list[str]:
    modes = [m for m in run.modes.values() if m.reasons]
    if not modes:
        return []
    lines = ["## Failure reasons", ""]
    for mode in modes:
        failed = sum(mode.reasons.values())
        top = mode.reasons.most_common(8)
        lines.append(f"**{mode.name}** ({failed:,} failed)")
        lines.append("")
        lines += [f"- {reason}: {n:,} ({100.0 * n / failed:.1f} %)" for reason, n in top]
        rest = failed - sum(n for _, n in top)
        if rest:
            lines.append(f"- other reasons: {rest:,}")
        lines.append("")
    return lines


def _percentile_text(
    key: str, of: Callable[[Summary], dict[str, float | None]]
) -> Callable[[ModeData, Summary], str]:
    """A row's cell: one percentile (`key`) of a summary's figures, in milliseconds."""
    return lambda mode, summary: ms(of(summary)[key])


def _cold_start_text(
    colds: dict[str, dict[str, ColdStart]], name: str
) -> Callable[[ModeData, Summary], str]:
    return lambda mode, summary: cold_text(colds[mode.name].get(name))


def _retries_text(mode: ModeData, summary: Summary) -> str:
    if summary.retries is None:
        return NA
    return f"{summary.retries:,} ({summary.retried_requests:,})"


def _isolations_text(mode: ModeData, summary: Summary) -> str:
    counters = gateway_counters(mode)
    value = counters.get("isolations") if counters else None
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else NA


def _ordered_instances(modes: Sequence[ModeData], names: set[str]) -> list[str]:
    ordered: list[str] = []
    for mode in modes:
        ordered.extend(n for n in mode.instances if n in names and n not in ordered)
    ordered.extend(sorted(n for n in names if n not in ordered))
    return ordered


def _anthropic_models(run: Run) -> set[str]:
    """Models of the scenario's `protocol: anthropic` pools (sent with the Messages API)."""
    pools = run.scenario.get("pools")
    if not isinstance(pools, dict):
        return set()
    return {
        str(model)
        for pool in pools.values()
        if isinstance(pool, dict) and pool.get("protocol") == "anthropic"
        for model in pool.get("models") or ()
    }


def model_section(run: Run) -> list[str]:
    modes = list(run.modes.values())
    models: list[str] = []
    for mode in modes:
        models.extend(m for m in mode.models if m not in models)
    models.sort()
    lines = ["## Per model", ""]
    if not models:
        return [*lines, "No records.", ""]
    anthropic = _anthropic_models(run)
    rows = []
    for model in models:
        label = f"`{model}` (Messages API)" if model in anthropic else f"`{model}`"
        for mode in modes:
            if model not in mode.models:
                rows.append([label, mode.name, "0", *[NA] * 10])
                continue
            s = summarize(mode, mode.model == mode.models.index(model))
            colds = cold_starts(mode)
            worst = [
                colds[i].worst
                for i in model_instances(mode, model)
                if i in colds and colds[i].worst is not None
            ]
            rows.append(
                [
                    label,
                    mode.name,
                    count(s.requests),
                    pct(s.failure_rate),
                    per_100k(s.failures_per_100k),
                    per_100k(s.oom_per_100k),
                    f"{max(w for w in worst if w is not None):.2f} s" if worst else NA,
                    ms(s.latency["p50"]),
                    ms(s.latency["p99"]),
                    ms(s.ttfb_ok.get("p50")),
                    ms(s.ttfb_ok.get("p95")),
                    ms(s.latency_ok_p50),
                    ms(s.latency_ok_p99),
                ]
            )
    lines += table(
        [
            "model",
            "mode",
            "requests",
            "failure rate",
            "failures per 100k",
            "OOM per 100k",
            "cold start (max)",
            "p50 (ms)",
            "p99 (ms)",
            "ok: TTFB p50 (ms)",
            "ok: TTFB p95 (ms)",
            "ok: p50 (ms)",
            "ok: p99 (ms)",
        ],
        rows,
        left=2,
    )
    lines += [
        "",
        "p50 and p99 cover every request, failures included; the `ok:` columns only the "
        "requests that succeeded (TTFB: streams).",
        "",
        *_like_for_like(modes, models),
    ]
    return [*lines, ""]


def _like_for_like(modes: Sequence[ModeData], models: list[str]) -> list[str]:
    """Per model, the latencies of the requests that succeeded in every mode."""
    if len(modes) < 2:
        return []
    masks = succeeded_everywhere(modes)
    rows = []
    for model in models:
        for mode, mask in zip(modes, masks, strict=True):
            if model not in mode.models:
                continue
            mine = mask & (mode.model == mode.models.index(model))
            streams = mine & mode.stream
            rows.append(
                [
                    f"`{model}`",
                    mode.name,
                    count(int(mine.sum())),
                    ms(percentile(mode.ttfb[streams], 50)),
                    ms(percentile(mode.ttfb[streams], 95)),
                    ms(percentile(mode.total[mine], 50)),
                    ms(percentile(mode.total[mine], 99)),
                ]
            )
    if not rows:
        return []
    return [
        "### Like for like: the requests that succeeded both ways",
        "",
        *table(
            [
                "model",
                "mode",
                "requests",
                "TTFB p50 (ms)",
                "TTFB p95 (ms)",
                "p50 (ms)",
                "p99 (ms)",
            ],
            rows,
            left=2,
        ),
        "",
        "The same requests in each mode (by their order of sending). The `ok:` columns above "
        "compare different sets: the requests direct failed at once are the ones the gateway "
        "served through a retry or a resume, and only the gateway's figures include them.",
    ]


def instance_section(run: Run) -> list[str]:
    modes = list(run.modes.values())
    names = _ordered_instances(modes, {n for m in modes for n in m.instances})
    lines = ["## Per instance", ""]
    if not names:
        return [*lines, "No instances seen.", ""]
    headers = ["instance", "pool"]
    for mode in modes:
        headers += [f"{mode.name} share", f"{mode.name} requests", f"{mode.name} failed"]
    rows = []
    for name in names:
        label = "no instance (answered by the gateway)" if name == NO_INSTANCE else f"`{name}`"
        row = [label, instance_pool(modes, name) or NA]
        for mode in modes:
            index = mode.instance_index(name)
            if index is None or mode.count == 0:
                row += [NA if mode.count == 0 else "0.0 %", "0", "0"]
                continue
            mine = mode.instance == index
            n = int(mine.sum())
            failed = int((mine & ~mode.ok).sum())
            rate = f" ({100.0 * failed / n:.3f} %)" if n else ""
            row += [pct(100.0 * n / mode.count, 1), count(n), f"{failed:,}{rate}"]
        rows.append(row)
    lines += table(headers, rows, left=2)
    lines += [
        "",
        "By the instance that gave the final answer (`x-gateway-instance`, or the target when "
        "direct); a failure counts against the instance of the last attempt.",
        "",
    ]
    return lines


def _event_detail(detail: dict[str, Any]) -> str:
    if not detail:
        return ""
    text = json.dumps(detail, separators=(", ", ": "), sort_keys=True, default=str)
    return f"`{text}`" if len(text) <= 200 else f"`{text[:199]}…`"


def timeline_section(run: Run) -> list[str]:
    lines = ["## Fault timeline", ""]
    modes = list(run.modes.values())
    if not modes:
        return [*lines, "No events.", ""]

    def key(mode: ModeData) -> list[tuple[float, str, str, str]]:
        return [(round(e.t, 1), e.action, e.target, _event_detail(e.detail)) for e in mode.events]

    if len(modes) > 1 and all(m.events_found and key(m) == key(modes[0]) for m in modes):
        lines += [
            f"The same schedule in {' and '.join(m.name for m in modes)} (times as applied "
            f"in {modes[0].name}):",
            "",
        ]
        modes = modes[:1]
    merged = len(modes) < len(run.modes)
    for mode in modes:
        if not merged:
            lines.append(f"**{mode.name}**" + ("" if mode.events_found else " (no events file)"))
            lines.append("")
        if not mode.events:
            lines += ["- no fault events", ""]
            continue
        for event in mode.events:
            detail = _event_detail(event.detail)
            lines.append(
                f"- t={event.t:,.3f} s: `{event.action}` **{event.target}**"
                + (f" {detail}" if detail else "")
            )
        lines.append("")
    return lines


def crosscheck_section(run: Run, summaries: dict[str, Summary]) -> list[str]:
    lines = ["## Cross-check: gateway counters vs the ledger", ""]
    mode = run.modes.get("gateway")
    if mode is None:
        return [*lines, "n/a: no gateway run.", ""]
    counters = gateway_counters(mode)
    per_instance = counters.get("requests_per_instance") if counters else None
    if not isinstance(per_instance, dict):
        return [*lines, "n/a: the gateway's per-instance request counts were not recorded.", ""]
    gateway_counts = {
        str(k): int(v)
        for k, v in per_instance.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    names = _ordered_instances(
        [mode], set(gateway_counts) | {n for n in mode.instances if n != NO_INSTANCE}
    )
    rows = []
    flagged = []
    for name in names:
        index = mode.instance_index(name)
        ledger = int((mode.instance == index).sum()) if index is not None else 0
        gw = gateway_counts.get(name)
        diff = None if gw is None else gw - ledger
        flag = ""
        if gw is None:
            flag = "not in the gateway's counters"
        elif ledger > gw:
            flag = "**ledger exceeds gateway**"
            flagged.append(name)
        rows.append([f"`{name}`", count(gw), count(ledger), count(diff), flag])
    gw_total = sum(gateway_counts.values())
    none_index = mode.instance_index(NO_INSTANCE)
    ledger_total = mode.count - (
        int((mode.instance == none_index).sum()) if none_index is not None else 0
    )
    retries = summaries["gateway"].retries
    diff_total = gw_total - ledger_total
    rows.append(["**total**", count(gw_total), count(ledger_total), count(diff_total), ""])
    headers = ["instance", "gateway count", "ledger final attempts", "difference", "note"]
    lines += table(headers, rows)
    lines += [
        "",
        f"Gateway counted {gw_total:,} upstream requests, the ledger has {ledger_total:,} final "
        f"attempts: difference {gw_total - ledger_total:,}; retries in the ledger: "
        f"{count(retries)}.",
        "",
    ]
    if ledger_total > gw_total:
        lines += [
            f"> **Lost accounting**: the ledger has {ledger_total - gw_total:,} more final "
            "attempts than the gateway counted.",
            "",
        ]
    elif flagged:
        lines += [
            "> **Check**: the ledger has more final attempts than the gateway counted on "
            + ", ".join(f"`{n}`" for n in flagged)
            + ".",
            "",
        ]
    elif retries is not None and diff_total > retries:
        lines += [
            f"The difference exceeds the ledger's retries by {diff_total - retries:,}: requests "
            "that ended without an `x-gateway-instance` (client timeouts, resets) still count "
            "in the gateway.",
            "",
        ]
    elif retries is not None and diff_total < retries:
        lines += [
            f"> **Check**: the ledger's retries ({retries:,}) exceed the difference "
            f"({diff_total:,}): the gateway's counters miss {retries - diff_total:,} upstream "
            "attempts.",
            "",
        ]
    return lines


def charts_section(charts: Sequence[Chart]) -> list[str]:
    lines = ["## Charts", ""]
    for chart in charts:
        lines += [f"### {chart.title}", "", f"![{chart.title}](charts/{chart.file})", ""]
    return lines


def render(run: Run, charts: Sequence[Chart]) -> str:
    summaries = {name: summarize(mode) for name, mode in run.modes.items()}
    lines = header(run)
    lines += summary_section(run, summaries)
    lines += reasons_section(run)
    lines += model_section(run)
    lines += instance_section(run)
    lines += timeline_section(run)
    lines += crosscheck_section(run, summaries)
    lines += charts_section(charts)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines += [f"<sub>Generated {generated} by `python -m loadtests.report`.</sub>", ""]
    return "\n".join(lines)
