"""Runs a scenario both ways — clients straight to the instances, and through the gateway — and
writes the run directory that `loadtests.report` turns into report.md and charts.

Each mode gets fresh instances, the same seed, the same requests and the same fault timeline.
Direct mode is what users have without the gateway: client-side round robin, no retries.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtests.chaos.cluster import Cluster
from loadtests.chaos.scenario import EngineBackendSpec, Scenario
from loadtests.chaos.timeline import Timeline
from loadtests.ledger import JsonlWriter
from loadtests.loadgen import LoadStats, Progress, Target, WorkloadSpec, run_load

MODES = ("direct", "gateway")


@dataclass(frozen=True)
class ModeResult:
    mode: str
    stats: LoadStats
    timeline_errors: list[str]


async def run_mode(scenario: Scenario, mode: str, run_dir: Path) -> ModeResult:
    out = run_dir / mode
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(scenario, out)
    ledger = JsonlWriter(out / "ledger.jsonl")
    events = JsonlWriter(out / "events.jsonl", flush_every=1)
    timeline_task: asyncio.Task[None] | None = None
    try:
        await cluster.launch_all()
        targets = _targets(scenario, cluster, mode)
        if mode == "gateway":
            gateway_url = await cluster.launch_gateway()
            gateway = [Target("gateway", gateway_url, gateway=True)]
            targets = {model: gateway for model in scenario.models()}
        workload = scenario.workload
        spec = WorkloadSpec(
            models=scenario.models(),
            chat_share=workload.chat_share,
            stream_share=workload.stream_share,
            prompt_tokens=workload.prompt_tokens,
            max_tokens=workload.max_tokens,
            seed=scenario.seed,
            anthropic_models=scenario.anthropic_models(),
            long_prompt_share=workload.long_prompt_share,
            long_prompt_tokens=workload.long_prompt_tokens,
        )
        progress = Progress()
        progress.start_clock()
        timeline = Timeline(
            cluster,
            scenario.faults,
            planned_s=scenario.planned_s(scenario.requests, scenario.rate),
            clock=progress.elapsed,
            events=events,
        )
        timeline_task = asyncio.create_task(timeline.run(progress))
        stats = await run_load(
            spec,
            targets,
            ledger,
            rate=scenario.rate,
            requests=scenario.requests,
            time_limit=scenario.time_limit,
            arrival=workload.arrival,
            concurrency_cap=workload.concurrency_cap,
            request_timeout=workload.client_timeout,
            drain_timeout=workload.client_timeout + 5.0,
            progress=progress,
        )
        timeline_task.cancel()
        state = await cluster.gateway_state()
        _write_meta(out, scenario, cluster, mode, stats, state, timeline.errors)
        return ModeResult(mode, stats, timeline.errors)
    finally:
        try:
            if timeline_task is not None:
                timeline_task.cancel()
            ledger.close()
            events.close()
        finally:
            await cluster.close()


def _targets(scenario: Scenario, cluster: Cluster, mode: str) -> dict[str, list[Target]]:
    targets: dict[str, list[Target]] = {}
    for inst in cluster.instances.values():
        for model in inst.models:
            targets.setdefault(model, []).append(Target(inst.name, inst.url))
    return targets


def _write_meta(
    out: Path,
    scenario: Scenario,
    cluster: Cluster,
    mode: str,
    stats: LoadStats,
    state: dict[str, Any] | None,
    timeline_errors: list[str],
) -> None:
    meta: dict[str, Any] = {
        "mode": mode,
        "scenario": scenario.name,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target_rate": scenario.rate,
        "requests_planned": scenario.requests,
        "requests_sent": stats.sent,
        "achieved_rate": stats.send_rate,
        "duration_s": stats.duration_s,
        "loadgen_cpu_s": stats.cpu_s,
        "loadgen_peak_rss_mb": stats.peak_rss_mib,
        "loadgen": stats.as_dict(),
        **_backend_meta(scenario),
        "instances": {
            inst.name: {"pool": inst.pool, "models": inst.models, "starts": inst.starts}
            for inst in cluster.instances.values()
        },
        "timeline_errors": timeline_errors,
    }
    if cluster.redis is not None:
        # Not under "instances": Redis serves no requests, the report's per-instance tables
        # must not list it.
        meta["redis"] = {"url": cluster.redis.url, "starts": cluster.redis_starts}
    if state is not None:
        meta["gateway_counters"] = gateway_counters(state)
        meta["gateway_state"] = state
    (out / "meta.json").write_text(json.dumps(meta, indent=2))


def _backend_meta(scenario: Scenario) -> dict[str, Any]:
    backend = scenario.backend
    if isinstance(backend, EngineBackendSpec):
        # Real engines run at their own speed: there is no time compression to state.
        return {"engine": backend.model_dump(mode="json")}
    return {
        "time_compression": {
            "ttft_s": backend.ttft,
            "per_token_s": backend.per_token,
            "tokens_per_event": backend.tokens_per_event,
        }
    }


def gateway_counters(state: dict[str, Any]) -> dict[str, Any]:
    """The gateway's own counts, to cross-check the ledger against."""
    per_instance = {
        inst["name"]: inst.get("requests", 0)
        for pool in state.get("pools", {}).values()
        for inst in pool.get("instances", [])
    }
    counters: dict[str, Any] = {
        "requests_per_instance": per_instance,
        # Isolations this gateway made or adopted, over every instance of every pool.
        "isolations": sum(
            inst.get("isolations", 0)
            for pool in state.get("pools", {}).values()
            for inst in pool.get("instances", [])
        ),
    }
    if "retries" in state:
        counters["retries"] = state["retries"]
    shared = state.get("shared_state")
    if isinstance(shared, dict) and shared.get("configured"):
        counters["shared_state"] = {
            "connected": shared.get("connected"),
            "counters": shared.get("counters", {}),
        }
    return counters


def run_scenario(scenario: Scenario, run_dir: Path, modes: tuple[str, ...] = MODES) -> Path:
    """Run every mode, one after the other, then render the report; returns report.md."""
    from loadtests.report import build_report

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "scenario.yaml").write_text(
        yaml.safe_dump(scenario.model_dump(mode="json", by_alias=True), sort_keys=False)
    )
    for mode in modes:
        print(f"[{scenario.name}] {mode}: {scenario.requests} requests at {scenario.rate:g}/s")
        result = asyncio.run(run_mode(scenario, mode, run_dir))
        stats = result.stats
        print(
            f"[{scenario.name}] {mode}: sent {stats.sent}, ok {stats.ok}, "
            f"rate {stats.send_rate:.1f}/s, generator CPU {stats.cpu_percent:.0f}%"
        )
        for error in result.timeline_errors:
            print(f"[{scenario.name}] {mode}: fault action failed: {error}")
    return build_report(run_dir)
