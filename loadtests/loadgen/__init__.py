"""The load generator of the load tests: open-loop, seeded, one ledger record per request.

    from loadtests.loadgen import Progress, Target, WorkloadSpec, run_load

    gateway = [Target("gateway", url, gateway=True)]
    progress = Progress()
    stats = await run_load(
        WorkloadSpec(models=["m1", "m2"], seed=1),
        {"m1": gateway, "m2": gateway},  # direct: {"m1": [Target("a", url_a), ...], ...}
        JsonlWriter(path),
        rate=200, requests=20_000, time_limit=600, progress=progress,
    )

Step load and priority classes: `run_load(..., rate_steps=((0, 100), (20, 300)))` and
`WorkloadSpec(..., priorities=(("interactive", 0.2), ("batch", 0.8)))`; afterwards
`per_class_summary(read_records(path), since=20)` gives each class's figures.

Modules: `workload` (what to send), `arrivals` (when), `client` (one request -> one Record),
`sse` (stream scanning), `generator` (the open loop), `progress` (counters and `wait_sent`),
`stats` (histogram, CPU, RSS, LoadStats), `classes` (figures per priority class),
`cli` (`python -m loadtests.loadgen`).
"""

from loadtests.loadgen.arrivals import ARRIVALS, Arrival, arrival_times, parse_rate_steps
from loadtests.loadgen.classes import NO_CLASS, ClassSummary, ClassTally, per_class_summary
from loadtests.loadgen.client import Target
from loadtests.loadgen.generator import CANCELLED, run_load
from loadtests.loadgen.progress import Progress
from loadtests.loadgen.stats import Histogram, LoadStats
from loadtests.loadgen.workload import (
    PRIORITIES,
    RequestPlan,
    WorkloadSpec,
    parse_priority_mix,
    plans,
)

__all__ = [
    "ARRIVALS",
    "CANCELLED",
    "NO_CLASS",
    "PRIORITIES",
    "Arrival",
    "ClassSummary",
    "ClassTally",
    "Histogram",
    "LoadStats",
    "Progress",
    "RequestPlan",
    "Target",
    "WorkloadSpec",
    "arrival_times",
    "parse_priority_mix",
    "parse_rate_steps",
    "per_class_summary",
    "plans",
    "run_load",
]
