"""Session-wide safety net: no server a test started outlives the test session.

Fixtures and tests stop what they start; this catches what a failure left behind anyway (a
start that raised after another had succeeded, a test body that failed before its `finally`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from loadtests import procs


@pytest.fixture(scope="session", autouse=True)
def _stop_leftover_processes() -> Iterator[None]:
    yield
    leftovers = procs.running()
    for proc in leftovers:
        proc.stop()
    if leftovers:
        listed = "\n".join(f"  pid {p.pid}: {' '.join(p.argv)}" for p in leftovers)
        print(f"\nstopped {len(leftovers)} process(es) left running:\n{listed}", file=sys.stderr)
