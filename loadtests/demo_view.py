"""What the demo shows: running tallies of both sides, the live terminal view, the summary.

The live view redraws itself in place with plain ANSI escape codes (cursor up, clear line); with
`--no-live`, or when stdout is not a terminal, it prints a line every few seconds instead. The
gateway's side of the table is read from its admin plane (`GET /admin/state`); the success
rates, latencies and retries are what the clients saw (ledger records).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from loadtests.demo_timeline import NAMES, POOL, Script
from loadtests.ledger import Record
from loadtests.loadgen import Progress

WINDOW_S = 3.0  # "recent": traffic share and success over the last seconds

GREEN, YELLOW, RED, BOLD, DIM = "32", "33", "31", "1", "2"
STATE_COLOURS = {"ADMITTING": GREEN, "PROBING": YELLOW, "ISOLATED": RED}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of values; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def pct(ok: int, total: int) -> float:
    return 100.0 * ok / total if total else 100.0


def fmt_pct(value: float) -> str:
    """Rounded down, so 2,299 of 2,300 never shows as 100.0 %."""
    return f"{math.floor(value * 10 + 1e-9) / 10:.1f} %"


def fmt_s(seconds: float) -> str:
    if seconds < 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds:.2f} s" if seconds < 10.0 else f"{seconds:.1f} s"


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1.0 else f"{seconds:.1f} s"


@dataclass
class Tally:
    count: int = 0
    ok: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, ok: bool, latency: float) -> None:
        self.count += 1
        self.ok += ok
        self.latencies.append(latency)

    @property
    def ok_percent(self) -> float:
        return pct(self.ok, self.count)

    def p(self, q: float) -> float:
        return percentile(self.latencies, q)


class Side:
    """What one side's clients got: overall, per chapter of the script, and recently."""

    def __init__(self, label: str, script: Script, progress: Progress) -> None:
        self.label = label
        self.script = script
        self.progress = progress
        self.clock = progress.elapsed
        self.total = Tally()
        self.chapters = [Tally() for _ in script.chapters]
        self.retries = 0
        self.answered: dict[str, int] = {}  # per target (the direct side's instances)
        # (answered at, ok, target instance) over the last WINDOW_S seconds
        self.recent: deque[tuple[float, bool, str]] = deque()

    def add(self, record: Record) -> None:
        latency = record.total if record.total is not None else 0.0
        self.total.add(record.ok, latency)
        self.chapters[self.script.chapter_index(record.t)].add(record.ok, latency)
        if record.attempts:
            self.retries += record.attempts - 1
        self.recent.append((self.clock(), record.ok, record.target))
        self.answered[record.target] = self.answered.get(record.target, 0) + 1

    def _trim(self) -> None:
        horizon = self.clock() - WINDOW_S
        while self.recent and self.recent[0][0] < horizon:
            self.recent.popleft()

    def recent_percent(self, target: str | None = None) -> float | None:
        self._trim()
        hits = [ok for _, ok, name in self.recent if target is None or name == target]
        return pct(sum(hits), len(hits)) if hits else None

    @property
    def in_flight(self) -> int:
        return self.progress.in_flight

    def waiting_on(self, index: int, targets: int) -> int:
        """Requests sent to the index-th of `targets` round-robin targets and not answered yet.

        The generator sends request n to target n % targets (one model), so the sends per target
        follow from the total; the answers are counted per target as they come.
        """
        sent = max(0, self.progress.sent - index + targets - 1) // targets
        return max(0, sent - self.answered.get(NAMES[index], 0))


@dataclass
class InstanceRow:
    name: str
    state: str
    healthy: bool
    isolation_left_s: float
    ttfb_ewma_s: float | None
    first_byte_timeout_s: float | None
    share: float | None
    in_flight: int
    isolations: int
    failures: int


class GatewayView:
    """Per-instance rows from successive `/admin/state` snapshots (traffic share from deltas of
    each instance's attempt counter over the last WINDOW_S seconds)."""

    def __init__(self) -> None:
        self.rows: dict[str, InstanceRow] = {}
        self.failure_rate = 0.0
        self._history: deque[tuple[float, dict[str, int]]] = deque()

    def update(self, state: dict[str, Any], now: float) -> None:
        pool = state.get("pools", {}).get(POOL, {})
        self.failure_rate = float(pool.get("failure_rate", 0.0))
        counts = {i["name"]: int(i.get("requests", 0)) for i in pool.get("instances", [])}
        self._history.append((now, counts))
        while len(self._history) > 2 and self._history[1][0] <= now - WINDOW_S:
            self._history.popleft()
        before = self._history[0][1]
        deltas = {name: n - before.get(name, 0) for name, n in counts.items()}
        moved = sum(deltas.values())
        for inst in pool.get("instances", []):
            ttfb = inst.get("ewma", {}).get("ttfb", {})
            name = inst["name"]
            self.rows[name] = InstanceRow(
                name=name,
                state=str(inst.get("state", "?")),
                healthy=bool(inst.get("health", {}).get("healthy", True)),
                isolation_left_s=float(inst.get("isolation_remaining_s") or 0.0),
                ttfb_ewma_s=ttfb.get("mean_s") if ttfb.get("samples") else None,
                first_byte_timeout_s=inst.get("timeouts", {}).get("stream_first_byte_s"),
                share=deltas[name] / moved if moved else None,
                in_flight=int(inst.get("in_flight", 0)),
                isolations=int(inst.get("isolations", 0)),
                failures=int(inst.get("failures", 0)),
            )

    @property
    def isolations(self) -> int:
        return sum(row.isolations for row in self.rows.values())


class Painter:
    def __init__(self, colour: bool) -> None:
        self.colour = colour

    def __call__(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.colour else text

    def ok(self, text: str, value: float | None) -> str:
        if value is None:
            return text
        return self(text, GREEN if value >= 99.5 else YELLOW if value >= 95.0 else RED)


def frame(
    elapsed: float, script: Script, gateway: Side, direct: Side, view: GatewayView, paint: Painter
) -> list[str]:
    """The live view's lines (at most 100 columns)."""
    t = min(elapsed, script.seconds)
    if elapsed > script.seconds:
        now = paint("traffic over; waiting for the last answers", GREEN)
    else:
        now = paint(script.chapter(t), YELLOW if script.active(t) else GREEN)
    lines = [
        paint(f" llm-gateway demo  {t:5.1f} s of {script.seconds:.0f} s", BOLD) + "   " + now,
        "",
        f" {'clients':<22}{'ok so far':>10}{'last 3 s':>10}{'answered':>10}{'waiting':>9}",
    ]
    for side, extra in (
        (gateway, f"   retries {gateway.retries}, isolations {view.isolations}"),
        (direct, "   no retries, no breakers"),
    ):
        so_far = side.total.ok_percent
        recent = side.recent_percent()
        lines.append(
            f" {side.label:<22}"
            + paint.ok(f"{fmt_pct(so_far):>10}", so_far)
            + paint.ok(f"{fmt_pct(recent) if recent is not None else '-':>10}", recent)
            + f"{side.total.count:>10}{side.in_flight:>9}"
            + paint(extra, DIM)
        )
    lines += [
        "",
        f" {'':<21}{'--- what the gateway sees and does ---':^61}{'--- direct ---':^17}",
        f" {'instance':<9}{'fault now':<12}{'breaker':<13}{'ttfb ewma':>10}{'fb timeout':>11}"
        f"{'traffic':>8}{'in flight':>10}{'isolated':>9}{'ok 3 s':>9}{'waiting':>8}",
    ]
    active = script.active(t)
    for index, name in enumerate(NAMES):
        row = view.rows.get(name)
        fault = active.get(name, "-")
        direct_ok = direct.recent_percent(name)
        direct_text = (
            paint.ok(f"{fmt_pct(direct_ok) if direct_ok is not None else '-':>9}", direct_ok)
            + f"{direct.waiting_on(index, len(NAMES)):>8}"
        )
        cells = f" {name:<9}" + paint(f"{fault:<12}", YELLOW if fault != "-" else DIM)
        if row is None:
            lines.append(cells + f"{'?':<13}{'':<57}" + direct_text)
            continue
        state = row.state
        if state == "ISOLATED" and row.isolation_left_s > 0:
            state += f" {row.isolation_left_s:.0f}s"
        if not row.healthy:
            state += " !h"
        share = "-" if row.share is None else f"{100 * row.share:.0f} %"
        lines.append(
            cells
            + paint(f"{state:<13}", STATE_COLOURS.get(row.state, YELLOW))
            + f"{fmt_ms(row.ttfb_ewma_s):>10}{fmt_ms(row.first_byte_timeout_s):>11}"
            f"{share:>8}{row.in_flight:>10}{row.isolations:>9}" + direct_text
        )
    lines += [
        "",
        paint(
            " ttfb ewma: the gateway's prediction of the time to first byte; fb timeout: what its"
            " next\n streamed attempt may wait; traffic: its attempts' share over the last 3 s;"
            " !h: failing\n health checks. direct: what clients without the gateway got from the"
            " instance (ok\n among answers of the last 3 s, requests still waiting for one).",
            DIM,
        ),
    ]
    return "\n".join(lines).split("\n")


def plain_line(elapsed: float, gateway: Side, direct: Side, view: GatewayView) -> str:
    """One line of the plain (non-live) output."""
    parts = []
    for name in NAMES:
        row = view.rows.get(name)
        if row is None:
            continue
        share = "-" if row.share is None else f"{100 * row.share:.0f}%"
        parts.append(f"{name} {row.state} {share}")
    return (
        f"[{elapsed:5.1f} s] gateway {fmt_pct(gateway.total.ok_percent)} ok"
        f" ({gateway.total.count}) | direct {fmt_pct(direct.total.ok_percent)} ok"
        f" ({direct.total.count}) | retries {gateway.retries} | " + ", ".join(parts)
    )


def summary(
    script: Script, gateway: Side, direct: Side, view: GatewayView, paint: Painter
) -> list[str]:
    """The closing tables (not the final line)."""
    lines = [
        "",
        paint(
            f"Summary: the same {gateway.total.count} requests each way, at the same moments,"
            " against the same faults",
            BOLD,
        ),
        "",
        f" {'clients':<22}{'requests':>9}{'ok %':>10}{'failed':>8}{'p50':>9}{'p99':>9}"
        f"{'slowest':>9}{'retries':>9}",
    ]
    for side, retries in ((gateway, str(gateway.retries)), (direct, "-")):
        t = side.total
        lines.append(
            f" {side.label:<22}{t.count:>9}"
            + paint.ok(f"{fmt_pct(t.ok_percent):>10}", t.ok_percent)
            + f"{t.count - t.ok:>8}{fmt_s(t.p(0.5)):>9}{fmt_s(t.p(0.99)):>9}"
            f"{fmt_s(max(t.latencies, default=0.0)):>9}{retries:>9}"
        )
    lines += [
        "",
        f" {'by chapter (requests sent during it)':<58}{'gateway':>10}{'direct':>10}"
        f"{'gw p99':>9}{'direct p99':>11}",
    ]
    for index, chapter in enumerate(script.chapters):
        start, end = script.chapter_bounds(index)
        g, d = gateway.chapters[index], direct.chapters[index]
        label = f"{start:4.1f}-{end:4.1f} s  {chapter.label}"
        if len(label) > 57:
            label = label[:56] + "…"
        lines.append(
            f" {label:<58}"
            + paint.ok(f"{fmt_pct(g.ok_percent):>10}", g.ok_percent)
            + paint.ok(f"{fmt_pct(d.ok_percent):>10}", d.ok_percent)
            + f"{fmt_s(g.p(0.99)):>9}{fmt_s(d.p(0.99)):>11}"
        )
    isolated = ", ".join(
        f"{row.name} x{row.isolations}" for row in view.rows.values() if row.isolations
    )
    lines += [
        "",
        f" The gateway retried {gateway.retries} attempts before any byte reached a client;"
        f" it isolated\n {isolated or 'no instance'}. Latencies count every request, failed ones"
        " included:\n a client without the gateway waits until it gives up.",
    ]
    return "\n".join(lines).split("\n")


def final_line(gateway: Side, direct: Side) -> str:
    g, d = gateway.total, direct.total
    return (
        f"Gateway: {fmt_pct(g.ok_percent)} ok, p99 {fmt_s(g.p(0.99))} | "
        f"Direct: {fmt_pct(d.ok_percent)} ok, p99 {fmt_s(d.p(0.99))} (same traffic, same faults)"
    )
