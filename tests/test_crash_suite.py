"""The crash-test suite (`loadtests.crash_suite`) in a form for CI: the same faults, each
behind a pool with a fallback, through the official `openai` SDK, with the slow faults
lasting seconds (and the faulty pools' `timeouts.initial` at 2 s, so that a hang is given up
on in seconds rather than after the default 30 s). Every scenario is rescued cleanly: the
client gets a complete, well-formed answer, from the faulty pool or its fallback, and no
faulty instance is asked more than a handful of times for one request."""

from __future__ import annotations

import pytest

from loadtests import crash_suite
from loadtests.fault_server import Timing


@pytest.fixture(scope="module")
def verdicts() -> list[crash_suite.Verdict]:
    timing = Timing(slow_s=4.0, hang_s=30.0, drip_s=0.5)
    with crash_suite.running(timing, "timeouts: {initial: 2s}") as setup:
        return crash_suite.run(setup, rounds=1, cutoff_s=60.0)


def test_every_scenario_runs(verdicts: list[crash_suite.Verdict]) -> None:
    assert [v.scenario for v in verdicts] == [s.name for s in crash_suite.SCENARIOS]
    assert all(len(v.results) == 2 for v in verdicts)  # one streamed, one whole


@pytest.mark.parametrize("scenario", [s.name for s in crash_suite.SCENARIOS])
def test_scenario_is_rescued_cleanly(verdicts: list[crash_suite.Verdict], scenario: str) -> None:
    (verdict,) = [v for v in verdicts if v.scenario == scenario]
    assert verdict.outcome == "rescued", crash_suite.table([verdict])
    assert all(r.hits <= crash_suite.HAMMER_LIMIT for r in verdict.results)
    assert verdict.trailing_hits == 0


def test_faults_a_pool_cannot_answer_are_answered_by_its_fallback(
    verdicts: list[crash_suite.Verdict],
) -> None:
    # Those whose every attempt fails before an answer starts: the fallback answered, not a
    # relayed failure dressed as a success.
    handed_over = {"refused", "closed", "hang", "500", "bad-json", "empty", "html", "bad-sse"}
    handed_over |= {"drip", "context-400", "429", "429-retry-after", "503-retry-after"}
    for verdict in verdicts:
        if verdict.scenario in handed_over:
            assert {r.pool for r in verdict.results} == {"healthy"}, verdict.scenario
