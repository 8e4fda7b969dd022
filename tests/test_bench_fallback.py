"""The fallback benchmark runs end to end, short, and records every figure.

Behaviour only: requests flowed, the primary answered before its outage, the backup during it,
the primary again after it, none failed, and each replica's counters were read; nothing about
how soon anything happened, which depends on how busy the machine is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests.bench_fallback import BACKUP, PRIMARY, main

RATE = 10
BEFORE_S, DOWN_S, AFTER_S = 2, 3, 6
REPLICAS = 3


@pytest.mark.timeout(180)
@pytest.mark.parametrize("health", [True, False], ids=["health", "no_health"])
def test_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], health: bool) -> None:
    """With health checks, or without (only the breakers and their probes see the primary go
    and come back): the same outcomes."""
    out = tmp_path / "fallback.json"
    argv = [
        *("--rate", str(RATE), "--before", str(BEFORE_S), "--down", str(DOWN_S)),
        *("--after", str(AFTER_S), "--replicas", str(REPLICAS)),
        *("--instances", "2", "--backup-instances", "1", "--out", str(out)),
        *(() if health else ("--no-health",)),
    ]
    assert main(argv) == 0
    report = capsys.readouterr().out
    data: dict[str, Any] = json.loads(out.read_text())

    assert data["sent"] == RATE * (BEFORE_S + DOWN_S + AFTER_S)
    assert data["failed"] == 0, (data["failures"], data["replica_output"])
    assert data["ok"] == data["sent"]
    assert sum(data["served_by"].values()) == data["ok"]

    # Who answered, by phase: the primary before its outage, the backup during it.
    phases: dict[str, dict[str, int]] = {}
    for row in data["per_second"]:
        counts = phases.setdefault(row["phase"], {PRIMARY: 0, BACKUP: 0, "sent": 0})
        for key in counts:
            counts[key] += row[key]
    assert set(phases) == {"before", "down", "after"}
    assert phases["before"][PRIMARY] > 0
    assert phases["down"][BACKUP] > 0
    assert sum(counts["sent"] for counts in phases.values()) == data["sent"]

    # The primary came back and answered again.
    timeline = data["timeline"]
    assert timeline["killed_at_s"] < timeline["restart_at_s"] <= timeline["recovered_at_s"]
    assert set(timeline["serving_at_s"]) == {"primary-0", "primary-1"}
    first_answer = data["recovery"]["first_primary_answer_s"]
    assert first_answer is not None and first_answer >= 0
    assert phases["after"][PRIMARY] > 0

    # Every replica's counters were read, before the kill and at the restart.
    outage = data["outage"]
    assert set(outage["per_replica"]) == {f"r{i}" for i in range(REPLICAS)}
    for reach in outage["per_replica"].values():
        assert reach["probes"] >= 0 and reach["attempts"] >= 0
        # What each replica handed over to the backup during the outage.
        assert reach["counters"]["gateway_fallbacks_total"] > 0
    for phase in ("before", "down"):
        assert data["latency"][phase]["total"]["count"] > 0
    assert set(data["bars"]) == {"no_failure", "back_within_3s", "probes_per_replica_s_at_most_1"}
    assert data["bars"]["no_failure"] is True

    assert "| s | phase | sent | primary | backup | failed |" in report
    assert "| replica | probes |" in report
    assert "Bars: 0 failed: met" in report
