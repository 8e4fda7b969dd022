"""Runs a scenario both ways — clients straight to the instances, and through the gateway — and
writes the run directory that `loadtests.report` turns into report.md and charts.

Each mode gets fresh instances, the same seed, the same requests and the same fault timeline.
Direct mode is what users have without the gateway: client-side round robin, no retries.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
import yaml

from loadtests.chaos.cluster import Cluster
from loadtests.chaos.placement import SHARED, Choice, CpuPlacement, plan
from loadtests.chaos.scenario import EngineBackendSpec, Scenario
from loadtests.chaos.timeline import Timeline
from loadtests.ledger import JsonlWriter
from loadtests.loadgen import LoadStats, Progress, Target, WorkloadSpec, run_load

MODES = ("direct", "gateway")
STATE_EVERY_S = 0.5
# How long the replacements booted ahead of the run's kills may take to boot (on a busy machine).
STANDBY_BOOT_S = 60.0


@dataclass(frozen=True)
class ModeResult:
    mode: str
    stats: LoadStats
    timeline_errors: list[str]


async def run_mode(
    scenario: Scenario, mode: str, run_dir: Path, placement: CpuPlacement = SHARED
) -> ModeResult:
    out = run_dir / mode
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(scenario, out, placement)
    ledger = JsonlWriter(out / "ledger.jsonl")
    events = JsonlWriter(out / "events.jsonl", flush_every=1)
    timeline_task: asyncio.Task[None] | None = None
    sampler_task: asyncio.Task[None] | None = None
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
        timeline = Timeline(
            cluster,
            scenario.faults,
            planned_s=scenario.planned_s(scenario.requests, scenario.rate),
            clock=progress.elapsed,
            events=events,
        )
        # Replacements for the instances the run kills boot before the load, not under it.
        if not await timeline.booted(STANDBY_BOOT_S):
            raise RuntimeError(f"the instances' replacements did not boot in {STANDBY_BOOT_S} s")
        progress.start_clock()
        timeline_task = asyncio.create_task(timeline.run(progress))
        if mode == "gateway":
            sampler_task = asyncio.create_task(
                _sample_state(cluster, out / "state.jsonl", progress.elapsed)
            )
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
        if sampler_task is not None:
            sampler_task.cancel()
        state = await cluster.gateway_state()
        _write_meta(out, scenario, cluster, mode, stats, state, timeline.errors)
        return ModeResult(mode, stats, timeline.errors)
    finally:
        try:
            for task in (timeline_task, sampler_task):
                if task is not None:
                    task.cancel()
            ledger.close()
            events.close()
        finally:
            await cluster.close()


async def _sample_state(cluster: Cluster, path: Path, elapsed: Callable[[], float]) -> None:
    """The gateway's /admin/state every STATE_EVERY_S while the load runs, one JSON line each
    (`{"t": seconds since the load began, "state": ...}`): where the requests waited, what the
    limits and breakers were, read after the run beside the ledger."""
    with path.open("w", encoding="utf-8") as lines:
        while True:
            t = elapsed()
            state = await cluster.gateway_state()
            if state is not None:
                lines.write(json.dumps({"t": round(t, 3), "state": state}) + "\n")
                lines.flush()
            await asyncio.sleep(STATE_EVERY_S)


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
        "cpus": cluster.placement.describe(),
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


def run_scenario(
    scenario: Scenario, run_dir: Path, modes: tuple[str, ...] = MODES, cpus: Choice = "shared"
) -> Path:
    """Run every mode, one after the other, then render the report; returns report.md.
    `cpus`: where the gateway and the rest run (`loadtests.chaos.placement`)."""
    from loadtests.report import build_report

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "scenario.yaml").write_text(
        yaml.safe_dump(scenario.model_dump(mode="json", by_alias=True), sort_keys=False)
    )
    placement = plan(cpus, real_engines=isinstance(scenario.backend, EngineBackendSpec))
    print(f"[{scenario.name}] CPUs: {placement.describe()}")
    for mode in modes:
        print(f"[{scenario.name}] {mode}: {scenario.requests} requests at {scenario.rate:g}/s")
        with placement.applied():
            # uvloop, as the gateway and the fake engines run: the generator's own CPU is
            # spent beside the engines', and must not starve them.
            result = uvloop.run(run_mode(scenario, mode, run_dir, placement))
        stats = result.stats
        print(
            f"[{scenario.name}] {mode}: sent {stats.sent}, ok {stats.ok}, "
            f"rate {stats.send_rate:.1f}/s, generator CPU {stats.cpu_percent:.0f}%"
        )
        for error in result.timeline_errors:
            print(f"[{scenario.name}] {mode}: fault action failed: {error}")
    return build_report(run_dir)
