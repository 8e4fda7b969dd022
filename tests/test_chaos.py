"""Chaos scenarios: every shipped one is valid, fault steps on the `redis` target act on a real
Redis, and a 2,000-request run of chaos-mix produces the ledgers and the report, both ways (no
thresholds: the numbers are what the report is for)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from pydantic import ValidationError
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.config.models import Policy
from loadtests.chaos import cluster as cluster_module
from loadtests.chaos.cluster import Cluster
from loadtests.chaos.scenario import SCENARIO_DIR, Scenario, load_scenario
from loadtests.chaos.timeline import STOP_BOUND_S, Timeline
from loadtests.ledger import JsonlWriter, read_events, read_records
from tests.chaos_cli import run_chaos

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
    "redis-outage",
}
ROOT = Path(__file__).resolve().parent.parent
# The runs' own bounds. pytest's per-test timeout is set well above each, so a run that hangs
# is stopped by its bound, with its output, before pytest gives up.
CHAOS_MIX_TIMEOUT_S = 600
ANTHROPIC_MIX_TIMEOUT_S = 120


def shorter(name: str, tmp_path: Path) -> str:
    """A shipped scenario with its pools, faults and fault timeline as shipped, but answers of at
    most 512 tokens and clients that wait 10 s: the run's length is then its sending time, not a
    tail of 4,000-token answers slowed five times and of hung requests waiting out 30 s."""
    spec = yaml.safe_load((SCENARIO_DIR / f"{name}.yaml").read_text())
    shorter_answers = {"max_tokens": [32, 512], "client_timeout": "10s"}
    spec["workload"] = {**spec.get("workload", {}), **shorter_answers}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


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
        ({"target": "redis", "action": "set", "at": "1s", "set": {"error_rate": 1}}, "redis"),
        ({"target": "redis", "action": "clear", "at": "1s"}, "does not apply to target `redis`"),
        (
            {"target": "redis", "action": "network", "at": "1s", "network": {"latency": 1}},
            "does not apply to target `redis`",
        ),
        ({"target": "chat-0", "action": "pause", "at": "1s", "for": "2s"}, "`redis` only"),
        ({"target": "redis", "action": "pause", "at": "1s"}, "needs `for:`"),
        ({"target": "redis", "action": "pause", "at": "1s", "for": "0s"}, "positive"),
    ],
)
def test_bad_fault_steps_are_rejected(fault: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Scenario.model_validate(
            {"name": "x", "pools": {"chat": {"models": ["m"]}}, "faults": [fault]}
        )


def test_redis_steps_and_shared_are_accepted() -> None:
    base = {"name": "x", "pools": {"chat": {"models": ["m"]}}}
    assert not Scenario.model_validate(base).uses_redis()
    assert Scenario.model_validate({**base, "shared": True}).uses_redis()
    steps = [
        {"target": "redis", "action": "kill", "at": "1s", "for": "10%"},
        {"target": "redis", "action": "stop", "at": "1s", "for": "1s"},
        {"target": "redis", "action": "freeze", "at": "1s", "for": "1s"},
        {"target": "redis", "action": "thaw", "at": "2s"},
        {"target": "redis", "action": "restart", "at": "2s"},
        {"target": "redis", "action": "start", "at": "2s"},
        {"target": "redis", "action": "pause", "at_request": 10, "for": "2s"},
    ]
    scenario = Scenario.model_validate({**base, "faults": steps})
    assert scenario.uses_redis() and not scenario.shared


def test_redis_outage_faults_redis_while_an_instance_fails() -> None:
    scenario = load_scenario("redis-outage")
    assert scenario.uses_redis()
    redis_steps = [step for step in scenario.faults if step.target == "redis"]
    assert [step.action for step in redis_steps] == ["kill", "freeze", "pause"]
    assert all(step.duration() is not None for step in redis_steps)
    assert any(step.action == "set" and step.target != "redis" for step in scenario.faults)


class _NoRequests:
    def wait_sent(self, count: int) -> Awaitable[None]:  # pragma: no cover - time triggers only
        raise AssertionError("no request-number trigger in this test")


def _redis_answers(cluster: Cluster, timeout_s: float = 0.5) -> bool:
    assert cluster.redis is not None
    client = redis.Redis(
        host="127.0.0.1",
        port=cluster.redis.port,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),  # one try: a retry could outlast the fault
    )
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


async def test_timeline_plays_redis_faults_on_a_real_redis(tmp_path: Path) -> None:
    """Kill (back after `for:`), freeze/thaw and pause on the cluster's Redis, each logged; the
    gateway's policy points its shared state at that Redis, and closing stops it."""
    scenario = Scenario.model_validate(
        {
            "name": "x",
            "pools": {"chat": {"models": ["m"], "instances": 1}},
            "faults": [
                {"target": "redis", "action": "kill", "at": "0s", "for": "0.6s"},
                {"target": "redis", "action": "freeze", "at": "1s", "for": "0.6s"},
                {"target": "redis", "action": "pause", "at": "2s", "for": "0.3s"},
            ],
        }
    )
    cluster = Cluster(scenario, tmp_path)
    events = JsonlWriter(tmp_path / "events.jsonl", flush_every=1)
    try:
        await asyncio.to_thread(cluster.start_all)
        assert cluster.redis is not None and _redis_answers(cluster)
        port = cluster.redis.port
        policy = Policy.model_validate(cluster.gateway_policy())
        assert policy.shared is not None and policy.shared.key_prefix == "chaos"
        assert str(policy.shared.redis_url).endswith(f":{port}/0")
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeline = Timeline(
            cluster,
            scenario.faults,
            planned_s=3.0,
            clock=lambda: loop.time() - started,
            events=events,
        )

        async def answers_at(t: float) -> bool:
            await asyncio.sleep(t - (loop.time() - started))
            return await asyncio.to_thread(_redis_answers, cluster, 0.1)

        _, while_killed, while_frozen, while_paused, after = await asyncio.wait_for(
            asyncio.gather(
                timeline.run(_NoRequests()),
                answers_at(0.3),
                answers_at(1.3),
                answers_at(2.05),
                answers_at(2.6),
            ),
            timeout=30,
        )
        assert not timeline.errors
        assert (while_killed, while_frozen, while_paused, after) == (False, False, False, True)
        assert cluster.redis.port == port and _redis_answers(cluster)
        assert len(cluster.redis_starts) == 2  # at start, and again after the kill
    finally:
        events.close()
        await cluster.close()
    assert not cluster.redis_running
    logged = [(e.action, e.target) for e in read_events(tmp_path / "events.jsonl")]
    assert logged == [
        ("kill", "redis"),
        ("start", "redis"),
        ("freeze", "redis"),
        ("thaw", "redis"),
        ("pause", "redis"),
    ]


@pytest.mark.timeout(CHAOS_MIX_TIMEOUT_S + 120)
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
        timeout=CHAOS_MIX_TIMEOUT_S,
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


def test_anthropic_pool_declares_its_models() -> None:
    scenario = load_scenario("anthropic-mix")
    assert scenario.anthropic_models() == ("claude-sonnet-4",)
    assert {p.protocol for p in scenario.pools.values()} == {"openai", "anthropic"}
    knobs = {key for step in scenario.faults for key in step.set}
    assert {"overloaded_rate", "stream_error_rate"} <= knobs
    with pytest.raises(ValidationError, match="protocol"):
        Scenario.model_validate(
            {"name": "x", "pools": {"chat": {"models": ["m"], "protocol": "grpc"}}}
        )


@pytest.mark.timeout(ANTHROPIC_MIX_TIMEOUT_S + 60)
def test_anthropic_mix_short_run(tmp_path: Path) -> None:
    """Both pools side by side, the Anthropic one called with /v1/messages in both modes."""
    run_dir = run_chaos(
        shorter("anthropic-mix", tmp_path), 600, tmp_path / "run", ANTHROPIC_MIX_TIMEOUT_S
    )
    for mode in ("direct", "gateway"):
        records = list(read_records(run_dir / mode / "ledger.jsonl"))
        assert sorted(r.seq for r in records) == list(range(600))
        kinds = {r.model: set() for r in records}
        for r in records:
            kinds[r.model].add(r.kind)
        assert kinds["claude-sonnet-4"] == {"messages"}
        assert kinds["llama-3.1-8b"] <= {"chat", "completions"}
        assert any(r.ok for r in records if r.model == "claude-sonnet-4"), mode
        meta = json.loads((run_dir / mode / "meta.json").read_text())
        assert not meta["timeline_errors"]
    report = (run_dir / "report.md").read_text()
    section = report.split("## Per model", 1)[1].split("\n## ", 1)[0]
    assert "`llama-3.1-8b`" in section
    assert "`claude-sonnet-4` (Messages API)" in section


async def test_a_restart_cut_short_by_the_end_of_the_run_leaves_no_process(
    tmp_path: Path,
) -> None:
    """The run ends (the timeline is cancelled) while an instance is being started again: the
    process that start brings up is recorded and stopped by `close`, not left running."""
    scenario = Scenario.model_validate(
        {"name": "x", "pools": {"chat": {"models": ["m"], "instances": 1}}}
    )
    cluster = Cluster(scenario, tmp_path)
    try:
        await asyncio.to_thread(cluster.start_all)
        inst = cluster.instances["chat-0"]
        first = inst.popen
        await cluster.stop("chat-0", kill=True)
        restart = asyncio.create_task(cluster.start("chat-0", 1.0))
        await asyncio.sleep(0.05)  # the start is under way in its thread
        restart.cancel()
        with pytest.raises(asyncio.CancelledError):
            await restart
    finally:
        await cluster.close()
    second = inst.popen
    assert second is not None and second is not first
    assert second.poll() is not None


@pytest.mark.parametrize(("action", "back"), [("kill", 1.0), ("stop", 1.0 + STOP_BOUND_S)])
async def test_a_killed_fake_instance_is_booted_ahead_and_serves_again_at_the_end_of_for(
    tmp_path: Path, action: str, back: float
) -> None:
    """A kill with `for:` brings a fake backend back when the step says, not when a new
    interpreter has finished starting: the replacement boots ahead, with its port closed
    until the end of the step, and serves from then on."""
    scenario = Scenario.model_validate(
        {
            "name": "x",
            "pools": {"chat": {"models": ["m"], "instances": 1}},
            "faults": [{"target": "chat-0", "action": action, "at": "0s", "for": "1s"}],
        }
    )
    cluster = Cluster(scenario, tmp_path)
    events = JsonlWriter(tmp_path / "events.jsonl", flush_every=1)
    try:
        await asyncio.to_thread(cluster.start_all)
        inst = cluster.instances["chat-0"]
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeline = Timeline(
            cluster,
            scenario.faults,
            planned_s=10.0,
            clock=lambda: loop.time() - started,
            events=events,
        )

        async def serves_at(t: float) -> bool:
            await asyncio.sleep(t - (loop.time() - started))
            try:
                async with httpx.AsyncClient(timeout=0.5) as client:
                    return (await client.get(f"{inst.backend_url}/health")).status_code == 200
            except httpx.TransportError:
                return False

        _, during = await asyncio.wait_for(
            asyncio.gather(timeline.run(_NoRequests()), serves_at(0.6)), timeout=30
        )
        assert not timeline.errors
        assert during is False
        assert await serves_at(0.0)
        assert inst.popen is not None and "--serve-when" in inst.popen.args
        restarted_at = inst.starts[-1]
    finally:
        events.close()
        await cluster.close()
    logged = list(read_events(tmp_path / "events.jsonl"))
    assert [(e.action, e.target) for e in logged] == [(action, "chat-0"), ("start", "chat-0")]
    # Planned from when the step was carried out (a busy machine may do that a little after
    # 0 s): its `until`, plus a stop's bound on its graceful shutdown.
    until = logged[0].detail["until"]
    assert restarted_at == pytest.approx(until + (back - 1.0))
    assert logged[1].t >= until + (back - 1.0)
    assert not inst.running


async def test_a_kill_longer_than_a_start_may_take_still_brings_the_instance_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replacement of a killed fake backend announces itself only once it serves, at the
    end of the kill: a kill longer than the wait for a start (a long run's 8 % is 40 s) must not
    count as a start that failed."""
    monkeypatch.setattr(cluster_module, "READY_S", 2.0)
    scenario = Scenario.model_validate(
        {
            "name": "x",
            "pools": {"chat": {"models": ["m"], "instances": 1}},
            "faults": [{"target": "chat-0", "action": "kill", "at": "0s", "for": "4s"}],
        }
    )
    cluster = Cluster(scenario, tmp_path)
    events = JsonlWriter(tmp_path / "events.jsonl", flush_every=1)
    try:
        await asyncio.to_thread(cluster.start_all)
        timeline = _timeline_from_now(cluster, scenario, events, planned_s=10.0)
        await asyncio.wait_for(timeline.run(_NoRequests()), timeout=30)
        assert not timeline.errors
        assert cluster.instances["chat-0"].running
    finally:
        events.close()
        await cluster.close()
    logged = list(read_events(tmp_path / "events.jsonl"))
    assert [e.action for e in logged] == ["kill", "start"]


def _timeline_from_now(
    cluster: Cluster, scenario: Scenario, events: JsonlWriter, planned_s: float
) -> Timeline:
    """The scenario's fault timeline on `cluster`, its clock starting now."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    return Timeline(
        cluster,
        scenario.faults,
        planned_s=planned_s,
        clock=lambda: loop.time() - started,
        events=events,
    )
