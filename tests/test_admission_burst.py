"""The burst a minimal policy must survive (`loadtests.admission_burst`): steady interactive
requests while a batch client sends 300 requests at three times the backends' capacity (the
benchmark sends 600), through a gateway whose policy names only the pool's model and instances.
For whole answers, streams, and half of each.

Timing is the benchmark's to report (`python -m loadtests.admission_burst`: interactive p99
against the unloaded latency, with admission off and on); this test asserts what must hold on
any machine: every interactive request answered, every batch request answered or shed with
Retry-After, and the engines' own queues kept to a fraction of the burst. And two tenants in
the batch class, one sending ten times the other: each gets about half, where arrival order
would give the small one 1 in 11.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.admission_burst import (
    ENGINES,
    MAX_RUNNING,
    MIXES,
    OOM_ABOVE,
    Burst,
    completion_share,
    run,
    run_tenants,
)

# Half the benchmark's burst: the engines are past capacity from the second second to about the
# eighth, with interactive requests arriving throughout.
BURST = Burst(interactive=50, batch=300, burst_at_s=2.0, unloaded=5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mix", sorted(MIXES))
async def test_a_minimal_policy_protects_interactive_traffic_from_a_batch_burst(
    mix: str, tmp_path: Path
) -> None:
    result = await run(MIXES[mix], "", BURST, tmp_path)
    records = result["records"]
    interactive = [r for r in records if r.priority == "interactive"]
    batch = [r for r in records if r.priority == "batch"]
    assert (len(interactive), len(batch)) == (BURST.interactive, BURST.batch)
    # Every interactive request is answered, in full.
    assert [r for r in interactive if not r.ok] == []
    # Every batch request is answered in full, or shed at once with a time to come back.
    for r in batch:
        if not r.ok:
            assert (r.status, r.shed) == (429, True), r
            assert r.retry_after is not None and int(r.retry_after) >= 1, r
    assert sum(r.ok for r in batch) > BURST.batch // 2  # most of the burst is served
    # The engines queue a fraction of what the burst would put there: without admission,
    # each holds hundreds waiting (the benchmark's table).
    for name, peak in result["engine_peaks"].items():
        assert peak["running"] <= MAX_RUNNING, name
        assert peak["waiting"] <= 2 * MAX_RUNNING, (name, peak)


@pytest.mark.timeout(300)
async def test_an_engine_without_gauges_that_fails_past_its_capacity_is_held_to_it(
    tmp_path: Path,
) -> None:
    # One engine exporting no gauges, failing with CUDA out-of-memory 500s past 40 running:
    # the gateway knows its capacity only by its refusals. Going straight to it (or with
    # admission off), about two thirds of such a burst fail out of memory (the benchmark).
    result = await run(MIXES["half"], "", BURST, tmp_path, ENGINES["no-gauges"])
    records = result["records"]
    interactive = [r for r in records if r.priority == "interactive"]
    batch = [r for r in records if r.priority == "batch"]
    assert (len(interactive), len(batch)) == (BURST.interactive, BURST.batch)
    assert [r for r in interactive if not r.ok] == []
    # A batch request is served, or refused with a time to come back, or (rarely: out of
    # memory on every attempt) failed by the engine.
    failed_by_engine = 0
    for r in batch:
        if not r.ok and r.status >= 500:
            assert r.oom, r
            failed_by_engine += 1
        elif not r.ok:
            assert r.status in (429, 503) and r.retry_after is not None, r
    assert failed_by_engine <= BURST.batch // 100
    assert sum(r.ok for r in batch) > BURST.batch // 2
    # The engine's out-of-memory errors (retried by the gateway) stay a small share: the limit
    # lands near the engine's capacity at the first ones and stays there.
    [peak] = result["engine_peaks"].values()
    assert peak["running"] <= OOM_ABOVE
    assert peak["ooms"] <= BURST.batch // 10, peak


@pytest.mark.timeout(300)
async def test_a_tenant_sending_ten_times_more_gets_no_more_than_its_share(tmp_path: Path) -> None:
    # A shorter batch queue timeout only bounds how long the large tenant's backlog takes to
    # drain after the run; the share is the same with the default.
    tenants = await run_tenants(
        "    admission: {batch: {queue_timeout: 20s}}\n", tmp_path, 8.0, small_share=0.7
    )
    share = completion_share(tenants, 2.0, 8.0)
    # Both have requests waiting throughout: the fair share is half each. Served in arrival
    # order, the small tenant would get 1 in 11 (0.09). The band is ±0.10 because the gateway's
    # queue is not the only one: a request the learned concurrency limit lets through goes to the
    # engine's own queue, served in arrival order, so how many do is the slack. On a loaded
    # machine (timings noisier, the limit learned from them looser) a measured 0.44 was seen.
    assert 0.40 <= share["small"] <= 0.60, share
    # The small tenant asked for less than its half: every one of its requests is answered.
    assert all(r.ok for r in tenants["small"])
    # What the large one sent beyond its share is shed with a time to come back, not lost.
    for r in tenants["big"]:
        assert r.ok or (r.status == 429 and r.shed and r.retry_after is not None), r
