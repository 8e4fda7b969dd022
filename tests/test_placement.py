"""Where a chaos run puts the gateway and the rest (`loadtests.chaos.placement`), and a child
started on given CPUs runs only there."""

from __future__ import annotations

import os
import sys

from loadtests.chaos.placement import SHARED, SPLIT_FROM, plan
from loadtests.procs import ManagedProcess

CPUS = sorted(os.sched_getaffinity(0))


def test_shared_and_real_engines_leave_every_process_on_every_cpu() -> None:
    assert plan("shared", real_engines=False) == SHARED
    assert plan("auto", real_engines=True) == SHARED
    assert SHARED.describe().startswith("shared")


def test_a_split_gives_the_gateway_the_last_cpu_and_the_rest_the_others() -> None:
    placement = plan("split", real_engines=True)  # asked for: even for real engines
    if len(CPUS) < 2:
        assert placement == SHARED  # nothing to split
        return
    assert placement.gateway == frozenset(CPUS[-1:])
    assert placement.rest == frozenset(CPUS[:-1])
    auto = plan("auto", real_engines=False)
    assert auto == (placement if len(CPUS) >= SPLIT_FROM else SHARED)
    before = os.sched_getaffinity(0)
    with placement.applied():
        assert os.sched_getaffinity(0) == placement.rest
    assert os.sched_getaffinity(0) == before


def test_a_child_started_on_given_cpus_runs_only_there() -> None:
    cpus = frozenset(CPUS[-1:])
    code = "import os; print('READY cpus=' + ','.join(map(str, sorted(os.sched_getaffinity(0)))))"
    argv = [sys.executable, "-c", f"{code}; import time; time.sleep(30)"]
    child = ManagedProcess(argv, cpus=cpus)
    try:
        assert child.ready["cpus"] == str(CPUS[-1])
    finally:
        child.stop()
