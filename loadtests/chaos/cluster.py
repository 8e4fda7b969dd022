"""The processes of one chaos run: backend instances, TCP fault proxies, the gateway.

Instances are fake vLLM servers, or real engines (llama.cpp's server, see
loadtests/chaos/engines.py) when the scenario's backend says `engine:`. A real engine has no
fault knobs (the fake's `/_fake/` control endpoints): the scenario refuses `set`/`clear` steps
for it, and the knob methods here refuse its instances.

Each instance keeps its port for the whole run, so a killed or stopped instance can be started
again where clients and the gateway expect it. The cluster holds each such port from the start
to the end of the run (loadtests/ports.py): while an instance is down its port refuses
connections, and no other process can take it meanwhile. Instances that a scenario degrades at
the network level get a fault proxy in front of them from the start, and their URL is the
proxy's.

A scenario that shares decisions (`shared: true`, or a fault step on target `redis`) also gets a
real redis-server on a loopback port, started with the backends and kept on that port through
kills and restarts (each restart is empty: it keeps nothing on disk). The gateway's policy points
its `shared:` section at it; in direct mode it runs all the same, unused, so that both modes play
the same timeline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtests.chaos.engines import EngineLauncher
from loadtests.chaos.placement import SHARED, CpuPlacement
from loadtests.chaos.scenario import EngineBackendSpec, Scenario
from loadtests.engine.server import Engine
from loadtests.ports import PortHold, close_all, hold_port
from loadtests.procs import ManagedProcess, gateway_process, python_module
from loadtests.redis_server import RedisServer

REDIS_KEY_PREFIX = "chaos"
READY_S = 20.0  # how long a fake backend may take to start and announce that it serves


# Transport failures after which a control request is sent again, on a new connection, up to
# CONTROL_ATTEMPTS times in all: the server accepted the connection, then dropped it before it
# answered (a server busy starting or stopping can). A refused connection or a timeout is not
# one of them: an instance that is down or frozen must show as a failed action.
_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
CONTROL_ATTEMPTS = 3
CONTROL_RETRY_PAUSE_S = 0.1


@dataclass
class Instance:
    name: str
    pool: str
    models: list[str]
    port: int
    argv: list[str]  # a fake backend's command line (empty for an engine)
    proc: ManagedProcess | None = None  # a fake backend's process
    proxy: ManagedProcess | None = None
    launcher: EngineLauncher | None = None  # set for a real engine ...
    engine: Engine | None = None  # ... and its process while started
    starts: list[float] = field(default_factory=list)  # run-clock times it was (re)started

    @property
    def backend_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """Where clients and the gateway send: the fault proxy when there is one."""
        if self.proxy is not None:
            return f"http://127.0.0.1:{self.proxy.port()}"
        return self.backend_url

    @property
    def control_url(self) -> str:
        assert self.proxy is not None
        return f"http://127.0.0.1:{self.proxy.port('control')}"

    @property
    def popen(self) -> subprocess.Popen[str] | subprocess.Popen[bytes] | None:
        """The backend's process, fake or engine."""
        handle = self.engine if self.launcher is not None else self.proc
        return None if handle is None else handle.proc

    @property
    def running(self) -> bool:
        popen = self.popen
        return popen is not None and popen.poll() is None


@dataclass
class Standby:
    """A fake backend's replacement, booted ahead (`Cluster.boot_standby`): it serves once
    `trigger` exists; `launch` ends once it serves (or has exited)."""

    name: str
    trigger: Path
    launch: asyncio.Future[object]

    @property
    def booted(self) -> bool:
        return Path(f"{self.trigger}.booted").exists()

    def cancel(self) -> None:
        Path(f"{self.trigger}.cancel").touch()


class Cluster:
    def __init__(self, scenario: Scenario, workdir: Path, placement: CpuPlacement = SHARED) -> None:
        self.scenario = scenario
        self.workdir = workdir
        self.placement = placement
        self.instances: dict[str, Instance] = {}
        self.gateway: ManagedProcess | None = None
        self.redis: RedisServer | None = None
        self.redis_starts: list[float] = []  # run-clock times Redis was (re)started
        # A new connection for every control request: a kept-alive one can be closed by the
        # server (its idle timeout, or a restart of the instance) just as a request is sent on
        # it, and the request then fails with "Server disconnected" though the server is up.
        self._http = httpx.AsyncClient(
            timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self._holds: list[PortHold] = []
        # Process starts still running in a thread: `close` waits for them, so that a start the
        # run's end cancelled still has its process stopped.
        self._launches: set[asyncio.Future[object]] = set()
        self._standbys = 0  # replacements booted ahead so far (`boot_standby`) ...
        self._unserved: list[Standby] = []  # ... and those not told to serve yet
        self._proxied = {step.target for step in scenario.faults if step.action == "network"}
        try:
            self._plan_instances()
        except BaseException:
            close_all(self._holds)
            raise

    def _plan_instances(self) -> None:
        scenario, backend, workdir = self.scenario, self.scenario.backend, self.workdir
        index = 0
        for pool, spec in scenario.pools.items():
            for i in range(spec.instances):
                name = f"{pool}-{i}"
                hold = hold_port()
                self._holds.append(hold)
                port = hold.port
                if isinstance(backend, EngineBackendSpec):
                    launcher = EngineLauncher(name, backend, port, spec.models[0], workdir)
                    self.instances[name] = Instance(
                        name, pool, list(spec.models), port, [], launcher=launcher
                    )
                    continue
                argv = python_module(
                    "loadtests.fake_vllm",
                    *("--port", str(port), "--name", name, "--models", ",".join(spec.models)),
                    *("--ttft", str(backend.ttft), "--per-token", str(backend.per_token)),
                    *("--tokens-per-event", str(backend.tokens_per_event)),
                    *("--seed", str(scenario.seed * 1000 + index)),
                )
                self.instances[name] = Instance(name, pool, list(spec.models), port, argv)
                index += 1

    # --- lifecycle -----------------------------------------------------------------------

    def start_all(self) -> None:
        if self.scenario.uses_redis():
            self.redis = RedisServer()
            self.redis_starts.append(0.0)
        self._start_engines()
        for inst in self.instances.values():
            if inst.launcher is None:
                inst.proc = ManagedProcess(inst.argv)
            inst.starts.append(0.0)
            if inst.name in self._proxied:
                inst.proxy = ManagedProcess(
                    python_module(
                        "loadtests.chaos.tcpproxy",
                        *("--listen-port", "0", "--upstream", f"127.0.0.1:{inst.port}"),
                        *("--control-port", "0", "--seed", str(self.scenario.seed)),
                    )
                )

    async def launch_all(self) -> None:
        """`start_all` in a thread that `close` waits for (see `_launch`)."""
        await self._launch(self.start_all)

    async def launch_gateway(self) -> str:
        """`start_gateway` in a thread that `close` waits for; returns the gateway's URL."""
        await self._launch(self.start_gateway)
        assert self.gateway is not None
        return f"http://{self.gateway.ready['data']}"

    def _start_engines(self) -> None:
        """Every engine at once (each takes a second or more to load its model); each one that
        started is recorded before any failure is raised, so that `close` stops it."""
        engines = [inst for inst in self.instances.values() if inst.launcher is not None]
        if not engines:
            return

        def start(inst: Instance) -> None:
            assert inst.launcher is not None
            inst.engine = inst.launcher.start()

        with ThreadPoolExecutor(len(engines)) as pool:
            for future in [pool.submit(start, inst) for inst in engines]:
                future.result()

    def start_gateway(self) -> str:
        policy_path = self.workdir / "gateway-policy.yaml"
        policy_path.write_text(yaml.safe_dump(self.gateway_policy(), sort_keys=False))
        self.gateway = gateway_process(policy_path, cpus=self.placement.gateway)
        return f"http://{self.gateway.ready['data']}"

    def gateway_policy(self) -> dict[str, Any]:
        pools: dict[str, Any] = {}
        for pool, spec in self.scenario.pools.items():
            pools[pool] = {
                "models": list(spec.models),
                "instances": [
                    {"name": inst.name, "url": inst.url}
                    for inst in self.instances.values()
                    if inst.pool == pool
                ],
                **self.scenario.gateway,
            }
        policy: dict[str, Any] = {"listen": "127.0.0.1:0", "admin": {"listen": "127.0.0.1:0"}}
        if self.redis is not None:
            policy["shared"] = {"redis_url": self.redis.url, "key_prefix": REDIS_KEY_PREFIX}
        policy["pools"] = pools
        return policy

    async def gateway_state(self) -> dict[str, Any] | None:
        if self.gateway is None:
            return None
        try:
            response = await self._control(
                "GET", f"http://{self.gateway.ready['admin']}/admin/state"
            )
            response.raise_for_status()
            state: dict[str, Any] = response.json()
            return state
        except httpx.HTTPError:
            return None

    async def _control(
        self, method: str, url: str, json: dict[str, Any] | None = None
    ) -> httpx.Response:
        """One control request (each of them idempotent: a read, a merge of knobs, a reset),
        sent again if the connection was dropped before the answer came."""
        for attempt in range(1, CONTROL_ATTEMPTS):
            try:
                return await self._http.request(method, url, json=json)
            except _DROPPED:
                await asyncio.sleep(CONTROL_RETRY_PAUSE_S * attempt)
        return await self._http.request(method, url, json=json)

    async def close(self) -> None:
        """Stop every process of the run (even if stopping one fails), then let the ports go."""
        try:
            await self._http.aclose()
            for standby in self._unserved:
                standby.cancel()  # it exits, never having served: its launch fails at once
            if self._launches:
                await asyncio.gather(*self._launches, return_exceptions=True)
            procs = [self.gateway] if self.gateway else []
            for inst in self.instances.values():
                procs.extend(p for p in (inst.proxy, inst.proc) if p is not None)
            # Killed, not stopped: llama-server can hang in its shutdown while a stream is open.
            engines = [inst.engine for inst in self.instances.values() if inst.engine is not None]
            try:
                results = await asyncio.gather(
                    *(asyncio.to_thread(p.stop) for p in procs),
                    *(asyncio.to_thread(e.kill) for e in engines),
                    return_exceptions=True,
                )
            finally:
                # After the gateway, which hands its probe leases back to Redis as it exits.
                try:
                    await self.stop_redis(kill=False)
                finally:
                    if self.redis is not None:
                        await asyncio.to_thread(self.redis.close)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        finally:
            close_all(self._holds)
        if self.gateway is not None:
            # Its log (breaker transitions, shared state lost/connected) for the run directory.
            (self.workdir / "gateway.log").write_text(self.gateway.output() + "\n")

    # --- fault actions -------------------------------------------------------------------

    def _fake(self, name: str) -> Instance:
        """The instance, which must be a fake backend: only it has fault knobs."""
        inst = self.instances[name]
        if inst.launcher is not None:
            raise RuntimeError(f"{name} is a real engine: it has no fault knobs to set or clear")
        return inst

    async def set_faults(self, name: str, knobs: dict[str, Any]) -> dict[str, Any]:
        """Merge knobs into an instance's faults; returns their previous values (to revert)."""
        inst = self._fake(name)
        return await self._merge_knobs(f"{inst.backend_url}/_fake/faults", knobs)

    async def clear_faults(self, name: str) -> None:
        inst = self._fake(name)
        (await self._control("POST", f"{inst.backend_url}/_fake/reset")).raise_for_status()

    async def set_network(self, name: str, knobs: dict[str, Any]) -> dict[str, Any]:
        inst = self.instances[name]
        return await self._merge_knobs(f"{inst.control_url}/faults", knobs)

    async def _merge_knobs(self, url: str, knobs: dict[str, Any]) -> dict[str, Any]:
        """POST knobs to a faults endpoint; returns their values before (to revert)."""
        response = await self._control("GET", url)
        response.raise_for_status()
        before: dict[str, Any] = response.json()
        (await self._control("POST", url, json=knobs)).raise_for_status()
        return {key: before.get(key) for key in knobs}

    def signal(self, name: str, sig: int) -> None:
        inst = self.instances[name]
        popen = inst.popen
        if popen is not None and popen.poll() is None:
            os.kill(popen.pid, sig)

    async def stop(self, name: str, *, kill: bool) -> None:
        inst = self.instances[name]
        popen = inst.popen
        if popen is None:
            return
        if kill:
            self.signal(name, signal.SIGKILL)
            await asyncio.to_thread(popen.wait)
        elif inst.engine is not None:
            # SIGTERM, then SIGKILL after a few seconds: a streaming engine may never exit.
            await asyncio.to_thread(inst.engine.stop)
        elif inst.proc is not None:
            await asyncio.to_thread(inst.proc.stop)

    def boots_ahead(self, name: str) -> bool:
        """Whether the instance's replacement can boot ahead of time and open its port at a
        given moment (`boot_standby`: fake backends can; an engine loads its model only when
        started)."""
        return self.instances[name].launcher is None

    def boot_standby(self, name: str, wait_s: float) -> Standby:
        """Boot a replacement for fake backend `name` now, to serve once `serve_standby` says
        so: a new interpreter's start, seconds on a busy machine and more of them beside a
        gateway, then no longer decides when a killed instance is back, nor differs between
        the direct and the gateway run. It becomes the instance's process once it serves,
        within `wait_s` plus a start's usual wait; one never served exits at `close`."""
        inst = self._fake(name)
        self._standbys += 1
        trigger = self.workdir / f"standby-{self._standbys}-{name}"
        argv = [*inst.argv, "--serve-when", str(trigger)]

        def launch() -> object:
            # It announces itself once it serves, at the end of a kill that may last longer
            # than the usual wait for a start (8 % of a 100,000-request run is 40 s).
            inst.proc = ManagedProcess(argv, ready_timeout_s=READY_S + wait_s)
            return inst.proc

        standby = Standby(name, trigger, self._in_thread(launch))
        self._unserved.append(standby)
        return standby

    async def serve_standby(self, standby: Standby, now: float) -> None:
        """The replacement opens its port now (its instance stopped) and serves."""
        self._unserved.remove(standby)
        standby.trigger.touch()
        await asyncio.shield(standby.launch)
        self.instances[standby.name].starts.append(now)

    async def start(self, name: str, now: float) -> None:
        """Start the instance again (stopping it first if it runs)."""
        inst = self.instances[name]
        if inst.running:
            await self.stop(name, kill=False)

        def launch() -> None:
            if inst.launcher is not None:
                inst.engine = inst.launcher.start()
            else:
                inst.proc = ManagedProcess(inst.argv, ready_timeout_s=READY_S)

        await self._launch(launch)
        inst.starts.append(now)

    async def _launch(self, start: Callable[[], object]) -> None:
        """Run `start` (which records the process it starts) in a thread to its end, even when
        the step awaiting it is cancelled: the thread cannot be stopped, and a process it starts
        after the caller gave up would otherwise outlive the run."""
        await asyncio.shield(self._in_thread(start))

    def _in_thread(self, start: Callable[[], object]) -> asyncio.Future[object]:
        """`start` under way in a thread, which `close` waits for."""
        launch = asyncio.ensure_future(asyncio.to_thread(start))
        self._launches.add(launch)
        launch.add_done_callback(self._launches.discard)
        return launch

    # --- the Redis of shared decisions ---------------------------------------------------

    def _redis(self) -> RedisServer:
        if self.redis is None:
            raise RuntimeError("this scenario runs no Redis")
        return self.redis

    @property
    def redis_running(self) -> bool:
        proc = self.redis.proc if self.redis is not None else None
        return proc is not None and proc.poll() is None

    def signal_redis(self, sig: int) -> None:
        proc = self._redis().proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, sig)

    async def stop_redis(self, *, kill: bool) -> None:
        """SIGKILL, or SIGTERM (a frozen Redis is thawed first so that it can exit)."""
        if self.redis is None or not self.redis_running:
            return
        if kill:
            await asyncio.to_thread(self.redis.kill)
        else:
            self.signal_redis(signal.SIGCONT)
            await asyncio.to_thread(self.redis.stop)

    async def start_redis(self, now: float) -> None:
        """Start Redis again on its port, empty (stopping it first if it still runs)."""
        redis = self._redis()
        await self.stop_redis(kill=False)
        await self._launch(redis.start)
        self.redis_starts.append(now)

    async def pause_redis(self, seconds: float) -> None:
        """CLIENT PAUSE ... ALL: Redis holds every client's commands for that long."""
        await asyncio.to_thread(self._redis().pause, seconds)
