"""Fake vLLM engines behind a gateway with a one-pool policy: what the admission benchmarks
start. Loopback only; every process started is stopped, even on failure."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from loadtests.procs import ManagedProcess, gateway_process, python_module


@contextmanager
def engines(names: Sequence[str], fake_args: Sequence[str]) -> Iterator[dict[str, ManagedProcess]]:
    """One fake vLLM per name, serving model `m` with the engine model `fake_args` give."""
    started: dict[str, ManagedProcess] = {}
    try:
        for name in names:
            started[name] = ManagedProcess(
                python_module(
                    "loadtests.fake_vllm", "--name", name, "--models", "m", "--seed", "3",
                    *fake_args,
                )
            )  # fmt: skip
        yield started
    finally:
        for proc in started.values():
            proc.stop()


def url(proc: ManagedProcess) -> str:
    return f"http://127.0.0.1:{proc.port()}"


def one_pool_policy(fakes: dict[str, ManagedProcess], pool_settings: str = "") -> str:
    """One pool, `chat`, with model `m` and these instances, plus `pool_settings` (YAML lines
    indented for the pool): with none, what a new user writes first."""
    instances = ", ".join(f'{{name: {n}, url: "{url(p)}"}}' for n, p in fakes.items())
    return f"""
listen: 127.0.0.1:0
admin: {{listen: 127.0.0.1:0}}
pools:
  chat:
    models: [m]
    instances: [{instances}]
{pool_settings}
"""


@contextmanager
def gateway(policy: str) -> Iterator[ManagedProcess]:
    """`gateway run` on `policy`, written to a fresh folder."""
    path = Path(tempfile.mkdtemp(prefix="engine-pool-")) / "policy.yaml"
    path.write_text(policy)
    with gateway_process(path) as proc:
        yield proc
