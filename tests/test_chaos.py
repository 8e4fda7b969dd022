"""Chaos scenarios: every shipped one is valid, and a 2,000-request run of chaos-mix produces the
ledgers and the report, both ways (no thresholds: the numbers are what the report is for)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from loadtests.chaos.scenario import SCENARIO_DIR, Scenario, load_scenario
from loadtests.ledger import read_events, read_records

SHIPPED = sorted(SCENARIO_DIR.glob("*.yaml"))
REQUIRED = {
    "baseline",
    "gray-failure",
    "flapping",
    "oom-storm",
    "hung-instance",
    "rolling-restart",
    "cold-start",
    "chaos-mix",
}
ROOT = Path(__file__).resolve().parent.parent


def test_every_required_scenario_ships() -> None:
    assert {path.stem for path in SHIPPED} >= REQUIRED


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_scenario_is_valid(path: Path) -> None:
    scenario = load_scenario(str(path))
    assert scenario.name == path.stem
    planned = scenario.planned_s(scenario.requests, scenario.rate)
    for step in scenario.faults:
        at = step.when().resolve(planned)
        assert at is None or 0 <= at <= planned


def test_fault_times_scale_with_the_run() -> None:
    scenario = load_scenario("flapping")
    first = scenario.faults[0]
    assert first.when().resolve(planned_s=10.0) == pytest.approx(1.0)  # at: 10%
    assert first.when().resolve(planned_s=500.0) == pytest.approx(50.0)
    duration = first.duration()
    assert duration is not None and duration.resolve(500.0) == pytest.approx(40.0)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"target": "nope-0", "action": "kill", "at": "1s"}, "not an instance"),
        ({"target": "chat-0", "action": "kill"}, "exactly one of"),
        ({"target": "chat-0", "action": "set", "at": "1s"}, "needs a `set:`"),
        ({"target": "chat-0", "action": "thaw", "at": "1s", "for": "1s"}, "cannot revert"),
        ({"target": "chat-0", "action": "explode", "at": "1s"}, "action"),
    ],
)
def test_bad_fault_steps_are_rejected(fault: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Scenario.model_validate(
            {"name": "x", "pools": {"chat": {"models": ["m"]}}, "faults": [fault]}
        )


def test_chaos_mix_smoke_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtests.chaos",
            "chaos-mix",
            "--requests",
            "2000",
            "--out",
            str(run_dir),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for mode in ("direct", "gateway"):
        records = list(read_records(run_dir / mode / "ledger.jsonl"))
        assert sorted(r.seq for r in records) == list(range(2000))  # each request exactly once
        assert {r.model for r in records} == {"llama-3.1-8b", "qwen3-8b"}
        events = read_events(run_dir / mode / "events.jsonl")
        assert {e.action for e in events} >= {"set", "unset", "freeze", "thaw", "kill", "start"}
        meta = json.loads((run_dir / mode / "meta.json").read_text())
        assert meta["requests_sent"] == 2000 and not meta["timeline_errors"]
    gateway_meta = json.loads((run_dir / "gateway" / "meta.json").read_text())
    assert sum(gateway_meta["gateway_counters"]["requests_per_instance"].values()) > 0
    report = (run_dir / "report.md").read_text()
    for section in ("## Summary", "## Per model", "## Per instance", "## Fault timeline"):
        assert section in report
    charts = sorted(p.name for p in (run_dir / "charts").glob("*.png"))
    assert {"latency_compare.png", "share_gateway.png", "latency_direct.png"} <= set(charts)
