"""Chaos scenarios on real engines: the scenario model accepts an engine backend and refuses what
only the fake backend can do, and a small run of `real-engine` on the tiny model (llama.cpp's
server, restarted on its port after a kill) leaves the ledgers and the report in both modes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from loadtests.chaos.scenario import BackendSpec, EngineBackendSpec, Scenario, load_scenario
from loadtests.ledger import read_events, read_records
from loadtests.matrix.resize import resize
from tests.chaos_cli import run_chaos
from tests.engine import engine_model

ROOT = Path(__file__).resolve().parent.parent
ENGINE = {"engine": "llama.cpp", "preset": "slow", "slots": 4}
# The run's own bound. pytest's per-test timeout is set well above it (the model file may be
# written first), so a run that hangs is stopped by its bound, with its output.
RUN_TIMEOUT_S = 300


def engine_scenario(**extra: Any) -> dict[str, Any]:
    return {"name": "x", "backend": ENGINE, "pools": {"llama": {"models": ["m"]}}, **extra}


def run_tiny(name: str, requests: int, tmp_path: Path) -> Path:
    """Run the shipped scenario `name` in both modes on the tiny model at 10 requests a
    second; the run's folder."""
    data = yaml.safe_load((ROOT / f"loadtests/scenarios/{name}.yaml").read_text())
    data["backend"]["preset"] = "tiny"
    data["rate"] = 10
    path = tmp_path / f"{name}-tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return run_chaos(path, requests, tmp_path / "run", RUN_TIMEOUT_S)


def test_real_engine_scenario_loads_with_an_engine_backend() -> None:
    scenario = load_scenario("real-engine")
    assert scenario.engine == EngineBackendSpec(engine="llama.cpp", preset="slow", slots=4)
    assert scenario.workload.long_prompt_share > 0
    assert {step.action for step in scenario.faults} <= {"kill", "stop", "start", "restart"}
    # Fake scenarios keep their backend, with or without a `backend:` section.
    assert isinstance(load_scenario("baseline").backend, BackendSpec)
    assert Scenario.model_validate({"name": "x", "pools": {"p": {"models": ["m"]}}}).engine is None


@pytest.mark.parametrize("size", [1, 2, 3])
def test_real_engine_scenario_resizes(size: int) -> None:
    resized = resize(load_scenario("real-engine"), size).scenario
    assert resized.engine is not None
    assert resized.instance_names() == [f"llama-{i}" for i in range(size)]
    assert len(resized.faults) == 1


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"action": "set", "set": {"error_rate": 0.5}}, "no fault knobs"),
        ({"action": "set", "set": {"error_rate": 0.5}, "for": "10%"}, "`set`/`clear`"),
        ({"action": "clear"}, "no fault knobs"),
        ({"action": "restart", "set": {"error_rate": 0.5}}, "no fault knobs"),
    ],
)
def test_knob_steps_are_refused_on_an_engine(fault: dict[str, Any], message: str) -> None:
    step = {"target": "llama-0", "at": "10%", **fault}
    with pytest.raises(ValidationError, match=message):
        Scenario.model_validate(engine_scenario(faults=[step]))


def test_process_and_network_steps_are_accepted_on_an_engine() -> None:
    steps = [
        {"target": "llama-0", "action": action, "at": "10%"}
        for action in ("kill", "stop", "start", "restart", "freeze", "thaw")
    ]
    steps.append(
        {"target": "llama-1", "action": "network", "at": "10%", "network": {"latency": 0.05}}
    )
    assert len(Scenario.model_validate(engine_scenario(faults=steps)).faults) == 7


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ({**ENGINE, "ttft": "50ms"}, "ttft: knob\\(s\\) of the fake backend"),
        ({**ENGINE, "per_token": 0.001, "tokens_per_event": 4}, "per_token, tokens_per_event"),
        ({**ENGINE, "preset": "huge"}, "unknown engine preset"),
        ({**ENGINE, "engine": "vllm"}, "llama.cpp"),
        ({**ENGINE, "slots": 0}, "slots"),
    ],
)
def test_bad_engine_backends_are_refused(backend: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Scenario.model_validate(engine_scenario(backend=backend))


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_real_engine_short_run_on_the_tiny_model(tmp_path: Path) -> None:
    """Both modes on two tiny engines, one killed and started again on its port."""
    engine_model("tiny")  # written once, before the run (and a missing engine fails here)
    run_dir = run_tiny("real-engine", 20, tmp_path)
    for mode in ("direct", "gateway"):
        records = list(read_records(run_dir / mode / "ledger.jsonl"))
        assert sorted(r.seq for r in records) == list(range(20))  # each request exactly once
        assert any(r.ok for r in records), mode
        assert [(e.action, e.target) for e in read_events(run_dir / mode / "events.jsonl")] == [
            ("kill", "llama-1"),
            ("start", "llama-1"),
        ]
        meta = json.loads((run_dir / mode / "meta.json").read_text())
        assert meta["requests_sent"] == 20 and not meta["timeline_errors"], meta
        assert meta["engine"] == {"engine": "llama.cpp", "preset": "tiny", "slots": 4, "nice": {}}
        assert "time_compression" not in meta
        assert len(meta["instances"]["llama-1"]["starts"]) == 2
        # Each start of an engine has its own log; the second one served on the same port.
        assert (run_dir / mode / "llama-1-2.llama-server.log").exists()
    gateway_meta = json.loads((run_dir / "gateway" / "meta.json").read_text())
    assert sum(gateway_meta["gateway_counters"]["requests_per_instance"].values()) > 0
    report = (run_dir / "report.md").read_text()
    for section in ("## Summary", "## Per instance", "## Fault timeline"):
        assert section in report


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_real_engine_chaos_short_run_on_the_tiny_model(tmp_path: Path) -> None:
    """`real-engine-chaos` on three tiny engines: one frozen then thawed, one killed then
    started again, one at a lower CPU priority; both modes end every request once."""
    engine_model("tiny")
    scenario = load_scenario("real-engine-chaos")
    assert scenario.engine is not None and scenario.engine.nice == {"llama-2": 10}
    run_dir = run_tiny("real-engine-chaos", 30, tmp_path)
    for mode in ("direct", "gateway"):
        records = list(read_records(run_dir / mode / "ledger.jsonl"))
        assert sorted(r.seq for r in records) == list(range(30))
        assert any(r.ok for r in records), mode
        assert sorted(
            (e.action, e.target) for e in read_events(run_dir / mode / "events.jsonl")
        ) == [
            ("freeze", "llama-0"),
            ("kill", "llama-1"),
            ("start", "llama-1"),
            ("thaw", "llama-0"),
        ]
        meta = json.loads((run_dir / mode / "meta.json").read_text())
        assert meta["engine"]["nice"] == {"llama-2": 10}
    gateway = list(read_records(run_dir / "gateway" / "ledger.jsonl"))
    # Nothing the gateway relays is cut short: a failure, if any, is a proper error answer.
    assert not [r for r in gateway if r.status == 200 and not r.proper]
    report = (run_dir / "report.md").read_text()
    assert "failures per 100k" in report and "niceness 10" in report
