"""The chaos report renders synthetic run directories: exact figures, sections and charts.

The runs are built by hand so every headline figure is computable on paper (see `make_run`);
latencies come from a seeded generator and are only checked for shape, except in the unit
test of the percentile definition.
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtests.ledger import Event, JsonlWriter, Record, read_records
from loadtests.loadgen import NO_CLASS, per_class_summary
from loadtests.report import build_report
from loadtests.report.data import load_run
from loadtests.report.stats import bucket_step, markers, summarize

REPO = Path(__file__).resolve().parent.parent
N = 2000  # records per mode, one every 20 ms: 40 s
RATE = 50.0
MODELS = {"a": "model-a", "b": "model-a", "c": "model-b"}
INSTANCES = {
    "a": {"pool": "pool-a", "models": ["model-a"]},
    "b": {"pool": "pool-a", "models": ["model-a"]},
    "c": {"pool": "pool-b", "models": ["model-b"]},
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(seq: int, rng: random.Random, mode: str) -> Record:
    """One request of the synthetic run.

    Even seqs ask model-a (round robin over a, b when direct), odd seqs model-b (only on c).
    Both modes: c restarts at t=10. Direct: c refuses connections until t=13; the first ok on
    c is seq 651 (t=13.02, total 0.1): cold start 3.12 s. Gateway: model-b gets the gateway's
    503 until t=12; first ok on c is seq 601 (t=12.02): cold start 2.12 s.
    Direct faults: seq % 100 == 2 -> OOM 500 on b (20); seq % 250 == 4 -> truncated 200 (8).
    Gateway: the OOMs are retried onto a (attempts 2), of which seq % 1000 == 2 fail again with
    an OOM (2); seq % 500 == 10 took 3 attempts (4 requests); the truncated 200s stay (8).
    """
    t = seq / RATE
    model_b = seq % 2 == 1
    direct = mode == "direct"
    instance = "c" if model_b else ("a" if (seq // 2) % 2 == 0 else "b")
    stream = model_b
    total = rng.lognormvariate(-1.6, 0.4)
    rec = Record(
        seq=seq,
        t=t,
        model="model-b" if model_b else "model-a",
        kind="chat",
        stream=stream,
        prompt_tokens=20,
        max_tokens=64,
        target=instance if direct else "gateway",
        status=200,
        ttfb=total * 0.3 if stream else None,
        total=total,
        bytes=900,
        chunks=16 if stream else 0,
        attempts=None if direct else 1,
        instance=instance,
        proper=True,
        lag=rng.random() * 0.002,
    )
    restart_until = 13.0 if direct else 12.0
    if model_b and 10.0 <= t < restart_until:
        if direct:
            rec.status, rec.error, rec.proper = 0, "ClientConnectorError: refused", False
            rec.total, rec.ttfb = 0.001, None
        else:
            rec.status, rec.proper, rec.instance, rec.attempts = 503, False, None, None
            rec.total, rec.ttfb = 0.002, None
    elif model_b and seq in (651, 601) and t >= restart_until:
        rec.total = 0.1
    if seq % 100 == 2:
        if direct:
            rec.status, rec.proper, rec.oom = 500, False, True
        else:
            rec.attempts, rec.instance = 2, "a"
            if seq % 1000 == 2:
                rec.status, rec.proper, rec.oom = 500, False, True
    if seq % 250 == 4:
        rec.proper = False  # a body cut short
    if not direct and seq % 500 == 10:
        rec.attempts = 3
    return rec


def events(mode: str) -> list[Event]:
    return [
        Event(5.0, "set", "b", {"oom_rate": 0.01, "until": 30.0}),
        Event(10.0, "restart", "c", {"delay_s": 3.0}),
        Event(20.0, "freeze", "a"),
        Event(22.0, "thaw", "a"),
        Event(30.0, "clear", "b"),
    ]


def meta(mode: str, records: list[Record], counters: dict[str, Any] | None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "mode": mode,
        "scenario": "synthetic",
        "target_rate": RATE,
        "requests_planned": N,
        "requests_sent": len(records),
        "achieved_rate": 49.9,
        "duration_s": 40.2,
        "loadgen_cpu_s": 4.1,
        "loadgen_peak_rss_mb": 88.5,
        "time_compression": {"ttft_s": 0.02, "per_token_s": 0.001, "tokens_per_event": 4},
        "instances": INSTANCES,
    }
    if counters is not None:
        data["gateway_counters"] = counters
    return data


def write_mode(
    run: Path,
    mode: str,
    records: list[Record],
    evts: list[Event] | None,
    counters: dict[str, Any] | None = None,
) -> None:
    directory = run / mode
    directory.mkdir(parents=True)
    ledger = JsonlWriter(directory / "ledger.jsonl")
    for rec in records:
        ledger.write(rec)
    ledger.close()
    if evts is not None:
        writer = JsonlWriter(directory / "events.jsonl")
        for event in evts:
            writer.write(event)
        writer.close()
    (directory / "meta.json").write_text(json.dumps(meta(mode, records, counters)))


def gateway_counts(records: list[Record], extra: dict[str, int]) -> dict[str, int]:
    counts = {name: extra.get(name, 0) for name in INSTANCES}
    for rec in records:
        if rec.instance is not None:
            counts[rec.instance] += 1
    return counts


def make_run(root: Path, modes: tuple[str, ...] = ("direct", "gateway")) -> Path:
    run = root / "run"
    run.mkdir()
    (run / "scenario.yaml").write_text(
        "name: restart-under-load\ndescription: c restarts while b runs out of memory\nseed: 7\n"
    )
    for mode in modes:
        rng = random.Random(f"{mode}-7")
        records = [record(seq, rng, mode) for seq in range(N)]
        counters = None
        if mode == "gateway":
            # Each retry is one more upstream request: 20 OOM retries + 4 * 2 on seq % 500 == 10.
            retried = {"b": 20, "a": 8}
            counters = {
                "requests_per_instance": gateway_counts(records, retried),
                "isolations": 1,
                "retries": 28,
            }
        write_mode(run, mode, records, events(mode), counters)
    return run


def row(report: str, label: str) -> list[str]:
    """The cells after the label of the table row starting with `| label |`."""
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r}")


def rows(report: str, label: str) -> list[list[str]]:
    out = []
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == label:
            out.append(cells[1:])
    return out


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 10_000, (path, len(data))
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 500), (path, width, height)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run = make_run(tmp_path_factory.mktemp("full"))
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.report", str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == str(run / "report.md")
    return run, (run / "report.md").read_text()


def test_sections_and_header(full_run: tuple[Path, str]) -> None:
    _, report = full_run
    for heading in (
        "# Chaos report: restart-under-load",
        "## Summary",
        "## Per model",
        "## Per instance",
        "## Fault timeline",
        "## Cross-check: gateway counters vs the ledger",
        "## Charts",
    ):
        assert heading in report, heading
    assert "c restarts while b runs out of memory" in report
    assert "seed `7`" in report
    assert "1 token = 1 ms" in report
    assert "4 tokens per SSE event" in report
    assert row(report, "target rate (req/s)") == ["50.0", "50.0"]
    assert row(report, "achieved rate (req/s)") == ["49.9", "49.9"]
    assert row(report, "load generator CPU") == ["4.1 s (10 % of a core)"] * 2


def test_summary_exact_figures(full_run: tuple[Path, str]) -> None:
    _, report = full_run
    assert row(report, "requests") == ["2,000", "2,000"]
    # direct: 75 refused on c + 20 OOM + 8 truncated; gateway: 50 x 503 + 2 OOM + 8 truncated
    assert row(report, "succeeded") == ["1,897", "1,940"]
    assert row(report, "**failure rate**") == ["**5.150 %**", "**3.000 %**"]
    assert row(report, "improper endings (200, truncated or error event)") == ["8", "8"]
    assert row(report, "client-side errors (no response)") == ["75", "0"]
    assert row(report, "HTTP 5xx") == ["20", "52"]
    assert row(report, "HTTP 4xx") == ["0", "0"]
    assert row(report, "OOM errors") == ["20", "2"]
    assert row(report, "**OOM errors per 100k requests**") == ["**1,000.0**", "**100.0**"]
    assert row(report, "failures per 100k requests") == ["5,150.0", "3,000.0"]
    assert row(report, "retries (requests retried)") == ["n/a", "28 (24)"]
    assert row(report, "isolations") == ["n/a", "1"]
    assert row(report, "cold start c") == ["3.12 s", "2.12 s"]
    for label in ("total latency p50 (ms)", "total latency p99 (ms)", "TTFB p99 (ms, streams)"):
        cells = row(report, label)
        assert all(float(c.replace(",", "")) > 0 for c in cells), (label, cells)


def test_per_model_rows(full_run: tuple[Path, str]) -> None:
    _, report = full_run
    a = rows(report, "`model-a`")
    b = rows(report, "`model-b`")
    # Then the like-for-like table: the same requests both ways, as many in each mode.
    for like in (a[2:], b[2:]):
        assert [r[0] for r in like] == ["direct", "gateway"]
        assert like[0][1] == like[1][1]
    assert int(a[2][1].replace(",", "")) <= 972  # model-a's successes direct (2.8 % failed)
    a, b = a[:2], b[:2]
    assert [r[:6] for r in a] == [
        ["direct", "1,000", "2.800 %", "2,800.0", "2,000.0", "n/a"],
        ["gateway", "1,000", "1.000 %", "1,000.0", "200.0", "n/a"],
    ]
    assert [r[:6] for r in b] == [
        ["direct", "1,000", "7.500 %", "7,500.0", "0.0", "3.12 s"],
        ["gateway", "1,000", "5.000 %", "5,000.0", "0.0", "2.12 s"],
    ]
    # The succeeded-only figures: model-a's requests are whole answers (no TTFB); model-b's
    # are streams, whose first byte comes before their end (0.3 of it in this run).
    assert all(r[-4:-2] == ["n/a", "n/a"] and r[-2] != "n/a" for r in a)
    for r in b:
        ttfb_p50, _, total_p50, _ = (float(c.replace(",", "")) for c in r[-4:])
        assert ttfb_p50 == pytest.approx(0.3 * total_p50, rel=0.01), r


def test_per_instance_and_timeline(full_run: tuple[Path, str]) -> None:
    _, report = full_run
    # direct: round robin a/b for model-a, all model-b on c; the 20 OOMs are b's failures.
    assert row(report, "`b`")[:4] == ["pool-a", "25.0 %", "500", "24 (4.800 %)"]
    assert row(report, "`c`")[:4] == ["pool-b", "50.0 %", "1,000", "75 (7.500 %)"]
    assert row(report, "no instance (answered by the gateway)")[4:] == [
        "2.5 %",
        "50",
        "50 (100.000 %)",
    ]
    assert '- t=10.000 s: `restart` **c** `{"delay_s": 3.0}`' in report
    assert "- t=20.000 s: `freeze` **a**" in report
    assert "The same schedule in direct and gateway" in report
    assert report.count("`restart` **c**") == 1


def test_cross_check(full_run: tuple[Path, str]) -> None:
    _, report = full_run
    assert (
        "Gateway counted 1,978 upstream requests, the ledger has 1,950 final attempts: "
        "difference 28; retries in the ledger: 28." in report
    )
    assert row(report, "**total**") == ["1,978", "1,950", "28", ""]
    assert "Lost accounting" not in report


def test_charts_are_pngs(full_run: tuple[Path, str]) -> None:
    run, report = full_run
    expected = [
        "latency_direct.png",
        "latency_gateway.png",
        "latency_compare.png",
        "failures_compare.png",
        "share_direct.png",
        "share_gateway.png",
    ]
    for name in expected:
        assert f"](charts/{name})" in report
        assert_png(run / "charts" / name)
    assert sorted(p.name for p in (run / "charts").iterdir()) == sorted(expected)


def test_lost_accounting_is_flagged(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rng = random.Random(1)
    records = [record(seq, rng, "gateway") for seq in range(200)]
    counters = {"requests_per_instance": {"a": 10, "b": 10, "c": 10}}
    write_mode(run, "gateway", records, None, counters)
    report = build_report(run).read_text()
    assert "**Lost accounting**" in report
    assert "**ledger exceeds gateway**" in report
    assert row(report, "isolations") == ["n/a"]


def test_one_mode_only(tmp_path: Path) -> None:
    run = make_run(tmp_path, modes=("gateway",))
    report = build_report(run).read_text()
    assert row(report, "**failure rate**") == ["**3.000 %**"]
    assert "Gateway counted 1,978 upstream requests" in report
    charts = sorted(p.name for p in (run / "charts").iterdir())
    assert charts == [
        "failures_compare.png",
        "latency_compare.png",
        "latency_gateway.png",
        "share_gateway.png",
    ]
    for name in charts:
        assert_png(run / "charts" / name)


def test_direct_only_has_no_cross_check(tmp_path: Path) -> None:
    run = make_run(tmp_path, modes=("direct",))
    report = build_report(run).read_text()
    assert "n/a: no gateway run." in report
    assert row(report, "cold start c") == ["3.12 s"]


def test_empty_and_degenerate_modes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # direct: an empty ledger, no events file, no meta.
    (run / "direct").mkdir(parents=True)
    (run / "direct" / "ledger.jsonl").write_text("")
    # gateway: every request failed without a latency or ttfb, a malformed trailing line.
    records = [
        Record(i, i * 0.5, "m", "chat", True, 1, 1, "gateway", status=0, error="Timeout")
        for i in range(30)
    ]
    write_mode(run, "gateway", records, [Event(3.0, "kill", "x")])
    with (run / "gateway" / "ledger.jsonl").open("a") as f:
        f.write('{"seq": 30, "t": 15.0, "mod')
    report = build_report(run).read_text()
    assert row(report, "requests") == ["0", "30"]
    assert row(report, "**failure rate**") == ["**n/a**", "**100.000 %**"]
    assert row(report, "total latency p99 (ms)") == ["n/a", "n/a"]
    assert row(report, "cold start") == ["no start/restart events"] * 2
    assert "skipped 1 malformed ledger line(s)" in report
    assert "**direct** (no events file)" in report
    assert "n/a: the gateway's per-instance request counts were not recorded." in report
    for png in (run / "charts").iterdir():
        assert_png(png)
    assert len(list((run / "charts").iterdir())) == 6


def test_no_modes_at_all(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    report = build_report(run).read_text()
    assert "No mode was run" in report
    for png in (run / "charts").iterdir():
        assert_png(png)


def test_cold_start_never_served_and_per_restart_window(tmp_path: Path) -> None:
    run = tmp_path / "run"
    records = [
        Record(
            0, 0.5, "m", "chat", False, 1, 1, "x", status=200, total=0.1, instance="x", proper=True
        ),
        # restart at 1.0: the first ok sent after it completes at 4.0 + 0.5
        Record(1, 2.0, "m", "chat", False, 1, 1, "x", status=0, total=0.01, instance="x"),
        Record(
            2, 4.0, "m", "chat", False, 1, 1, "x", status=200, total=0.5, instance="x", proper=True
        ),
        # restart at 6.0: never served again; y restarts and is never served either
        Record(3, 7.0, "m", "chat", False, 1, 1, "x", status=0, total=0.01, instance="x"),
    ]
    evts = [Event(1.0, "restart", "x"), Event(6.0, "restart", "x"), Event(2.0, "start", "y")]
    write_mode(run, "direct", records, evts)
    report = build_report(run).read_text()
    assert row(report, "cold start x") == ["3.50 s (max of 1, 1 never served)"]
    assert row(report, "cold start y") == ["n/a (never served after 1 start/restart)"]


def test_percentiles_and_spans(tmp_path: Path) -> None:
    run = tmp_path / "run"
    records = [
        Record(i, i * 0.01, "m", "chat", False, 1, 1, "x", 200, total=(i + 1) / 1000, proper=True)
        for i in range(100)
    ]
    write_mode(run, "direct", records, None)
    mode = load_run(run).modes["direct"]
    summary = summarize(mode)
    assert summary.latency["p50"] == pytest.approx(0.0505)
    assert summary.latency["max"] == pytest.approx(0.1)
    assert summary.failure_rate == 0.0
    marks = markers(events("direct"))
    spans = {(m.action, m.target): (m.start, m.end) for m in marks}
    assert spans == {
        ("set", "b"): (5.0, 30.0),
        ("restart", "c"): (10.0, None),
        ("freeze", "a"): (20.0, 22.0),
    }
    assert bucket_step(40) == 1.0
    assert bucket_step(3600) == 10.0
    assert np.ceil(36_000 / bucket_step(36_000)) <= 600


# --- per priority class ----------------------------------------------------------------------


def class_records() -> list[Record]:
    """Hand-made: interactive 4 ok streams (sent at t=0..3), standard 1 ok + 1 shed + 1 upstream
    429 + 1 refused connection (t=0..3), batch 2 shed (t=2, 3), 1 record without a class."""

    def rec(seq: int, t: float, priority: str | None, **fields: Any) -> Record:
        base = Record(seq, t, "m", "chat", False, 10, 10, "gateway", priority=priority)
        return dataclasses.replace(base, **fields)

    ok = {"status": 200, "proper": True}
    shed = {"status": 429, "shed": True, "total": 0.001}
    return [
        *(
            rec(i, float(i), "interactive", stream=True, ttfb=t / 10, total=t, **ok)
            for i, t in enumerate((0.1, 0.2, 0.3, 0.4))
        ),
        rec(4, 0.0, "standard", total=2.0, **ok),
        rec(5, 1.0, "standard", **shed),
        rec(6, 2.0, "standard", status=429, total=0.5),
        rec(7, 3.0, "standard", error="ClientConnectorError: refused", total=0.01),
        rec(8, 2.0, "batch", **shed),
        rec(9, 3.0, "batch", **shed),
        rec(10, 1.5, None, total=1.0, **ok),
    ]


def test_per_class_summary_figures() -> None:
    summary = per_class_summary(class_records())
    assert list(summary) == ["interactive", "standard", "batch", NO_CLASS]
    interactive, standard, batch, none = summary.values()
    i = interactive
    assert (i.count, i.ok, i.shed, i.status_429) == (4, 4, 0, 0)
    assert interactive.ok_percent == 100.0
    # Histogram quantiles: within 1 % of the exact rank's value (capped at the maximum).
    assert interactive.p50_s == pytest.approx(0.2, rel=0.011)
    assert interactive.p99_s == pytest.approx(0.4)
    assert interactive.ttfb_p99_s == pytest.approx(0.04)
    assert (standard.count, standard.ok, standard.shed, standard.status_429) == (4, 1, 1, 2)
    assert standard.ok_percent == 25.0
    assert standard.p50_s == standard.p99_s == pytest.approx(2.0)
    assert standard.ttfb_p99_s is None  # no ok stream
    assert (batch.count, batch.ok, batch.shed, batch.status_429, batch.p99_s) == (2, 0, 2, 2, None)
    assert (none.count, none.ok, none.priority) == (1, 1, NO_CLASS)


def test_per_class_summary_time_window() -> None:
    window = per_class_summary(class_records(), since=2.0, until=3.0)  # sent in [2, 3)
    assert {k: v.count for k, v in window.items()} == {"interactive": 1, "standard": 1, "batch": 1}
    assert window["interactive"].p50_s == pytest.approx(0.3)
    assert window["standard"].status_429 == 1 and window["standard"].shed == 0
    assert per_class_summary(class_records(), since=3.5) == {}
    early = per_class_summary(class_records(), until=1.0)
    assert {k: v.count for k, v in early.items()} == {"interactive": 1, "standard": 1}


def test_old_ledger_lines_without_priority_still_parse(tmp_path: Path) -> None:
    old = {
        "seq": 0, "t": 0.5, "model": "m", "kind": "chat", "stream": False, "prompt_tokens": 1,
        "max_tokens": 1, "target": "x", "status": 200, "error": None, "ttfb": 0.1, "total": 0.2,
        "bytes": 10, "chunks": 0, "attempts": None, "instance": "x", "proper": True,
        "error_event": False, "oom": False, "lag": 0.0,
    }  # fmt: skip
    rec = Record.from_json(json.dumps(old))
    assert (rec.priority, rec.shed, rec.ok) == (None, False, True)
    new = dataclasses.replace(rec, seq=1, priority="batch", status=429, shed=True, proper=False)
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps(old) + "\n" + new.to_json() + "\n")
    first, second = read_records(path)
    assert first == rec and second == new
    summary = per_class_summary([first, second])
    assert {k: (v.count, v.shed) for k, v in summary.items()} == {"batch": (1, 1), NO_CLASS: (1, 0)}
    # The chart report reads such a ledger as before.
    write_mode(tmp_path / "run", "direct", [first, second], None)
    assert load_run(tmp_path / "run").modes["direct"].count == 2
