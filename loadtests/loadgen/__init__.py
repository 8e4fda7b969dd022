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

Modules: `workload` (what to send), `arrivals` (when), `client` (one request -> one Record),
`sse` (stream scanning), `generator` (the open loop), `progress` (counters and `wait_sent`),
`stats` (histogram, CPU, RSS, LoadStats), `cli` (`python -m loadtests.loadgen`).
"""

from loadtests.loadgen.arrivals import ARRIVALS, Arrival, arrival_times
from loadtests.loadgen.client import Target
from loadtests.loadgen.generator import CANCELLED, run_load
from loadtests.loadgen.progress import Progress
from loadtests.loadgen.stats import Histogram, LoadStats
from loadtests.loadgen.workload import RequestPlan, WorkloadSpec, plans

__all__ = [
    "ARRIVALS",
    "CANCELLED",
    "Arrival",
    "Histogram",
    "LoadStats",
    "Progress",
    "RequestPlan",
    "Target",
    "WorkloadSpec",
    "arrival_times",
    "plans",
    "run_load",
]
