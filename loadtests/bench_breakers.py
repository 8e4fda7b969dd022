"""Breakers and health checks, measured: how fast a dead instance is isolated and how many
attempts reach it first, how fast a restarted one is back, and what health checks cost.

    python -m loadtests.bench_breakers

Loopback only; every process it starts is stopped at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from loadtests.ports import close_all, hold_ports
from loadtests.procs import ManagedProcess, gateway_process, python_module

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def fake(name: str, port: int = 0) -> ManagedProcess:
    return ManagedProcess(
        python_module(
            "loadtests.fake_vllm",
            "--port",
            str(port),
            "--name",
            name,
            "--models",
            "m",
            "--ttft",
            "0.01",
            "--per-token",
            "0.001",
        )
    )


def gateway(policy: str) -> ManagedProcess:
    path = Path(tempfile.mkdtemp(prefix="bench-breakers-")) / "policy.yaml"
    path.write_text(policy)
    return gateway_process(path)


def health_check_cost(instances: int = 50, seconds: float = 20.0) -> dict[str, float]:
    with ExitStack() as stack:
        backend = stack.enter_context(fake("h"))
        url = f"http://127.0.0.1:{backend.port()}"
        listing = ", ".join(f'{{name: i{n}, url: "{url}"}}' for n in range(instances))
        gw = stack.enter_context(
            gateway(
                "listen: 127.0.0.1:0\nadmin: {listen: 127.0.0.1:0}\npools:\n"
                f"  p: {{models: [m], instances: [{listing}], "
                "health: {interval: 2s, timeout: 1s}}\n"
            )
        )
        time.sleep(1.0)
        before = cpu_s(gw.pid)
        time.sleep(seconds)
        used = cpu_s(gw.pid) - before
        return {"instances": instances, "seconds": seconds, "cpu_percent": 100 * used / seconds}


async def _state(admin: str, name: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"http://{admin}/admin/state")).json()
    for inst in state["pools"]["p"]["instances"]:
        if inst["name"] == name:
            found: dict[str, Any] = inst
            return found
    raise KeyError(name)


async def isolation_and_recovery(rate: float = 100.0) -> dict[str, float]:
    with ExitStack() as stack:
        return await _isolation_and_recovery(stack, rate)


async def _isolation_and_recovery(stack: ExitStack, rate: float) -> dict[str, float]:
    # k2 is killed and started again on its port: held from here to the end (see
    # loadtests/ports.py), so that nothing takes it while k2 is down.
    holds = hold_ports(3)
    stack.callback(close_all, holds)
    ports = [hold.port for hold in holds]
    backends: list[ManagedProcess] = []

    def stop_backends() -> None:
        for backend in backends:
            backend.stop()

    stack.callback(stop_backends)
    for n in range(3):
        backends.append(fake(f"k{n}", ports[n]))
    listing = ", ".join(f'{{name: k{n}, url: "http://127.0.0.1:{ports[n]}"}}' for n in range(3))
    gw = stack.enter_context(
        gateway(
            "listen: 127.0.0.1:0\nadmin: {listen: 127.0.0.1:0}\npools:\n"
            f"  p: {{models: [m], instances: [{listing}], "
            "health: {interval: 2s, timeout: 1s}}\n"
        )
    )
    admin = gw.ready["admin"]
    url = f"http://{gw.ready['data']}/v1/chat/completions"
    results: list[int] = []
    pending: set[asyncio.Task[None]] = set()
    stop = asyncio.Event()

    async def traffic(session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        n = 0
        while not stop.is_set():
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - loop.time()))

            async def one() -> None:
                async with session.post(url, json={"model": "m", "max_tokens": 8}) as r:
                    await r.read()
                    results.append(r.status)

            pending.add(task := loop.create_task(one()))
            task.add_done_callback(pending.discard)

    async with aiohttp.ClientSession() as session:
        sender = asyncio.create_task(traffic(session))
        await asyncio.sleep(3.0)  # warm: every instance learned and admitting
        before = (await _state(admin, "k2"))["requests"]
        killed_at = time.monotonic()
        os.kill(backends[2].pid, signal.SIGKILL)
        # Another process's state: there is nothing to await but its admin plane.
        while (await _state(admin, "k2"))["state"] == "ADMITTING":  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        isolated_after = time.monotonic() - killed_at
        attempts_to_dead = (await _state(admin, "k2"))["requests"] - before
        await asyncio.sleep(2.0)
        backends[2] = fake("k2", ports[2])
        restarted_at = time.monotonic()
        while (await _state(admin, "k2"))["state"] != "ADMITTING":  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        back_after = time.monotonic() - restarted_at
        await asyncio.sleep(1.0)
        stop.set()
        await sender
        await asyncio.sleep(0.5)
    ok = sum(1 for s in results if s == 200)
    return {
        "kill_to_isolation_s": isolated_after,
        "attempts_to_dead_instance": attempts_to_dead,
        "restart_to_admitting_s": back_after,
        "client_requests": len(results),
        "client_failures": len(results) - ok,
    }


def main() -> None:
    print("health checks:", health_check_cost())
    print("dead instance:", asyncio.run(isolation_and_recovery()))


if __name__ == "__main__":
    main()
