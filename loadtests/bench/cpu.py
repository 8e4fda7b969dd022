"""CPU placement and CPU-time accounting of benchmark processes (Linux /proc and affinity)."""

from __future__ import annotations

import os
from dataclasses import dataclass

CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Placement:
    """Where things run: the system under test on `proxy_core`, everything else on `load_core`.

    With fewer than two usable CPUs nothing is pinned and both fields are None.
    """

    proxy_core: int | None
    load_core: int | None

    @property
    def pinned(self) -> bool:
        return self.proxy_core is not None

    def describe(self) -> str:
        if not self.pinned:
            return "not pinned (fewer than 2 CPUs available)"
        return (
            f"proxies on CPU {self.proxy_core}; "
            f"upstreams and load generators on CPU {self.load_core}"
        )


def choose_placement() -> Placement:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return Placement(None, None)
    return Placement(cpus[0], cpus[1])


def pin_self(cpu: int | None) -> None:
    """Pin the calling thread; children started afterwards inherit it (so wrk, nginx and the
    fake backends land on the load core without any wrapper)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def pin_process(pid: int, cpu: int | None) -> None:
    """Pin every thread of a running process: affinity is per thread on Linux, and threads
    created later inherit it from their creator."""
    if cpu is None:
        return
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except (ProcessLookupError, FileNotFoundError):
            continue  # the thread ended meanwhile


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds a process spent in user space and in the kernel (all threads)."""

    user_s: float
    system_s: float

    @property
    def total_s(self) -> float:
        return self.user_s + self.system_s

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user_s - other.user_s, self.system_s - other.system_s)

    def __add__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user_s + other.user_s, self.system_s + other.system_s)


def cpu_times(pid: int) -> CpuTimes:
    """utime and stime of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return CpuTimes(int(fields[11]) * CLOCK_TICK_S, int(fields[12]) * CLOCK_TICK_S)


def tree_cpu_times(pid: int) -> CpuTimes:
    """`cpu_times` of a process and of every process below it: nginx's master and its worker,
    a gateway and its workers. A child that ended meanwhile is left out."""
    total = CpuTimes(0.0, 0.0)
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            total = total + cpu_times(current)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    todo += [int(child) for child in children.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total
