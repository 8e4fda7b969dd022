"""Fallbacks with a flapping primary, across gateway replicas that share decisions via Redis.

    python -m loadtests.bench_fallback [--rate 20] [--down 10] [--before 5] [--after 10]
        [--replicas 3] [--instances 2] [--backup-instances 2] [--out PATH]

On loopback: one redis-server, fake vLLM instances for two pools, and `--replicas` gateway
processes (`gateway run`) on one policy: pool `primary` (model `primary-model`, `--instances`
instances) with `fallbacks: [backup]`, pool `backup` (model `backup-model`), `shared` pointing
at the Redis. An open-loop client sends chat completions at `--rate` requests/s, round robin
over the replicas, every other one streamed, for before + down + after seconds. After `--before`
seconds every primary instance is killed (SIGKILL: its port stays held, so connections to it
are refused), and after `--down` seconds they are started again on the same ports.

What it reports (a table on stdout, every figure in the JSON file, by default
loadtests/out/bench_fallback.json):

- requests sent and failed (any status but 200, a body that is not a whole answer, a stream
  without its `[DONE]` or with an error event), and per second which pool answered them (the
  `x-gateway-pool` header);
- from the primary's recovery (its last instance serving again) to the first answer the primary
  gives, and to "back on the primary": the first one-second window (of requests sent from then
  on) in which at least 95 % are answered by the primary;
- what reached the primary's instances during the outage, per replica-second, from each
  replica's /metrics (the counters before the kill and at the restart): probes
  (`gateway_probes_total`) and attempts (`gateway_upstream_attempts_total`, by outcome:
  `connect_failure` is a refused connection), with panic attempts and hand-overs beside them;
- p50/p99 latency (whole request, and first byte) of the requests sent during the outage against
  those sent before it.

The project's bars for this scenario: no request failed; back on the primary within 3 s of its
recovery; at most one probe per replica-second during the outage. They are reported, not
enforced (the exit status is 0 whenever the run completed).

Every process it starts is stopped before it returns, on failure too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests.bench.report import write_json
from loadtests.bench.results import percentile
from loadtests.bench_propagation import (
    Admin,
    Replica,
    markdown_table,
    start_replicas,
    wait_connected,
)
from loadtests.loadgen.client import new_session
from loadtests.loadgen.sse import SseScanner
from loadtests.ports import PortHold, hold_port
from loadtests.procs import ManagedProcess, python_module
from loadtests.redis_server import RedisServer

Json = dict[str, Any]

PRIMARY, BACKUP = "primary", "backup"
MODELS = {PRIMARY: "primary-model", BACKUP: "backup-model"}
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "bench_fallback.json"

# The fake engines: quick answers, so that a request is in flight for a fraction of a second
# and the figures are about routing, not about queues.
TTFT_S = 0.02
PER_TOKEN_S = 0.004
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 30.0  # for the requests still in flight when sending stops
SCRAPE_TIMEOUT_S = 2.0

# The project's bars for this scenario.
BACK_WITHIN_S = 3.0
BACK_SHARE = 0.95  # of a second's requests answered by the primary
MAX_PROBES_PER_REPLICA_S = 1.0

# Replica output worth keeping in the report: the primary's breaker and health changes, and
# failures.
OUTPUT_MARKERS = ("breaker transition", "health change")
ERROR_MARKERS = (" ERROR ", "Traceback")


@dataclass(frozen=True)
class Settings:
    rate: float
    before_s: float
    down_s: float
    after_s: float
    replicas: int
    instances: int
    backup_instances: int
    # The primary without health checks, as a hosted provider's pool is: only its breakers
    # (isolations shared through Redis) and their probes tell it is down, and back.
    no_health: bool = False

    @property
    def duration_s(self) -> float:
        return self.before_s + self.down_s + self.after_s


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_fallback",
        description="Fallbacks while every primary instance is down, across gateway replicas.",
    )
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second (20)")
    parser.add_argument("--before", type=float, default=5.0, help="seconds before the kill (5)")
    parser.add_argument("--down", type=float, default=10.0, help="seconds of outage (10)")
    parser.add_argument("--after", type=float, default=10.0, help="seconds after it (10)")
    parser.add_argument("--replicas", type=int, default=3, help="gateway replicas (3)")
    parser.add_argument("--instances", type=int, default=2, help="primary instances (2)")
    parser.add_argument("--backup-instances", type=int, default=2, choices=(1, 2), help="(2)")
    parser.add_argument(
        "--no-health",
        action="store_true",
        help="the primary without health checks (a hosted provider's pool): only its breakers "
        "and their probes see it go and come back",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON figures")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.rate > 500:
        parser.error("--rate must be in (0, 500]")
    if min(args.before, args.down, args.after) <= 0:
        parser.error("--before, --down and --after must be > 0")
    if args.replicas < 1 or args.instances < 1:
        parser.error("--replicas and --instances must be >= 1")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        args.rate,
        args.before,
        args.down,
        args.after,
        args.replicas,
        args.instances,
        args.backup_instances,
        args.no_health,
    )


# -- the fake instances -------------------------------------------------------------------------


class FakeInstance:
    """A fake vLLM server on a port held for it (loadtests/ports.py) until `close()`: killed,
    its port refuses connections, and it comes back on the same port. A start running in a
    thread when the run ends is waited for by `close`, which then stops what it started."""

    def __init__(self, name: str, model: str) -> None:
        self.name = name
        self.model = model
        self._hold: PortHold | None = hold_port()
        self.port = self._hold.port
        self.proc: ManagedProcess | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start it; the monotonic time it announced that it serves."""
        with self._lock:
            if self._hold is None:
                raise RuntimeError(f"{self.name} is closed")
            if self.proc is not None:
                if self.proc.proc.poll() is None:
                    raise RuntimeError(f"{self.name} is already running")
                self.proc.stop()  # reaped: its output reader joined
            self.proc = ManagedProcess(
                python_module(
                    "loadtests.fake_vllm",
                    *("--port", str(self.port), "--name", self.name, "--models", self.model),
                    *("--ttft", str(TTFT_S), "--per-token", str(PER_TOKEN_S)),
                )
            )
            return time.monotonic()

    def kill(self) -> None:
        """SIGKILL: its connections reset, new ones refused (the port stays held). Only the
        signal, so that every instance dies at once: the next `start` or `close` reaps it."""
        if self.proc is not None:
            self.proc.signal(signal.SIGKILL)

    def close(self) -> None:
        with self._lock:
            try:
                if self.proc is not None:
                    self.proc.stop()
            finally:
                hold, self._hold = self._hold, None
                if hold is not None:
                    hold.close()


def start_instances(stack: ExitStack, pool: str, count: int) -> list[FakeInstance]:
    instances: list[FakeInstance] = []
    for index in range(count):
        instance = FakeInstance(f"{pool}-{index}", MODELS[pool])
        stack.callback(instance.close)
        instance.start()
        instances.append(instance)
    return instances


def policy_text(
    redis_url: str, pools: dict[str, list[FakeInstance]], no_health: bool = False
) -> str:
    def instances(pool: str) -> str:
        return ", ".join(f'{{name: {i.name}, url: "{i.url}"}}' for i in pools[pool])

    return (
        "listen: 127.0.0.1:0\n"
        "admin: {listen: 127.0.0.1:0}\n"
        f'shared: {{redis_url: "{redis_url}", key_prefix: bench-fallback}}\n'
        "pools:\n"
        f"  {PRIMARY}:\n"
        f"    models: [{MODELS[PRIMARY]}]\n"
        f"    instances: [{instances(PRIMARY)}]\n"
        f"    fallbacks: [{BACKUP}]\n"
        + ("    health: {enabled: false}\n" if no_health else "")
        + f"  {BACKUP}:\n"
        f"    models: [{MODELS[BACKUP]}]\n"
        f"    instances: [{instances(BACKUP)}]\n"
    )


# -- the replicas' counters ---------------------------------------------------------------------

# The counters read from each replica, as (sample name, label that tells the pool).
_COUNTERS = (
    ("gateway_probes_total", "pool"),
    ("gateway_upstream_attempts_total", "pool"),
    ("gateway_pool_panic_attempts_total", "pool"),
    ("gateway_fallbacks_total", "from"),
    ("gateway_isolations_total", "pool"),
)


def primary_counters(text: str) -> dict[str, float]:
    """The primary pool's counters in one /metrics page, summed over its instances, by
    `name` and `name{label=value}` for the probes' result and the attempts' outcome."""
    wanted = dict(_COUNTERS)
    found: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            pool_label = wanted.get(sample.name)
            if pool_label is None or sample.labels.get(pool_label) != PRIMARY:
                continue
            found[sample.name] += sample.value
            for detail in ("result", "outcome"):
                if detail in sample.labels:
                    found[f"{sample.name}{{{detail}={sample.labels[detail]}}}"] += sample.value
    return dict(found)


async def scrape(client: httpx.AsyncClient, replicas: Sequence[Replica]) -> dict[str, Json]:
    """Each replica's primary counters now (an empty dict for one that did not answer)."""

    async def one(replica: Replica) -> dict[str, float]:
        try:
            response = await client.get(f"http://{replica.admin}/metrics")
            response.raise_for_status()
        except httpx.HTTPError:
            return {}
        return primary_counters(response.text)

    pages = await asyncio.gather(*(one(replica) for replica in replicas))
    return {replica.name: page for replica, page in zip(replicas, pages, strict=True)}


def deltas(before: dict[str, Json], after: dict[str, Json]) -> dict[str, Json]:
    return {
        name: {
            key: round(value - before.get(name, {}).get(key, 0.0), 6)
            for key, value in sorted(after[name].items())
            if value != before.get(name, {}).get(key, 0.0)
        }
        for name in after
    }


# -- the client ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it; times in seconds from the start of sending."""

    seq: int
    t: float  # when it was sent (its scheduled time)
    replica: str
    stream: bool
    status: int = 0
    pool: str | None = None  # x-gateway-pool
    fallbacks: int | None = None  # x-gateway-fallbacks
    proper: bool = False
    error: str | None = None
    ttfb: float | None = None
    total: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.proper

    @property
    def failure(self) -> str:
        """What went wrong, in a few words (for a request that is not `ok`)."""
        if self.error is not None:
            return self.error
        if self.status != 200:
            return f"status {self.status}"
        return "stream cut" if self.stream else "improper body"


def request_body(stream: bool) -> bytes:
    return json.dumps(
        {
            "model": MODELS[PRIMARY],
            "messages": [{"role": "user", "content": "tell me about the weather in a word"}],
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        }
    ).encode()


async def send(session: aiohttp.ClientSession, url: str, body: bytes, out: Outcome) -> None:
    """Send one request, filling `out` in; never raises (a failure goes into `out.error`)."""
    started = time.monotonic()
    try:
        async with session.post(
            url,
            data=body,
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        ) as response:
            out.status = response.status
            out.pool = response.headers.get("x-gateway-pool")
            hops = response.headers.get("x-gateway-fallbacks", "")
            out.fallbacks = int(hops) if hops.isdigit() else None
            scanner = SseScanner() if out.stream and response.status == 200 else None
            kept = bytearray()
            async for chunk in response.content.iter_any():
                if out.ttfb is None:
                    out.ttfb = time.monotonic() - started
                if scanner is not None:
                    scanner.feed(chunk)
                else:
                    kept += chunk
            if scanner is not None:
                scanner.finish()
                out.proper = scanner.done and not scanner.error_event
            else:
                out.proper = response.status == 200 and _whole_answer(bytes(kept))
    except Exception as exc:  # any failure ends in the outcome, never lost
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        out.total = time.monotonic() - started


def _whole_answer(body: bytes) -> bool:
    try:
        value = json.loads(body)
    except ValueError:
        return False
    return isinstance(value, dict) and bool(value.get("choices"))


async def open_loop(
    replicas: Sequence[Replica], rate: float, duration_s: float, t0: float
) -> list[Outcome]:
    """Requests at `rate` per second from loop time `t0` for `duration_s`, each at its own
    scheduled time whether the earlier ones were answered or not; round robin over the
    replicas, every other one streamed. Returns once each has ended (or, past the drain
    timeout, was cancelled and recorded as such)."""
    loop = asyncio.get_running_loop()
    bodies = {False: request_body(False), True: request_body(True)}
    urls = [f"http://{r.proc.ready['data']}/v1/chat/completions" for r in replicas]
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    async with new_session() as session:
        for seq in range(int(rate * duration_s)):
            at = seq / rate
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            stream = seq % 2 == 1
            index = seq % len(replicas)
            out = Outcome(seq, at, replicas[index].name, stream)
            outcomes.append(out)
            tasks.append(asyncio.create_task(send(session, urls[index], bodies[stream], out)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    for out in outcomes:
        if out.total is None:
            out.error = out.error or "cancelled: run ended"
    return outcomes


# -- the outage ---------------------------------------------------------------------------------


@dataclass
class Timeline:
    """When things happened, in seconds from the start of sending."""

    killed_at: float = 0.0
    restart_at: float = 0.0
    serving_at: dict[str, float] = field(default_factory=dict)  # each instance serving again
    counters: dict[str, dict[str, Json]] = field(default_factory=dict)  # before/at_restart/end

    @property
    def recovered_at(self) -> float:
        """When the primary could answer again, its first instance serving (its recovery)."""
        return min(self.serving_at.values())

    @property
    def all_serving_at(self) -> float:
        return max(self.serving_at.values())


async def outage(
    primary: Sequence[FakeInstance],
    replicas: Sequence[Replica],
    settings: Settings,
    t0: float,
    timeline: Timeline,
) -> None:
    """Kill every primary instance after `before_s`, start them again `down_s` later; the
    replicas' counters are read just before each."""
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, trust_env=False) as client:
        await asyncio.sleep(max(0.0, t0 + settings.before_s - loop.time()))
        timeline.counters["before"] = await scrape(client, replicas)
        timeline.killed_at = loop.time() - t0
        for instance in primary:
            instance.kill()
        print(f"[bench] {len(primary)} primary instances killed", file=sys.stderr, flush=True)
        await asyncio.sleep(max(0.0, t0 + settings.before_s + settings.down_s - loop.time()))
        timeline.counters["at_restart"] = await scrape(client, replicas)
        timeline.restart_at = loop.time() - t0
        # Side by side: each takes about a second to start (its Python imports).
        served = await asyncio.gather(*(asyncio.to_thread(i.start) for i in primary))
        # `start` returns time.monotonic(), the clock the event loop's time is read from.
        for instance, at in zip(primary, served, strict=True):
            timeline.serving_at[instance.name] = round(at - t0, 4)
        print("[bench] primary instances serving again", file=sys.stderr, flush=True)
        await asyncio.sleep(max(0.0, t0 + settings.duration_s - loop.time()))
        await asyncio.sleep(1.0)  # the last requests' attempts are counted
        timeline.counters["end"] = await scrape(client, replicas)


async def measure(
    primary: Sequence[FakeInstance], replicas: Sequence[Replica], settings: Settings
) -> tuple[list[Outcome], Timeline]:
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, trust_env=False) as client:
        await wait_connected(Admin(client), replicas)
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.2
    timeline = Timeline()
    faults = asyncio.create_task(outage(primary, replicas, settings, t0, timeline))
    try:
        outcomes = await open_loop(replicas, settings.rate, settings.duration_s, t0)
        await faults
    finally:
        if not faults.done():
            faults.cancel()
            await asyncio.gather(faults, return_exceptions=True)
    return outcomes, timeline


# -- figures ------------------------------------------------------------------------------------


def phase_of(t: float, timeline: Timeline) -> str:
    if t < timeline.killed_at:
        return "before"
    if t < timeline.recovered_at:
        return "down"
    return "after"


def per_second(outcomes: Sequence[Outcome], timeline: Timeline) -> list[Json]:
    """Per second of sending: how many requests left, and who answered them."""
    rows: dict[int, Json] = {}
    for out in outcomes:
        second = int(out.t)
        row = rows.setdefault(
            second,
            {"second": second, "phase": "", "sent": 0, PRIMARY: 0, BACKUP: 0, "failed": 0},
        )
        row["sent"] += 1
        if not out.ok:
            row["failed"] += 1
        elif out.pool in (PRIMARY, BACKUP):
            row[out.pool] += 1
    for second, row in rows.items():
        row["phase"] = phase_of(second + 0.5, timeline)
    return [rows[second] for second in sorted(rows)]


def back_on_primary_s(outcomes: Sequence[Outcome], since: float, until: float) -> float | None:
    """From `since` to the start of the first one-second window of requests (sent in
    [t, t + 1), t the send time of one of them, the window within the sending) in which at
    least BACK_SHARE are answered well by the primary; None when no such window came."""
    later = sorted((o for o in outcomes if o.t >= since), key=lambda o: o.t)
    end = 0
    for start, first in enumerate(later):
        if first.t + 1.0 > until:
            break
        end = max(end, start)
        while end < len(later) and later[end].t < first.t + 1.0:
            end += 1
        window = later[start:end]
        primary = sum(1 for o in window if o.ok and o.pool == PRIMARY)
        if window and primary >= BACK_SHARE * len(window):
            return round(first.t - since, 4)
    return None


def first_primary_answer_s(outcomes: Sequence[Outcome], timeline: Timeline) -> float | None:
    """From the recovery to the first answer's first byte from the primary, of a request sent
    after the kill."""
    answers = [
        o.t + o.ttfb
        for o in outcomes
        if o.t >= timeline.killed_at and o.ok and o.pool == PRIMARY and o.ttfb is not None
    ]
    return round(min(answers) - timeline.recovered_at, 4) if answers else None


def latency(outcomes: Sequence[Outcome]) -> Json:
    def stats(values: list[float]) -> Json:
        ordered = sorted(v * 1000.0 for v in values)
        return {
            "count": len(ordered),
            "p50_ms": round(percentile(ordered, 50), 2) if ordered else None,
            "p99_ms": round(percentile(ordered, 99), 2) if ordered else None,
        }

    return {
        "total": stats([o.total for o in outcomes if o.ok and o.total is not None]),
        "ttfb": stats([o.ttfb for o in outcomes if o.ok and o.ttfb is not None]),
    }


def outage_reach(timeline: Timeline) -> Json:
    """What reached the primary from each replica between the kill and the restart."""
    seconds = timeline.restart_at - timeline.killed_at
    moved = deltas(timeline.counters["before"], timeline.counters["at_restart"])
    per_replica = {}
    for name, counts in moved.items():
        probes = counts.get("gateway_probes_total", 0.0)
        attempts = counts.get("gateway_upstream_attempts_total", 0.0)
        per_replica[name] = {
            "probes": probes,
            "attempts": attempts,
            "probes_per_s": round(probes / seconds, 3),
            "attempts_per_s": round(attempts / seconds, 3),
            "counters": counts,
        }
    probes_per_s = [r["probes_per_s"] for r in per_replica.values()]
    attempts_per_s = [r["attempts_per_s"] for r in per_replica.values()]
    return {
        "seconds": round(seconds, 3),
        "per_replica": per_replica,
        "max_probes_per_replica_s": max(probes_per_s, default=0.0),
        "mean_probes_per_replica_s": round(sum(probes_per_s) / max(1, len(probes_per_s)), 3),
        "max_attempts_per_replica_s": max(attempts_per_s, default=0.0),
        "mean_attempts_per_replica_s": round(sum(attempts_per_s) / max(1, len(attempts_per_s)), 3),
    }


def summarize(outcomes: Sequence[Outcome], timeline: Timeline, settings: Settings) -> Json:
    failures = Counter(o.failure for o in outcomes if not o.ok)
    recovered = timeline.recovered_at
    back = back_on_primary_s(outcomes, recovered, settings.duration_s)
    reach = outage_reach(timeline)
    down = [o for o in outcomes if timeline.killed_at <= o.t < recovered]
    return {
        "sent": len(outcomes),
        "ok": sum(1 for o in outcomes if o.ok),
        "failed": sum(failures.values()),
        "failures": dict(failures.most_common()),
        "served_by": dict(Counter(o.pool or "-" for o in outcomes if o.ok)),
        "per_second": per_second(outcomes, timeline),
        "timeline": {
            "killed_at_s": round(timeline.killed_at, 4),
            "restart_at_s": round(timeline.restart_at, 4),
            "serving_at_s": timeline.serving_at,
            "recovered_at_s": round(recovered, 4),
            "all_serving_at_s": round(timeline.all_serving_at, 4),
        },
        "recovery": {
            "restart_to_serving_s": round(recovered - timeline.restart_at, 4),
            "first_primary_answer_s": first_primary_answer_s(outcomes, timeline),
            "back_on_primary_s": back,
        },
        "outage": reach,
        "whole_run": deltas(timeline.counters["before"], timeline.counters["end"]),
        "latency": {
            "before": latency([o for o in outcomes if o.t < timeline.killed_at]),
            "down": latency(down),
            "after": latency([o for o in outcomes if o.t >= recovered]),
        },
        "bars": {
            "no_failure": sum(failures.values()) == 0,
            "back_within_3s": back is not None and back <= BACK_WITHIN_S,
            "probes_per_replica_s_at_most_1": reach["max_probes_per_replica_s"]
            <= MAX_PROBES_PER_REPLICA_S,
        },
    }


def output_findings(replicas: Sequence[Replica]) -> dict[str, list[str]]:
    """The replicas' log lines about the primary's instances and failures (at most 40 each)."""
    found: dict[str, list[str]] = {}
    for replica in replicas:
        lines = [
            line
            for line in replica.proc.lines
            if any(marker in line for marker in ERROR_MARKERS)
            or (PRIMARY in line and any(marker in line for marker in OUTPUT_MARKERS))
        ]
        if lines:
            found[replica.name] = lines[:40]
    return found


def run_benchmark(settings: Settings) -> Json:
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-fallback-")))
        redis = stack.enter_context(RedisServer())
        pools = {
            PRIMARY: start_instances(stack, PRIMARY, settings.instances),
            BACKUP: start_instances(stack, BACKUP, settings.backup_instances),
        }
        policy = tmp / "policy.yaml"
        policy.write_text(policy_text(redis.url, pools, settings.no_health))
        replicas = start_replicas(stack, policy, settings.replicas)
        print(f"[bench] {len(replicas)} replicas up", file=sys.stderr, flush=True)
        outcomes, timeline = asyncio.run(measure(pools[PRIMARY], replicas, settings))
        stack.close()  # every process stopped: the replicas' output is complete
        findings = output_findings(replicas)
    return {
        "meta": {
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "settings": asdict(settings),
            "policy": policy_text("redis://127.0.0.1:PORT/0", pools, settings.no_health),
        },
        **summarize(outcomes, timeline, settings),
        "replica_output": findings,
    }


# -- the report ---------------------------------------------------------------------------------


def _num(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def _seconds_table(data: Json) -> str:
    rows = [
        [str(r["second"]), r["phase"], str(r["sent"]), str(r[PRIMARY]), str(r[BACKUP]),
         str(r["failed"])]
        for r in data["per_second"]
    ]  # fmt: skip
    return markdown_table(["s", "phase", "sent", PRIMARY, BACKUP, "failed"], rows)


def _outage_table(data: Json) -> str:
    rows = []
    for name, reach in data["outage"]["per_replica"].items():
        counts = reach["counters"]
        rows.append(
            [
                name,
                f"{reach['probes']:g}",
                f"{reach['probes_per_s']:.2f}",
                f"{reach['attempts']:g}",
                f"{reach['attempts_per_s']:.2f}",
                f"{counts.get('gateway_upstream_attempts_total{outcome=connect_failure}', 0):g}",
                f"{counts.get('gateway_pool_panic_attempts_total', 0):g}",
                f"{counts.get('gateway_fallbacks_total', 0):g}",
            ]
        )
    headers = ["replica", "probes", "/s", "attempts", "/s", "refused", "panic", "handed over"]
    return markdown_table(headers, rows)


def _latency_table(data: Json) -> str:
    rows = []
    for phase in ("before", "down", "after"):
        figures = data["latency"][phase]
        total, ttfb = figures["total"], figures["ttfb"]
        rows.append(
            [phase, str(total["count"]), _num(total["p50_ms"]), _num(total["p99_ms"]),
             _num(ttfb["p50_ms"]), _num(ttfb["p99_ms"])]
        )  # fmt: skip
    return markdown_table(["sent", "ok", "p50 ms", "p99 ms", "ttfb p50 ms", "ttfb p99 ms"], rows)


def render(data: Json) -> str:
    settings, timeline, recovery = data["meta"]["settings"], data["timeline"], data["recovery"]
    outage_s, bars = data["outage"], data["bars"]
    parts = [
        "## Fallbacks with a flapping primary",
        "",
        f"{settings['replicas']} replicas sharing decisions via Redis, {settings['rate']:g} "
        f"requests/s round robin over them (half streamed); primary: {settings['instances']} "
        f"instances, backup: {settings['backup_instances']}. Every primary instance killed at "
        f"{timeline['killed_at_s']:.2f} s, restarted at {timeline['restart_at_s']:.2f} s, "
        f"the first serving again at {timeline['recovered_at_s']:.2f} s (the recovery), all "
        f"at {timeline['all_serving_at_s']:.2f} s.",
        "",
        f"Requests sent: {data['sent']}, failed: {data['failed']}"
        + (f" {data['failures']}" if data["failures"] else "")
        + f"; answered by {data['served_by']}.",
        "",
        _seconds_table(data),
        "",
        f"From the recovery to the primary's first answer: "
        f"{_num(recovery['first_primary_answer_s'], ' s')}; back on the primary (≥ 95 % of a "
        f"second's requests): {_num(recovery['back_on_primary_s'], ' s')}.",
        "",
        f"During the outage ({outage_s['seconds']:.2f} s), what reached the primary's instances "
        "from each replica (attempts: every outcome; refused: connect failures; panic: panic "
        "attempts; handed over: requests given to the backup):",
        "",
        _outage_table(data),
        "",
        f"Probes per replica-second: max {outage_s['max_probes_per_replica_s']:.2f}, mean "
        f"{outage_s['mean_probes_per_replica_s']:.2f}; attempts on the primary per "
        f"replica-second: max {outage_s['max_attempts_per_replica_s']:.2f}, mean "
        f"{outage_s['mean_attempts_per_replica_s']:.2f}. Not counted there: health checks, "
        "which each replica sends an instance whose port refuses them every "
        "`health.fast_interval` (0.5 s by default).",
        "",
        "Latency by when the request was sent (ok requests; total: to the last byte):",
        "",
        _latency_table(data),
        "",
        "Bars: 0 failed: " + _verdict(bars["no_failure"]) + "; back on the primary within "
        f"{BACK_WITHIN_S:g} s of its recovery: " + _verdict(bars["back_within_3s"]) + "; at "
        "most one probe per replica-second during the outage: "
        + _verdict(bars["probes_per_replica_s_at_most_1"])
        + ".",
    ]
    return "\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    data = run_benchmark(settings_from(args))
    write_json(args.out, data)  # first: the figures survive a rendering problem
    print(f"figures written to {args.out}", file=sys.stderr)
    sys.stdout.write(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
