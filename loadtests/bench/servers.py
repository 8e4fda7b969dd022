"""The processes under measurement: fake vLLM backends and the gateway, on loopback ports."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from loadtests.bench.cpu import pin_process
from loadtests.procs import ManagedProcess, gateway_process, python_module


def start_fake_backend(name: str, model: str, *extra: str) -> ManagedProcess:
    argv = python_module(
        "loadtests.fake_vllm", "--port", "0", "--name", name, "--models", model, *extra
    )
    return ManagedProcess(argv)


def gateway_policy(
    pools: Mapping[str, tuple[str, str]], settings: Mapping[str, str] | None = None
) -> str:
    """A policy with one single-instance pool per entry `pool name -> (model, upstream URL)`,
    with `settings` (pool name -> one line of YAML pool keys) where given."""
    lines = ["listen: 127.0.0.1:0", "admin: {listen: 127.0.0.1:0}", "pools:"]
    for pool, (model, url) in pools.items():
        lines += [
            f"  {pool}:",
            f"    models: [{model}]",
            f'    instances: [{{name: {pool}-upstream, url: "{url}"}}]',
        ]
        if settings and pool in settings:
            lines.append(f"    {settings[pool]}")
    return "\n".join(lines) + "\n"


def start_gateway(
    directory: Path,
    pools: Mapping[str, tuple[str, str]],
    cpu: int | None,
    settings: Mapping[str, str] | None = None,
    name: str = "gateway-policy.yaml",
) -> ManagedProcess:
    """`gateway run` on free ports, then moved with all its threads to `cpu`."""
    policy = directory / name
    policy.write_text(gateway_policy(pools, settings))
    return _pinned(gateway_process(policy), cpu)


def _pinned(proc: ManagedProcess, cpu: int | None) -> ManagedProcess:
    """`proc` moved with all its threads to `cpu` (stopped if that fails)."""
    try:
        pin_process(proc.pid, cpu)
    except BaseException:
        proc.stop()
        raise
    return proc


def start_bare_proxy(upstream_url: str, cpu: int | None) -> ManagedProcess:
    """The bare ASGI + aiohttp streaming proxy (`loadtests.bench.bare_proxy`), on `cpu`."""
    argv = python_module("loadtests.bench.bare_proxy", "--upstream", upstream_url)
    return _pinned(ManagedProcess(argv), cpu)


def url_of(proc: ManagedProcess, key: str = "port") -> str:
    return f"http://127.0.0.1:{proc.port(key)}"
