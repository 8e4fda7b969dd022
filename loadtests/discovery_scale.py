"""How fast traffic follows discovery, and what a scale from 2 to 6 instances and back costs.

Six fake vLLMs listen on 127.0.0.2 to 127.0.0.7, one port (pods behind one Service); a gateway
whose pool lists no instance discovers them, from a real DNS server (dnsmasq: A records of a
name, the TTL `--ttl`) or from a local Kubernetes API (EndpointSlices, list and watch). Clients
keep asking the gateway (half streams, half whole answers) while the records go from 2 backends
to 6 and back, `--cycles` times. A backend dropped from the records is stopped (SIGTERM: it
finishes what it runs) once the gateway has let it go.

Measured, from the moment the change is served (dnsmasq answers with the new records; the API
has the new slice):
- **up**: until the first request reaches a new backend, and until every new one had one;
- **down**: until the last request that reached a removed backend started there;
- every request's ending (a full answer, a stream ending in `[DONE]`, or the failure).

    python -m loadtests.discovery_scale --source dns --source kubernetes --out out/discovery.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.dnsmasq import DnsServer
from loadtests.fake_kube_api import FakeKubeApi, endpoint
from loadtests.ports import hold_port
from loadtests.procs import ManagedProcess, gateway_process, python_module, wait_until

NAME = "vllm.test"
NAMESPACE = "models"
HOSTS = [f"127.0.0.{n}" for n in range(2, 8)]
FEW = HOSTS[:2]


@dataclass
class Run:
    source: str
    cycles: int
    clients: int
    requests: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    up_first_s: list[float] = field(default_factory=list)  # change -> first request on a new one
    up_all_s: list[float] = field(default_factory=list)  # change -> every new one had a request
    down_last_s: list[float] = field(default_factory=list)  # change -> last start on a removed one


class Records:
    """Where the gateway learns which hosts serve: DNS or the Kubernetes API."""

    def __init__(self, source: str, port: int, workdir: Path, ttl_s: int) -> None:
        self.source = source
        self.port = port
        self.dns: DnsServer | None = None
        self.api: FakeKubeApi | None = None
        if source == "dns":
            self.dns = DnsServer(workdir, ttl_s=ttl_s)
        else:
            self.api = FakeKubeApi().start()
            self.kubeconfig = self.api.kubeconfig(workdir / "kubeconfig", NAMESPACE)

    def policy(self) -> str:
        if self.dns is not None:
            return f'dns: {{name: {NAME}, port: {self.port}, nameservers: ["{self.dns.address}"]}}'
        return f"kubernetes: {{namespace: {NAMESPACE}, service: vllm, port: http}}"

    def env(self) -> dict[str, str]:
        return {} if self.api is None else {"KUBECONFIG": str(self.kubeconfig)}

    def serve(self, hosts: Sequence[str], starting: Sequence[str] = ()) -> None:
        """These hosts serve (and those `starting`: in Kubernetes, not ready yet; a removed
        one is terminating while it still runs)."""
        if self.dns is not None:
            self.dns.set_hosts({NAME: list(hosts)})
            return
        assert self.api is not None
        endpoints = [endpoint(h, f"vllm-{h.rsplit('.', 1)[1]}") for h in hosts]
        endpoints += [endpoint(h, f"vllm-{h.rsplit('.', 1)[1]}", ready=False) for h in starting]
        self.api.put_slice(
            "vllm-1", NAMESPACE, "vllm", endpoints, [{"name": "http", "port": self.port}]
        )

    def terminating(self, hosts: Sequence[str], gone: Sequence[str]) -> None:
        if self.dns is not None:
            self.serve(hosts)
            return
        assert self.api is not None
        endpoints = [endpoint(h, f"vllm-{h.rsplit('.', 1)[1]}") for h in hosts]
        endpoints += [
            endpoint(h, f"vllm-{h.rsplit('.', 1)[1]}", ready=False, serving=True, terminating=True)
            for h in gone
        ]
        self.api.put_slice(
            "vllm-1", NAMESPACE, "vllm", endpoints, [{"name": "http", "port": self.port}]
        )

    def close(self) -> None:
        if self.dns is not None:
            self.dns.stop()
        if self.api is not None:
            self.api.stop()


class Backends:
    def __init__(self, port: int) -> None:
        self.port = port
        self.procs: dict[str, ManagedProcess] = {}

    def start(self, host: str) -> None:
        argv = python_module(
            "loadtests.fake_vllm",
            *("--host", host, "--port", str(self.port), "--name", host, "--models", "m"),
            *("--per-token", "0.005"),
        )
        self.procs[host] = ManagedProcess(argv)

    def starts(self, host: str, since: float) -> list[float]:
        """Wall-clock starts of the requests the backend on `host` received after `since`."""
        url = f"http://{host}:{self.port}/_fake/requests"
        records = httpx.get(url, timeout=10).json()
        return sorted(r["started"] for r in records if r["started"] >= since)

    def stop(self, host: str) -> None:
        proc = self.procs.pop(host, None)
        if proc is not None:
            proc.stop()

    def close(self) -> None:
        for host in list(self.procs):
            self.stop(host)


class Clients:
    """Threads asking the gateway in a loop until stopped (bounded by `limit_s`)."""

    def __init__(self, url: str, count: int, limit_s: float) -> None:
        self.url = url
        self.endings: list[str] = []  # "ok" or what went wrong
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(count)
        self._limit_s = limit_s
        for index in range(count):
            self._pool.submit(self._loop, index % 2 == 0)

    def _loop(self, stream: bool) -> None:
        body: dict[str, Any] = {
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 32,
            "stream": stream,
        }
        deadline = time.monotonic() + self._limit_s
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    response = client.post(f"{self.url}/v1/chat/completions", json=body)
                    if response.status_code != 200:
                        self.endings.append(f"HTTP {response.status_code}")
                    elif stream and not response.text.rstrip().endswith("data: [DONE]"):
                        self.endings.append("stream without [DONE]")
                    else:
                        self.endings.append("ok")
                except httpx.HTTPError as exc:
                    self.endings.append(type(exc).__name__)

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)


def _instances(admin: str) -> list[str]:
    state = httpx.get(f"{admin}/admin/state", timeout=10).json()
    return [i["name"] for i in state["pools"]["chat"]["instances"]]


@contextmanager
def _setup(source: str, ttl_s: int) -> Iterator[tuple[Records, Backends, str, str]]:
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        hold = hold_port()
        stack.callback(hold.close)
        backends = Backends(hold.port)
        stack.callback(backends.close)
        for host in HOSTS:
            backends.start(host)
        records = Records(source, hold.port, workdir, ttl_s)
        stack.callback(records.close)
        records.serve(FEW)
        policy = workdir / "policy.yaml"
        policy.write_text(
            "listen: 127.0.0.1:0\nadmin: {listen: 127.0.0.1:0}\n"
            "pools:\n  chat:\n    models: [m]\n"
            f"    discovery:\n      {records.policy()}\n"
        )
        gateway = gateway_process(policy, records.env())
        stack.callback(gateway.stop)
        yield (
            records,
            backends,
            f"http://{gateway.ready['data']}",
            f"http://{gateway.ready['admin']}",
        )


def _first_starts(
    backends: Backends, hosts: Sequence[str], since: float, within_s: float
) -> dict[str, float]:
    """The first request start after `since` on each host (waited for, bounded)."""
    firsts: dict[str, float] = {}

    def all_seen() -> bool:
        for host in hosts:
            if host not in firsts:
                starts = backends.starts(host, since)
                if starts:
                    firsts[host] = starts[0]
        return len(firsts) == len(hosts)

    wait_until(all_seen, timeout_s=within_s, interval_s=0.1)
    return firsts


def measure(source: str, cycles: int, clients: int, ttl_s: int, settle_s: float) -> Run:
    run = Run(source, cycles, clients)
    new = [h for h in HOSTS if h not in FEW]
    with _setup(source, ttl_s) as (records, backends, url, admin):
        wait_until(lambda: len(_instances(admin)) == len(FEW), timeout_s=30, interval_s=0.1)
        load = Clients(url, clients, limit_s=60 + cycles * 6 * settle_s)
        try:
            time.sleep(settle_s)
            for cycle in range(cycles):
                if cycle:  # the removed backends come back, as new pods of the next scale-up
                    for host in new:
                        backends.start(host)
                if source == "kubernetes":
                    records.serve(FEW, starting=new)  # new pods: not ready at first
                    time.sleep(0.5)
                records.serve(HOSTS)
                changed = time.time()
                firsts = _first_starts(backends, new, changed, within_s=60)
                if firsts:
                    run.up_first_s.append(min(firsts.values()) - changed)
                if len(firsts) == len(new):
                    run.up_all_s.append(max(firsts.values()) - changed)
                time.sleep(settle_s)

                records.terminating(FEW, new)
                changed = time.time()
                wait_until(
                    lambda: len(_instances(admin)) == len(FEW), timeout_s=60, interval_s=0.05
                )
                time.sleep(settle_s / 2)  # anything still sent there would show now
                last = max(
                    (s for host in new for s in backends.starts(host, changed)), default=changed
                )
                run.down_last_s.append(last - changed)
                for host in new:
                    backends.stop(host)  # SIGTERM: they finish what they run
                records.serve(FEW)
                time.sleep(settle_s)
        finally:
            load.stop()
    run.requests = len(load.endings)
    for ending in load.endings:
        if ending != "ok":
            run.failed += 1
            run.failures[ending] = run.failures.get(ending, 0) + 1
    return run


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    return (
        f"median {statistics.median(values) * 1000:.0f} ms, "
        f"max {max(values) * 1000:.0f} ms (n={len(values)})"
    )


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", choices=["dns", "kubernetes"])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--ttl", type=int, default=5, help="the DNS records' TTL, seconds")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds between changes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    runs = [
        measure(source, args.cycles, args.clients, args.ttl, args.settle)
        for source in args.source or ["dns", "kubernetes"]
    ]
    for run in runs:
        out(f"{run.source}: {run.requests} requests, {run.failed} failed {run.failures or ''}")
        out(f"  up, first request on a new instance: {_summary(run.up_first_s)}")
        out(f"  up, every new instance had one:      {_summary(run.up_all_s)}")
        out(f"  down, last request to a removed one: {_summary(run.down_last_s)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(run) for run in runs], indent=2))
    return runs


if __name__ == "__main__":
    main()
