"""How fast an isolation decision reaches every gateway replica that shares decisions via Redis.

When an operator isolates an instance on one replica (the origin), the others adopt it from the
pub/sub channel within milliseconds, or, with `pubsub: false`, at their next re-read of the
decision keys (every decision_ttl / 3: the TTL backstop alone). A restore spreads the same way.
This measures both, for both modes, in one run:

    python -m loadtests.bench_propagation [--replicas 16] [--rounds 30] [--ttl 3]
        [--mode pubsub|backstop|both] [--seed 1] [--json PATH]

How: one redis-server and N gateway replicas on loopback ports, a fresh set of replicas per
mode, health checks off so no backend is needed. Each round isolates one instance through the
admin API of one replica (round-robin), polls every replica's /admin/state until all show it
ISOLATED, then restores it there and waits until all show it ADMITTING. A replica's delay is its
`state_since` for the instance minus the origin's: wall-clock times the replicas record when
their breaker changes state, on one machine and so one clock, which makes the figures exact
rather than limited by the poll interval. Per change, the round's figure is the largest delay
(until EVERY replica treats the instance the same); every single replica's delay is kept too.
A round in which some replica does not follow within 3 x TTL + 2 s is a timeout: counted and
reported, never dropped silently. Random pauses keep rounds from aligning with the replicas'
re-read timers.

Loopback only; every process it starts (replicas, Redis) is stopped before it returns.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench.report import write_json
from loadtests.bench.results import percentile
from loadtests.procs import ManagedProcess, python_module
from loadtests.redis_server import RedisServer

Json = dict[str, Any]

POOL = "chat"
INSTANCES = ("a", "b", "c")
MODES = ("pubsub", "backstop")
ISOLATED = "ISOLATED"
ADMITTING = "ADMITTING"

POLL_S = 0.025  # between two polls of the replicas that have not followed yet
PAUSE_S = (0.05, 0.3)  # random pause before each isolation and each restore
CONNECT_TIMEOUT_S = 30.0  # for every replica to report its Redis session connected
READY_TIMEOUT_S = 60.0  # for one replica to announce READY (they start a few at a time)
START_WORKERS = 4
HTTP_TIMEOUT_S = 2.0

# The project's bars for isolation p99 (until every replica): reported, never enforced.
PUBSUB_TARGET_MS = 100.0

# Replica output lines worth reporting: failures, and Redis sessions lost or never made.
OUTPUT_MARKERS = (" ERROR ", " CRITICAL ", "Traceback", "shared state: lost", "cannot reach")


@dataclass(frozen=True)
class Settings:
    replicas: int
    rounds: int
    ttl_s: float
    modes: tuple[str, ...]
    seed: int

    @property
    def timeout_s(self) -> float:
        """How long one change may take to reach every replica before the round times out."""
        return 3 * self.ttl_s + 2.0


def target_ms(mode: str, ttl_s: float) -> float:
    """Isolation p99 target: 100 ms with pub/sub, the decision TTL with the backstop alone."""
    return PUBSUB_TARGET_MS if mode == "pubsub" else ttl_s * 1000.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_propagation",
        description="Time for an isolation (and a restore) to reach every gateway replica.",
    )
    parser.add_argument("--replicas", type=int, default=16, help="gateway replicas (16)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds per mode (30)")
    parser.add_argument("--ttl", type=float, default=3.0, help="decision_ttl in seconds (3)")
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both", help="(both)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random pauses (1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.replicas < 2 or args.rounds < 1:
        parser.error("--replicas must be >= 2 and --rounds >= 1")
    if not 0.3 <= args.ttl <= 60:
        parser.error("--ttl must be between 0.3 (the gateway's minimum) and 60 seconds")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    modes = MODES if args.mode == "both" else (args.mode,)
    return Settings(args.replicas, args.rounds, args.ttl, modes, args.seed)


def policy_text(redis_url: str, mode: str, ttl_s: float) -> str:
    instances = "".join(f'      - {{name: {n}, url: "http://127.0.0.1:9"}}\n' for n in INSTANCES)
    pubsub = "true" if mode == "pubsub" else "false"
    return (
        "listen: 127.0.0.1:0\n"
        "admin: {listen: 127.0.0.1:0}\n"
        f'shared: {{redis_url: "{redis_url}", key_prefix: bench-{mode}, '
        f"decision_ttl: {ttl_s}s, pubsub: {pubsub}}}\n"
        f"pools:\n  {POOL}:\n    models: [m]\n    instances:\n{instances}"
        "    health: {enabled: false}\n"
    )


# -- the replicas -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    name: str  # GATEWAY_REPLICA_ID: its name in shared decisions
    admin: str  # HOST:PORT of its admin API
    proc: ManagedProcess


def start_replica(policy: Path, name: str) -> Replica:
    proc = ManagedProcess(
        python_module("gateway", "run", "--policy", str(policy)),
        # An empty token turns admin authentication off even if the caller's env sets one.
        env={"GATEWAY_REPLICA_ID": name, "GATEWAY_ADMIN_TOKEN": ""},
        ready_timeout_s=READY_TIMEOUT_S,
        stop_signal=signal.SIGINT,  # the quick stop: nobody to drain for
    )
    return Replica(name, proc.ready["admin"], proc)


def stop_all(procs: Sequence[ManagedProcess]) -> None:
    """Stop them side by side (each stop is bounded: SIGTERM, then SIGKILL)."""
    if procs:
        with ThreadPoolExecutor(max_workers=len(procs)) as pool:
            list(pool.map(lambda proc: proc.stop(), procs))


def start_replicas(stack: ExitStack, policy: Path, count: int) -> list[Replica]:
    """Start `count` replicas a few at a time; `stack` stops every one that started."""
    with ThreadPoolExecutor(max_workers=START_WORKERS) as pool:
        futures = [pool.submit(start_replica, policy, f"r{i}") for i in range(count)]
        started: list[Replica] = []
        failures: list[BaseException] = []
        for future in futures:
            error = future.exception()
            if error is None:
                started.append(future.result())
            else:
                failures.append(error)
    stack.callback(stop_all, [replica.proc for replica in started])
    if failures:
        raise RuntimeError(f"{len(failures)} of {count} replicas did not start") from failures[0]
    return started


def output_findings(replicas: Sequence[Replica]) -> dict[str, list[str]]:
    """Replica output lines that report a failure or a lost Redis session, per replica."""
    found: dict[str, list[str]] = {}
    for replica in replicas:
        lines = [line for line in replica.proc.lines if any(m in line for m in OUTPUT_MARKERS)]
        if lines:
            found[replica.name] = lines[:20]
    return found


# -- the admin API ----------------------------------------------------------------------------


class Admin:
    """The replicas' admin APIs; `errors` counts the polls that failed."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.errors = 0

    async def state(self, replica: Replica) -> Json | None:
        try:
            response = await self.client.get(f"http://{replica.admin}/admin/state")
            response.raise_for_status()
            state: Json = response.json()
        except (httpx.HTTPError, ValueError):
            self.errors += 1
            return None
        return state

    async def instance(self, replica: Replica, name: str) -> Json | None:
        state = await self.state(replica)
        if state is None:
            return None
        found: Json | None = next(
            (i for i in state["pools"][POOL]["instances"] if i["name"] == name), None
        )
        return found

    async def operate(self, replica: Replica, name: str, action: str) -> None:
        url = f"http://{replica.admin}/admin/instances/{POOL}/{name}/{action}"
        try:
            response = await self.client.post(url)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"{action} {name} on {replica.name}: {exc!r}") from exc
        if response.status_code != 200:
            raise RuntimeError(f"{action} {name} on {replica.name}: HTTP {response.status_code}")


async def poll_until(
    check: Callable[[], Awaitable[bool]], timeout_s: float, every_s: float
) -> bool:
    """Await `check` until it holds, at most `timeout_s` (and so a bounded number of times)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for _ in range(math.ceil(timeout_s / every_s) + 1):
        if await check():
            return True
        if loop.time() >= deadline:
            break
        await asyncio.sleep(every_s)
    return False


async def wait_connected(admin: Admin, replicas: Sequence[Replica]) -> None:
    waiting = [replica.name for replica in replicas]

    async def all_connected() -> bool:
        states = await asyncio.gather(*(admin.state(replica) for replica in replicas))
        waiting[:] = [
            replica.name
            for replica, state in zip(replicas, states, strict=True)
            if state is None or not state["shared_state"]["connected"]
        ]
        return not waiting

    if not await poll_until(all_connected, CONNECT_TIMEOUT_S, 0.1):
        raise RuntimeError(f"not connected to Redis after {CONNECT_TIMEOUT_S:.0f} s: {waiting}")


async def converge(
    admin: Admin,
    replicas: Sequence[Replica],
    instance: str,
    want: str,
    timeout_s: float,
    after: float = -math.inf,
) -> dict[str, float]:
    """Poll the replicas until each shows `instance` in state `want` since `after` (epoch
    seconds) or later: each one's `state_since`, by replica name. A state older than `after`
    predates the change being measured and is not counted as following it. A replica missing
    from the result never got there."""
    since: dict[str, float] = {}

    async def everyone_there() -> bool:
        pending = [replica for replica in replicas if replica.name not in since]
        views = await asyncio.gather(*(admin.instance(r, instance) for r in pending))
        for replica, view in zip(pending, views, strict=True):
            if view is None or view["state"] != want or view["state_since"] is None:
                continue
            if float(view["state_since"]) >= after:
                since[replica.name] = float(view["state_since"])
        return len(since) == len(replicas)

    await poll_until(everyone_there, timeout_s, POLL_S)
    return since


async def shared_counters(admin: Admin, replicas: Sequence[Replica]) -> Json:
    """What the replicas' Redis sessions report at the end: anything but zeros is worth a look."""
    states = await asyncio.gather(*(admin.state(replica) for replica in replicas))
    totals = dict.fromkeys(("connection_losses", "suppressed", "malformed"), 0)
    disconnected: list[str] = []
    for replica, state in zip(replicas, states, strict=True):
        if state is None or not state["shared_state"]["connected"]:
            disconnected.append(replica.name)
            continue
        for key in totals:
            totals[key] += int(state["shared_state"]["counters"][key])
    return {**totals, "disconnected_at_end": disconnected}


# -- one round ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """One change as the replicas followed it, in milliseconds after the origin's change."""

    complete: bool  # every replica expected to follow did, in time
    every_ms: float | None  # until the last of them (None unless complete)
    delays_ms: dict[str, float]  # each replica that followed (the origin excluded)
    missing: list[str]


def spread(since: dict[str, float], origin: str, expected: Sequence[str]) -> Spread:
    start = since.get(origin)
    if start is None:
        return Spread(False, None, {}, list(expected))
    delays = {
        name: round((since[name] - start) * 1000.0, 3)
        for name in expected
        if name != origin and name in since
    }
    missing = [name for name in expected if name not in since]
    every = max(delays.values(), default=0.0) if not missing else None
    return Spread(not missing, every, delays, missing)


async def one_round(
    admin: Admin,
    replicas: Sequence[Replica],
    origin: Replica,
    instance: str,
    settings: Settings,
    rng: random.Random,
) -> tuple[Json, bool]:
    """Isolate then restore `instance` on `origin`; the round's record, and whether every
    replica is back to ADMITTING (the next round needs that)."""
    names = [replica.name for replica in replicas]
    await asyncio.sleep(rng.uniform(*PAUSE_S))
    issued = time.time()
    await admin.operate(origin, instance, "isolate")
    isolated = await converge(admin, replicas, instance, ISOLATED, settings.timeout_s, issued)
    await asyncio.sleep(rng.uniform(*PAUSE_S))
    issued = time.time()
    await admin.operate(origin, instance, "restore")
    restored = await converge(admin, replicas, instance, ADMITTING, settings.timeout_s, issued)
    # A replica that never isolated it has nothing to restore: its "since" predates the round.
    followed = [name for name in names if name in isolated]
    record = {
        "origin": origin.name,
        "instance": instance,
        "isolate": asdict(spread(isolated, origin.name, names)),
        "restore": asdict(spread(restored, origin.name, followed)),
    }
    return record, len(restored) == len(replicas)


async def settle(
    admin: Admin, replicas: Sequence[Replica], instance: str, timeout_s: float
) -> bool:
    """After a restore some replica missed: restore it on each straggler, then wait again."""
    since = await converge(admin, replicas, instance, ADMITTING, 0.0)
    stragglers = [replica for replica in replicas if replica.name not in since]
    for replica in stragglers:
        await admin.operate(replica, instance, "restore")
    since = await converge(admin, replicas, instance, ADMITTING, timeout_s)
    return len(since) == len(replicas)


async def measure(replicas: Sequence[Replica], settings: Settings) -> Json:
    rng = random.Random(settings.seed)
    rounds: list[Json] = []
    notes: list[str] = []
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, trust_env=False) as client:
        admin = Admin(client)
        await wait_connected(admin, replicas)
        admin.errors = 0  # count the failed polls of the rounds only
        for index in range(settings.rounds):
            origin = replicas[index % len(replicas)]
            instance = INSTANCES[index % len(INSTANCES)]
            record, all_back = await one_round(admin, replicas, origin, instance, settings, rng)
            rounds.append(record)
            if not all_back and not await settle(admin, replicas, instance, settings.timeout_s):
                notes.append(f"stopped after round {index + 1}: {instance} stayed isolated")
                break
        counters = await shared_counters(admin, replicas)
    return {"rounds": rounds, "poll_errors": admin.errors, "notes": notes, "shared": counters}


# -- figures ------------------------------------------------------------------------------------


def figures(values_ms: Sequence[float]) -> Json:
    ordered = sorted(values_ms)
    if not ordered:
        return {"count": 0, "min_ms": None, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "count": len(ordered),
        "min_ms": ordered[0],
        "p50_ms": percentile(ordered, 50),
        "p99_ms": percentile(ordered, 99),
        "max_ms": ordered[-1],
    }


def change_summary(rounds: Sequence[Json], change: str) -> Json:
    spreads = [record[change] for record in rounds]
    return {
        "every_replica": figures([s["every_ms"] for s in spreads if s["complete"]]),
        "each_replica": figures([d for s in spreads for d in s["delays_ms"].values()]),
        "timeouts": sum(1 for s in spreads if not s["complete"]),
    }


def summarize(mode: str, settings: Settings, measured: Json) -> Json:
    rounds: list[Json] = measured["rounds"]
    isolate = change_summary(rounds, "isolate")
    target = target_ms(mode, settings.ttl_s)
    p99 = isolate["every_replica"]["p99_ms"]
    return {
        "pubsub": mode == "pubsub",
        "rounds_run": len(rounds),
        "isolate": isolate,
        "restore": change_summary(rounds, "restore"),
        "target": {
            "isolation_p99_ms": target,
            "met": p99 is not None and p99 <= target and isolate["timeouts"] == 0,
        },
        **measured,
    }


def run_mode(redis_url: str, settings: Settings, mode: str, tmp: Path) -> Json:
    policy = tmp / f"{mode}.yaml"
    policy.write_text(policy_text(redis_url, mode, settings.ttl_s))
    with ExitStack() as stack:
        replicas = start_replicas(stack, policy, settings.replicas)
        print(f"[bench] {mode}: {len(replicas)} replicas up", file=sys.stderr, flush=True)
        measured = asyncio.run(measure(replicas, settings))
        stack.close()  # stopped: their output is complete
        measured["replica_output"] = output_findings(replicas)
    return summarize(mode, settings, measured)


def run_benchmark(settings: Settings) -> Json:
    data: Json = {
        "meta": {
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "settings": asdict(settings),
            "refresh_s": settings.ttl_s / 3,
            "round_timeout_s": settings.timeout_s,
            "poll_interval_ms": POLL_S * 1000.0,
        },
        "modes": {},
    }
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-propagation-")))
        redis = stack.enter_context(RedisServer())
        for mode in settings.modes:
            print(f"[bench] {mode}: starting {settings.replicas} replicas", file=sys.stderr)
            data["modes"][mode] = run_mode(redis.url, settings, mode, tmp)
    return data


# -- the report ---------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _rows(mode: str, result: Json) -> list[list[str]]:
    rows = []
    for change in ("isolate", "restore"):
        summary = result[change]
        every, each = summary["every_replica"], summary["each_replica"]
        if change == "isolate":
            target = f"p99 ≤ {result['target']['isolation_p99_ms']:g} ms"
            verdict = "met" if result["target"]["met"] else "NOT met"
        else:
            target, verdict = "-", "-"
        rows.append(
            [
                mode,
                change,
                str(result["rounds_run"]),
                str(summary["timeouts"]),
                _ms(every["p50_ms"]),
                _ms(every["p99_ms"]),
                _ms(every["max_ms"]),
                _ms(each["p50_ms"]),
                _ms(each["p99_ms"]),
                target,
                verdict,
            ]
        )
    return rows


def _remarks(mode: str, result: Json) -> list[str]:
    shared = result["shared"]
    remarks = [f"- {mode}: {note}" for note in result["notes"]]
    if result["poll_errors"]:
        remarks.append(f"- {mode}: {result['poll_errors']} admin polls failed")
    for key in ("connection_losses", "suppressed", "malformed"):
        if shared[key]:
            remarks.append(f"- {mode}: shared-state {key.replace('_', ' ')}: {shared[key]}")
    if shared["disconnected_at_end"]:
        remarks.append(f"- {mode}: not connected at the end: {shared['disconnected_at_end']}")
    for name, lines in result["replica_output"].items():
        remarks.append(f"- {mode}: replica {name} logged: {lines[0].strip()}")
    return remarks


def render(data: Json) -> str:
    meta, modes = data["meta"], data["modes"]
    settings = meta["settings"]
    headers = [
        "mode",
        "change",
        "rounds",
        "timeouts",
        "all p50 ms",
        "all p99 ms",
        "all max ms",
        "each p50 ms",
        "each p99 ms",
        "target (isolation, all)",
        "verdict",
    ]
    rows = [row for mode, result in modes.items() for row in _rows(mode, result)]
    remarks = [line for mode, result in modes.items() for line in _remarks(mode, result)]
    parts = [
        "## Propagation of isolation decisions",
        "",
        f"{settings['replicas']} replicas, decision_ttl {settings['ttl_s']:g} s (backstop "
        f"re-read every {meta['refresh_s']:.2f} s), round timeout {meta['round_timeout_s']:g} s, "
        f"seed {settings['seed']}.",
        "",
        "all: until every replica follows the origin, one figure per round; each: every "
        "replica's own delay. From the replicas' state_since (same clock), not the poll "
        "interval. Percentiles are nearest-rank: with few rounds p99 is the max.",
        "",
        markdown_table(headers, rows),
        "",
        f"Targets: isolation p99 ≤ {PUBSUB_TARGET_MS:g} ms with pub/sub; ≤ "
        f"{settings['ttl_s']:g} s (the TTL) with the backstop alone.",
    ]
    if remarks:
        parts += ["", "Worth a look:", *remarks]
    return "\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    data = run_benchmark(settings_from(args))
    if args.json is not None:
        write_json(args.json, data)  # first: the figures survive a rendering problem
        print(f"figures written to {args.json}", file=sys.stderr)
    sys.stdout.write(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
