"""The propagation benchmark runs end to end, small, in both modes, and records every figure.

Behaviour only: both modes are measured, no round times out, and every delay is a sane number
(not negative: no replica follows a change before it is made; within the round's own timeout);
nothing about how fast propagation must be, which depends on how busy the machine is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests.bench_propagation import main

TTL_S = 1.0


def delays_ms(result: dict[str, Any], change: str) -> list[float]:
    """Every delay the mode recorded for one change: per round and per replica."""
    values: list[float] = []
    for record in result["rounds"]:
        spread = record[change]
        values.extend(spread["delays_ms"].values())
        if spread["every_ms"] is not None:
            values.append(spread["every_ms"])
    return values


CLOCK_SLACK_MS = 1.0


def test_small_run_in_both_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "propagation.json"
    argv = ["--replicas", "3", "--rounds", "3", "--ttl", str(TTL_S), "--json", str(out)]
    assert main([*argv, "--mode", "both"]) == 0
    report = capsys.readouterr().out
    data: dict[str, Any] = json.loads(out.read_text())

    assert set(data["modes"]) == {"pubsub", "backstop"}
    round_timeout_ms = data["meta"]["round_timeout_s"] * 1000.0  # a complete round is within it
    for mode, result in data["modes"].items():
        assert result["pubsub"] == (mode == "pubsub")
        assert result["rounds_run"] == 3
        assert result["notes"] == []
        for change in ("isolate", "restore"):
            summary = result[change]
            assert summary["timeouts"] == 0, (mode, change, result["rounds"])
            assert summary["every_replica"]["count"] == 3
            assert summary["each_replica"]["count"] == 3 * 2  # the origin is not counted
            values = delays_ms(result, change)
            assert values
            # Each replica's change time is rebuilt from its wall clock and its event loop's
            # clock (`state_since` in /admin/state), which the loop reads once per iteration:
            # two replicas' times can be off by a fraction of a millisecond either way, so a
            # replica that followed within that looks a hair early. Anything else is wrong.
            insane = [value for value in values if not -CLOCK_SLACK_MS <= value <= round_timeout_ms]
            assert not insane, (mode, change, insane, result["rounds"])
        assert f"| {mode} | isolate | 3 | 0 |" in report
        assert f"| {mode} | restore | 3 | 0 |" in report
    assert "Targets:" in report
