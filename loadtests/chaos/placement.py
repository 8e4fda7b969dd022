"""Which CPUs the gateway and the rest of a chaos run use.

On a small machine the fake engines, the load generator and the gateway compete for the same
cores. In production the engines run on their own accelerators and hosts, so the gateway's CPU
never slows them: a run where it does measures this machine's contention, not the gateway's
routing. `split` gives the gateway one CPU of its own and everything else the rest, in both
modes, so direct and gateway runs give the engines and the load generator the same CPUs.
`shared` leaves every process on every CPU. `auto` splits for fake engines on machines with
`SPLIT_FROM` CPUs or more: on fewer, the rest is one CPU, which the fake engines and the load
generator of a busy scenario overrun by themselves (chaos-mix at 200 requests/s on two CPUs:
the load generator then sends 158/s instead of 200). Real engines always share: they need every
core for their own threads, and their request rates are low, so the gateway's share is small.
Tests running side by side share too, so that they do not pile onto one CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

Choice = Literal["auto", "split", "shared"]
CHOICES: tuple[Choice, ...] = ("auto", "split", "shared")


@dataclass(frozen=True)
class CpuPlacement:
    """`gateway`: the gateway's CPUs; `rest`: everything else's (None: every CPU, shared)."""

    gateway: frozenset[int] | None = None
    rest: frozenset[int] | None = None

    def describe(self) -> str:
        if self.gateway is None or self.rest is None:
            return "shared: every process may use every CPU"
        return (
            f"split: the gateway alone on CPU {_cpus(self.gateway)}; the engines and the load "
            f"generator on CPU {_cpus(self.rest)}, in both modes"
        )

    @contextmanager
    def applied(self) -> Iterator[None]:
        """This process (the load generator, and every child it starts from here on) on `rest`
        for the duration; the gateway is started on `gateway` (see `ManagedProcess`)."""
        if self.rest is None:
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.rest)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)


SHARED = CpuPlacement()
SPLIT_FROM = 4


def plan(choice: Choice, real_engines: bool) -> CpuPlacement:
    """The placement for `choice`; `auto` splits for fake engines when `SPLIT_FROM` CPUs or
    more are available to this process, and shares for real engines."""
    available = sorted(os.sched_getaffinity(0))
    if choice == "shared" or (choice == "auto" and (real_engines or len(available) < SPLIT_FROM)):
        return SHARED
    if len(available) < 2:
        return SHARED  # nothing to split: one CPU for all
    return CpuPlacement(gateway=frozenset(available[-1:]), rest=frozenset(available[:-1]))


def _cpus(cpus: frozenset[int]) -> str:
    return ", ".join(str(c) for c in sorted(cpus))
