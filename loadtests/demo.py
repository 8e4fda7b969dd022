"""`make demo`: what the gateway is for, in under a minute.

Two identical sets of four fake vLLM instances run side by side on loopback. Clients send the
same seeded traffic (50 requests/s, chat and completions, half of them streamed) to both at the
same moments: to one set through the gateway, to the other directly (client-side round robin, no
retries: what clients have without a gateway). A scripted chaos timeline (`demo_timeline.py`)
hits both sets with the same faults at the same moments: an instance 50x slower, one failing
30 % of its requests with CUDA out of memory, one hanging. A live view shows what the gateway
sees and does; the summary compares what the clients got both ways.

    python -m loadtests.demo                 # the 46-second show, live view in a terminal
    python -m loadtests.demo --no-live       # a plain line every few seconds instead
    python -m loadtests.demo --seconds 12    # the same script, compressed
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import yaml

from gateway.config.models import Policy
from loadtests.chaos.cluster import Cluster, Instance
from loadtests.chaos.scenario import BackendSpec, PoolSpec, Scenario
from loadtests.chaos.timeline import Timeline
from loadtests.demo_timeline import BASE_S, INSTANCES, POOL, Script
from loadtests.demo_view import (
    GatewayView,
    Painter,
    Side,
    final_line,
    frame,
    plain_line,
    summary,
)
from loadtests.ledger import JsonlWriter
from loadtests.loadgen import Progress, Target, WorkloadSpec, run_load
from loadtests.procs import ManagedProcess

ROOT = Path(__file__).resolve().parent.parent
MODEL = "demo-chat"
MODES = ("gateway", "direct")
REFRESH_S = 0.5


def build_scenario(script: Script, seed: int) -> Scenario:
    """The chaos package's description of one side: instances, their speed, the gateway's
    policy (policies/demo.yaml's pool settings) and the faults."""
    demo_pool = yaml.safe_load((ROOT / "policies" / "demo.yaml").read_text())["pools"]["chat"]
    policy = {k: v for k, v in demo_pool.items() if k not in ("models", "instances")}
    return Scenario(
        name="demo",
        seed=seed,
        backend=BackendSpec(ttft=0.05, per_token=0.005, tokens_per_event=4),
        pools={POOL: PoolSpec(models=[MODEL], instances=INSTANCES)},
        gateway=policy,
        faults=script.steps(),
    )


def workload(seed: int) -> WorkloadSpec:
    return WorkloadSpec(
        models=[MODEL],
        chat_share=0.7,
        stream_share=0.5,
        prompt_tokens=(16, 256),
        max_tokens=(16, 128),
        seed=seed,
    )


class DemoCluster(Cluster):
    """The chaos cluster, with a gateway that exits at once when the demo ends (no drain)."""

    def gateway_policy(self) -> dict[str, Any]:
        policy = super().gateway_policy()
        if "drain" in Policy.model_fields:
            policy["drain"] = {"delay": "0s", "timeout": "1s"}
        return policy


class Screen:
    """Redraws a block of lines in place (ANSI: cursor up, clear line, no wrapping)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.drawn = 0

    def open(self) -> None:
        self.out.write("\x1b[?25l\x1b[?7l")  # hide the cursor, clip long lines
        self.out.flush()

    def draw(self, lines: list[str]) -> None:
        parts = [f"\x1b[{self.drawn}F"] if self.drawn else []
        parts += [line + "\x1b[K\n" for line in lines]
        parts.append("\x1b[J")
        self.out.write("".join(parts))
        self.out.flush()
        self.drawn = len(lines)

    def close(self) -> None:
        self.out.write("\x1b[?7h\x1b[?25h")
        self.out.flush()


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.script = Script(args.seconds)
        self.live = not args.no_live and sys.stdout.isatty()
        self.paint = Painter(self.live)
        self.workdir = Path(tempfile.mkdtemp(prefix="gateway-demo-"))
        scenario = build_scenario(self.script, args.seed)
        self.clusters: dict[str, Cluster] = {}
        for mode in MODES:
            (self.workdir / mode).mkdir()
            self.clusters[mode] = DemoCluster(scenario, self.workdir / mode)
        self.started: list[ManagedProcess] = []
        self.view = GatewayView()

    # --- processes -----------------------------------------------------------------------

    async def _start_instance(self, inst: Instance) -> None:
        def start() -> None:
            # Recorded by the thread itself: a Ctrl-C during the start cancels the awaiting
            # task, not the thread, and asyncio.run waits for the thread before the last cleanup.
            proc = ManagedProcess(inst.argv)
            inst.proc = proc
            inst.starts.append(0.0)
            self.started.append(proc)

        await asyncio.to_thread(start)

    async def _start_cluster(self, mode: str) -> None:
        cluster = self.clusters[mode]
        results = await asyncio.gather(
            *(self._start_instance(inst) for inst in cluster.instances.values()),
            return_exceptions=True,  # every start finishes (and is stopped later) before raising
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        if mode == "gateway":
            await asyncio.to_thread(cluster.start_gateway)
            assert cluster.gateway is not None
            self.started.append(cluster.gateway)

    def leftovers(self) -> list[ManagedProcess]:
        """Every child process still running (normally none after `run`)."""
        procs = list(self.started)
        for cluster in self.clusters.values():
            procs += [cluster.gateway] if cluster.gateway is not None else []
            for inst in cluster.instances.values():
                procs += [p for p in (inst.proc, inst.proxy) if p is not None]
        return [p for p in dict.fromkeys(procs) if p.proc.poll() is None]

    def stop_leftovers(self) -> None:
        for proc in self.leftovers():
            proc.stop()

    # --- the run -------------------------------------------------------------------------

    def intro(self) -> None:
        script, args = self.script, self.args
        print(
            f"llm-gateway demo: {INSTANCES} fake vLLM instances twice over, one set behind the"
            " gateway,\nthe other used directly (client-side round robin, no retries: what"
            " clients have without it).\n"
            f"Both get the same {args.rate:g} requests/s (chat and completions, half streamed)"
            f" for {script.seconds:g} s,\nand the same faults at the same moments:"
        )
        for fault in script.faults:
            print(
                f"  {script.at(fault.start):5.1f} s  {fault.story}"
                f"  (until {script.at(fault.end):.1f} s)"
            )
        print(f"Clients give up on a request after {args.client_timeout:g} s.")

    async def run(self) -> int:
        args, script = self.args, self.script
        self.intro()
        print(f"starting {2 * INSTANCES} fake vLLM instances and the gateway ...", flush=True)
        screen = Screen(sys.stdout) if self.live else None
        timelines: list[asyncio.Task[None]] = []
        monitor: asyncio.Task[None] | None = None
        ledgers: list[JsonlWriter] = []
        try:
            await asyncio.gather(*(self._start_cluster(mode) for mode in MODES))
            gw = self.clusters["gateway"].gateway
            assert gw is not None
            print(
                f"gateway on http://{gw.ready['data']}, its state on"
                f" http://{gw.ready['admin']}/admin/state\n",
                flush=True,
            )
            progress = {mode: Progress() for mode in MODES}
            t0 = time.perf_counter()
            for p in progress.values():
                p.t0 = t0  # one clock for both sides: same sends, same faults, same moments
            sides = {
                "gateway": Side("through the gateway", script, progress["gateway"]),
                "direct": Side("direct, round robin", script, progress["direct"]),
            }
            played: list[Timeline] = []
            for mode in MODES:
                events = JsonlWriter(self.workdir / mode / "events.jsonl", flush_every=1)
                ledgers.append(events)
                timeline = Timeline(
                    self.clusters[mode],
                    script.steps(),
                    planned_s=script.seconds,
                    clock=progress[mode].elapsed,
                    events=events,
                )
                played.append(timeline)
                timelines.append(asyncio.create_task(timeline.run(progress[mode])))
            if screen is not None:
                screen.open()
            monitor = asyncio.create_task(self._monitor(sides, progress["gateway"], screen))
            loads = []
            for mode in MODES:
                ledger = JsonlWriter(self.workdir / mode / "ledger.jsonl")
                ledgers.append(ledger)
                loads.append(
                    run_load(
                        workload(args.seed),
                        {MODEL: self._targets(mode)},
                        ledger,
                        rate=args.rate,
                        requests=int(args.rate * script.seconds * 2) + 100,
                        time_limit=script.seconds,
                        request_timeout=args.client_timeout,
                        drain_timeout=args.client_timeout + 2.0,
                        progress=progress[mode],
                        on_record=sides[mode].add,
                    )
                )
            await asyncio.gather(*loads)
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
            await self._refresh(progress["gateway"].elapsed())
            if screen is not None:
                screen.draw(self._frame(sides, progress["gateway"].elapsed()))
            else:
                print(self._plain(sides, progress["gateway"].elapsed()))
        finally:
            if monitor is not None:
                monitor.cancel()
            for task in timelines:
                task.cancel()
            await asyncio.gather(*timelines, return_exceptions=True)
            if screen is not None:
                screen.close()
            for writer in ledgers:
                writer.close()
            await asyncio.gather(*(c.close() for c in self.clusters.values()))
        left = self.leftovers()
        errors = [error for timeline in played for error in timeline.errors]
        for line in summary(script, sides["gateway"], sides["direct"], self.view, self.paint):
            print(line)
        for error in errors:
            print(f" warning: a fault action failed: {error}")
        pids = " ".join(str(p.pid) for p in self.started)
        print(
            f" Stopped the {len(self.started)} processes the demo started; {len(left)} left"
            f" running.\n (pids {pids})\n"
        )
        print(self.paint(final_line(sides["gateway"], sides["direct"]), "1"), flush=True)
        return 1 if errors or left else 0

    def _targets(self, mode: str) -> list[Target]:
        cluster = self.clusters[mode]
        if mode == "gateway":
            assert cluster.gateway is not None
            return [Target("gateway", f"http://{cluster.gateway.ready['data']}", gateway=True)]
        return [Target(inst.name, inst.url) for inst in cluster.instances.values()]

    async def _refresh(self, now: float) -> None:
        state: dict[str, Any] | None = await self.clusters["gateway"].gateway_state()
        if state is not None:
            self.view.update(state, now)

    def _frame(self, sides: dict[str, Side], elapsed: float) -> list[str]:
        return frame(elapsed, self.script, sides["gateway"], sides["direct"], self.view, self.paint)

    def _plain(self, sides: dict[str, Side], elapsed: float) -> str:
        return plain_line(elapsed, sides["gateway"], sides["direct"], self.view)

    async def _monitor(
        self, sides: dict[str, Side], progress: Progress, screen: Screen | None
    ) -> None:
        """Refresh the view every REFRESH_S; plain mode prints a line every few seconds and
        each fault as it happens."""
        every = max(1.0, 4.0 * self.script.scale)
        next_line = 0.0
        events = self.script.events()
        while True:
            elapsed = progress.elapsed()
            await self._refresh(elapsed)
            if screen is not None:
                screen.draw(self._frame(sides, elapsed))
            else:
                while events and events[0][0] <= elapsed:
                    at, story = events.pop(0)
                    print(f"[{at:5.1f} s] >>> {story}", flush=True)
                if elapsed >= next_line:
                    print(self._plain(sides, elapsed), flush=True)
                    next_line += every
            await asyncio.sleep(REFRESH_S)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=BASE_S,
        help=f"length of the traffic; the fault script scales with it (default {BASE_S:g})",
    )
    parser.add_argument("--no-live", action="store_true", help="plain output, no live view")
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s each way")
    parser.add_argument(
        "--client-timeout", type=float, default=10.0, help="seconds a client waits at most"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--keep", action="store_true", help="keep the ledgers and logs (the path is printed)"
    )
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rate <= 0 or args.client_timeout <= 0:
        parser.error("--seconds, --rate and --client-timeout must be > 0")
    signal.signal(signal.SIGTERM, _terminate)
    demo = Demo(args)
    try:
        return asyncio.run(demo.run())
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process the demo started", file=sys.stderr)
        return 130
    finally:
        demo.stop_leftovers()
        if args.keep:
            print(f"ledgers, fault events and the gateway's log: {demo.workdir}")
        else:
            shutil.rmtree(demo.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
