"""The fault matrix: the resize rule on its own, and a tiny matrix run end to end (two scenarios,
pools of 1 and 2, a few requests) that must write the table, the JSON and the chart with every
cell and column; the figures themselves are what the matrix reports, not what this asserts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from loadtests.chaos.scenario import SCENARIO_DIR, Scenario, load_scenario
from loadtests.matrix.__main__ import main
from loadtests.matrix.render import HEADERS
from loadtests.matrix.resize import Window, resize, windows
from loadtests.matrix.selection import RATE, REQUESTS, select

SHIPPED = sorted(SCENARIO_DIR.glob("*.yaml"))


def _scenario(faults: list[dict[str, Any]], instances: int = 3) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "x",
            "rate": 10,
            "requests": 1000,  # a 100 s run: `at: 10%` is 10 s
            "pools": {"chat": {"models": ["m"], "instances": instances}},
            "faults": faults,
        }
    )


def _placed(scenario: Scenario) -> list[tuple[str, str]]:
    return [(step.target, step.action) for step in scenario.faults]


def test_steps_of_existing_instances_and_redis_stay() -> None:
    scenario = _scenario(
        [
            {"at": "10%", "target": "chat-0", "action": "kill", "for": "10%"},
            {"at": "10%", "target": "redis", "action": "kill", "for": "10%"},
        ]
    )
    for size in (1, 2, 3, 4):
        resized = resize(scenario, size)
        assert _placed(resized.scenario) == [("chat-0", "kill"), ("redis", "kill")]
        assert resized.scenario.pools["chat"].instances == size
        assert not resized.moved and not resized.dropped


def test_a_missing_instance_moves_to_i_mod_n_when_nothing_clashes() -> None:
    def spell(target: str, at: str) -> dict[str, Any]:
        return {"at": at, "for": "10%", "target": target, "action": "set", "set": {"error_rate": 1}}

    scenario = _scenario([spell("chat-0", "10%"), spell("chat-1", "40%"), spell("chat-2", "70%")])
    two = resize(scenario, 2)
    assert _placed(two.scenario) == [("chat-0", "set"), ("chat-1", "set"), ("chat-0", "set")]
    assert two.moved == {"chat-2": "chat-0"} and not two.dropped
    one = resize(scenario, 1)
    assert {step.target for step in one.scenario.faults} == {"chat-0"}
    assert one.moved == {"chat-1": "chat-0", "chat-2": "chat-0"}


def test_restart_stories_never_share_an_instance() -> None:
    scenario = _scenario(
        [
            {"at": "10%", "target": "chat-0", "action": "stop", "for": "10%"},
            {"at": "40%", "target": "chat-1", "action": "stop", "for": "10%"},
            {"at": "70%", "target": "chat-2", "action": "stop", "for": "10%"},
        ]
    )
    # Far apart in time, but a stop drains and a start takes its time: a rolling restart of a
    # pool of one restarts its one instance once.
    assert resize(scenario, 1).dropped == {"chat-1": 1, "chat-2": 1}
    assert resize(scenario, 2).dropped == {"chat-2": 1}


@pytest.mark.parametrize(("at", "fits"), [("22s", False), ("27s", True)])
def test_a_set_keeps_clear_of_a_process_action_and_its_settling(at: str, fits: bool) -> None:
    # The kill of chat-0 is planned for 10-20 s; a set of another story starting at 22 s could
    # meet the instance still starting again (SETTLE_S = 5 s after the window), at 27 s not.
    scenario = _scenario(
        [
            {"at": "10s", "for": "10s", "target": "chat-0", "action": "kill"},
            {"at": at, "for": "5s", "target": "chat-1", "action": "set", "set": {"oom_rate": 1}},
        ]
    )
    resized = resize(scenario, 1)
    assert (resized.moved == {"chat-1": "chat-0"}) is fits
    assert (resized.dropped == {"chat-1": 1}) is not fits


def test_a_clash_tries_the_next_instance_then_drops_the_whole_story() -> None:
    scenario = _scenario(
        [
            # chat-0 is frozen from 10 % to the end; chat-1 has an error knob all along.
            {"at": "10%", "target": "chat-0", "action": "freeze"},
            {"at": "0s", "target": "chat-1", "action": "set", "set": {"error_rate": 0.3}},
            # chat-2: a kill, then an OOM spell: one story, moved or dropped together.
            {"at": "20%", "target": "chat-2", "action": "kill", "for": "10%"},
            {"at": "50%", "target": "chat-2", "action": "set", "set": {"oom_rate": 0.5}},
        ]
    )
    # Pool of 2: chat-2 -> chat-0 clashes (a kill on a frozen process), chat-1 clashes too (a
    # kill drops the error knob): dropped, both steps.
    two = resize(scenario, 2)
    assert two.dropped == {"chat-2": 2} and not two.moved
    assert _placed(two.scenario) == [("chat-0", "freeze"), ("chat-1", "set")]


def test_set_steps_clash_only_on_a_shared_knob() -> None:
    scenario = _scenario(
        [
            {"at": "0s", "target": "chat-0", "action": "set", "set": {"oom_rate": 0.5}},
            {"at": "0s", "target": "chat-1", "action": "set", "set": {"error_rate": 0.2}},
            {"at": "0s", "target": "chat-2", "action": "set", "set": {"oom_rate": 0.1}},
        ]
    )
    one = resize(scenario, 1)
    assert one.moved == {"chat-1": "chat-0"} and one.dropped == {"chat-2": 1}
    assert {k for step in one.scenario.faults for k in step.set} == {"oom_rate", "error_rate"}
    assert one.notes() == "chat-1 → chat-0; chat-2 dropped (1 step)"


def test_network_steps_clash_only_with_network_steps() -> None:
    scenario = _scenario(
        [
            {"at": "0s", "target": "chat-0", "action": "freeze", "for": "50%"},
            {"at": "0s", "target": "chat-1", "action": "network", "network": {"latency": 0.1}},
            {"at": "0s", "target": "chat-2", "action": "network", "network": {"latency": 0.2}},
        ]
    )
    one = resize(scenario, 1)
    assert one.moved == {"chat-1": "chat-0"} and one.dropped == {"chat-2": 1}


def test_a_step_without_for_lasts_until_the_next_on_its_instance() -> None:
    scenario = _scenario(
        [
            {"at": "0s", "target": "chat-2", "action": "stop"},
            {"at": "20%", "target": "chat-2", "action": "start", "set": {"slow_factor": 10}},
            {"at": "45%", "target": "chat-2", "action": "clear"},
            {"at": "10%", "target": "chat-0", "action": "kill", "for": "5%"},
        ]
    )
    assert windows(scenario) == [
        Window(0.0, 20.0),
        Window(20.0, 45.0),
        Window(45.0, math.inf),
        Window(10.0, 15.0),
    ]
    # The cold start (stop..start..clear) meets the kill at 10-15 % on chat-0: it clashes with
    # the stop, so the story cannot go there; in a pool of 2 it goes to chat-1 instead.
    assert resize(scenario, 1).dropped == {"chat-2": 3}
    assert resize(scenario, 2).moved == {"chat-2": "chat-1"}


def test_two_pools_are_resized_alike() -> None:
    resized = resize(load_scenario("chaos-mix"), 1)
    assert {p.instances for p in resized.scenario.pools.values()} == {1}
    assert {step.target for step in resized.scenario.faults} == {"llama-0", "qwen-0"}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_scenario_resizes(path: Path) -> None:
    scenario = load_scenario(str(path))
    for size in (1, 2, 3):
        resized = resize(scenario, size)
        names = set(resized.scenario.instance_names())
        assert all(s.target in names | {"redis"} for s in resized.scenario.faults)
        kept = len(resized.scenario.faults) + sum(resized.dropped.values())
        assert kept == len(scenario.faults)


def test_small_pool_scenarios_keep_their_shape() -> None:
    sidecar = load_scenario("flaky-sidecar")
    assert sidecar.pools["chat"].instances == 1 and "gateway" not in sidecar.model_fields_set
    pair = load_scenario("flaky-pair")
    assert _placed(pair) == [("chat-0", "set"), ("chat-1", "kill")]
    # In a pool of one, the killed `b` has nowhere to go beside the flaky `a`.
    assert resize(pair, 1).dropped == {"chat-1": 1}


def test_a_default_matrix_runs_every_fake_backend_scenario_at_its_own_load() -> None:
    selection = select(None, None, None)
    shipped = [load_scenario(str(path)) for path in SHIPPED]
    assert [s.name for s in selection.scenarios] == [s.name for s in shipped if s.engine is None]
    assert {(s.requests, s.rate) for s in selection.scenarios} == {(REQUESTS, RATE)}
    engines = [s.name for s in shipped if s.engine is not None]
    assert [text.split()[0] for text in selection.skipped] == engines
    for name in engines:  # named, a real-engine scenario keeps its own load unless told
        (own,) = select([name], None, None).scenarios
        assert (own.requests, own.rate) == (load_scenario(name).requests, load_scenario(name).rate)
        (told,) = select([name], 7, 0.5).scenarios
        assert (told.requests, told.rate) == (7, 0.5)


def test_quick_matrix_writes_table_json_and_chart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "matrix"
    # Two cells (each a run both ways, with its report) show the matrix's order and files; the
    # sizes' own pools are covered by the tests above.
    argv = ["--scenarios", "total-outage,flaky-sidecar", "--sizes", "1"]
    assert main([*argv, "--requests", "30", "--rate", "30", "--out", str(out)]) == 0
    cells = [("total-outage", 1), ("flaky-sidecar", 1)]

    data = json.loads((out / "matrix.json").read_text())
    assert [(c["scenario"], c["size"]) for c in data["cells"]] == cells
    for cell in data["cells"]:
        assert cell["error"] is None, cell
        assert (cell["requests"], cell["rate"]) == (30, 30)
        assert set(cell["modes"]) == {"direct", "gateway"}
        for figures in cell["modes"].values():
            assert figures["requests"] == 30
            assert 0.0 <= figures["failure_rate_pct"] <= 100.0
            assert figures["p99_s"] is not None and figures["ooms"] >= 0
            assert figures["fault_errors"] == 0  # every fault step was played
        direct, gateway = (cell["modes"][m]["failure_rate_pct"] for m in ("direct", "gateway"))
        worse = gateway > direct
        assert cell["gateway_le_direct"] is (not worse)
        assert (Path(cell["run_dir"]) / "report.md").exists()
    assert data["gateway_worse"] == [
        f"{c['scenario']}/{c['size']}" for c in data["cells"] if not c["gateway_le_direct"]
    ]

    table = (out / "matrix.md").read_text()
    header = "| " + " | ".join(HEADERS) + " |"
    assert header in table
    lines = table.splitlines()
    start = lines.index(header) + 2  # past the header and its alignment row
    rows = lines[start : start + len(cells)]
    assert not lines[start + len(cells)].strip()  # the table ends there
    assert [(r.split(" | ")[0][2:], int(r.split(" | ")[1])) for r in rows] == cells
    for line, cell in zip(rows, data["cells"], strict=True):
        columns = [c.strip() for c in line.strip("|").split("|")]
        assert len(columns) == len(HEADERS)
        assert columns[-1] == ("yes" if cell["gateway_le_direct"] else "NO")
    assert (out / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    printed = capsys.readouterr().out
    assert header in printed and data["summary"] in printed
