"""The load generator against real fake-vLLM subprocesses (behaviour only, no speed thresholds)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtests.ledger import JsonlWriter, Record, read_records
from loadtests.loadgen import (
    CANCELLED,
    Histogram,
    LoadStats,
    Progress,
    Target,
    WorkloadSpec,
    arrival_times,
    plans,
    run_load,
)
from loadtests.loadgen.cli import main as cli_main
from loadtests.loadgen.sse import SseScanner
from tests.support import Backend, closed_port, start_backend

MODELS = ["m1", "m2"]
FAST = ("--ttft", "0", "--per-token", "0.0005", "--tokens-per-event", "4", "--seed", "3")


@pytest.fixture(scope="module")
def backend_a() -> Iterator[Backend]:
    backend = start_backend("a", MODELS, *FAST)
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def backend_b() -> Iterator[Backend]:
    backend = start_backend("b", MODELS, *FAST)
    yield backend
    backend.stop()


@pytest.fixture
def fake(backend_a: Backend) -> Backend:
    backend_a.reset()
    return backend_a


def small(seed: int = 1, **overrides: Any) -> WorkloadSpec:
    """Short requests: small prompts, 8-32 generated tokens."""
    options: dict[str, Any] = {"prompt_tokens": (16, 64), "max_tokens": (8, 32), "seed": seed}
    options.update(overrides)
    return WorkloadSpec(models=list(MODELS), **options)


def to(*backends: Backend) -> dict[str, list[Target]]:
    return {m: [Target(b.name, b.url) for b in backends] for m in MODELS}


async def run(
    tmp_path: Path,
    spec: WorkloadSpec,
    targets: dict[str, list[Target]],
    **options: Any,
) -> tuple[LoadStats, list[Record]]:
    path = tmp_path / "ledger.jsonl"
    writer = JsonlWriter(path)
    try:
        stats = await run_load(spec, targets, writer, **options)
    finally:
        writer.close()
    return stats, list(read_records(path))


def assert_one_record_each(stats: LoadStats, records: list[Record]) -> None:
    assert len(records) == stats.sent == stats.completed
    assert sorted(r.seq for r in records) == list(range(stats.sent))


# --- workload and arrivals (no server) ------------------------------------------------------


def test_same_seed_same_plans_and_well_formed_bodies() -> None:
    spec = WorkloadSpec(models=["m1", "m2", "m3"], seed=7)
    first = list(itertools.islice(plans(spec), 300))
    assert first == list(itertools.islice(plans(spec), 300))
    other = list(itertools.islice(plans(WorkloadSpec(models=["m1", "m2", "m3"], seed=8)), 300))
    assert [p.body for p in other] != [p.body for p in first]

    assert [p.seq for p in first] == list(range(300))
    assert [p.model for p in first[:6]] == ["m1", "m2", "m3", "m1", "m2", "m3"]
    for plan in first:
        body = json.loads(plan.body)
        assert body["model"] == plan.model and body["max_tokens"] == plan.max_tokens
        assert body["stream"] is plan.stream
        assert ("stream_options" in body) is plan.stream
        if plan.stream:
            assert body["stream_options"] == {"include_usage": True}
        if plan.kind == "chat":
            assert plan.path == "/v1/chat/completions"
            [message] = body["messages"]
            text = message["content"]
        else:
            assert plan.path == "/v1/completions"
            text = body["prompt"]
        assert len(text.split()) == plan.prompt_tokens  # the fake's token count
        assert 512 <= plan.prompt_tokens <= 4096 and 512 <= plan.max_tokens <= 4096
    # Shares are drawn, so only loosely: 70 % chat and 50 % streams by default.
    assert 0.55 < sum(p.kind == "chat" for p in first) / 300 < 0.85
    assert 0.35 < sum(p.stream for p in first) / 300 < 0.65


def test_workload_rejects_bad_specs() -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(models=[])
    with pytest.raises(ValueError):
        WorkloadSpec(models=["m"], stream_share=1.5)
    with pytest.raises(ValueError):
        WorkloadSpec(models=["m"], max_tokens=(10, 5))


def test_fixed_and_poisson_arrivals() -> None:
    fixed = list(itertools.islice(arrival_times("fixed", 100.0, 1), 1000))
    assert fixed[0] == 0.0 and fixed[999] == pytest.approx(9.99)
    assert statistics.mean(b - a for a, b in itertools.pairwise(fixed)) == pytest.approx(0.01)

    poisson = list(itertools.islice(arrival_times("poisson", 200.0, 1), 5000))
    assert poisson == list(itertools.islice(arrival_times("poisson", 200.0, 1), 5000))
    assert poisson != list(itertools.islice(arrival_times("poisson", 200.0, 2), 5000))
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    assert all(gap >= 0 for gap in gaps)
    assert 0.9 / 200 < statistics.mean(gaps) < 1.1 / 200
    # Exponential gaps: the standard deviation is about the mean (fixed gaps would give 0).
    assert 0.8 < statistics.stdev(gaps) / statistics.mean(gaps) < 1.2
    with pytest.raises(ValueError):
        arrival_times("bursty", 1.0, 1)  # type: ignore[arg-type]


def test_sse_scanner_across_chunk_boundaries() -> None:
    stream = (
        b'data: {"id":"1","choices":[]}\r\n\r\n'
        b": keep-alive comment\r\n\r\n"
        b'data: {"id":"2","choices":[]}\n\n'
        b"data: [DONE]\n\n"
    )
    for size in (1, 2, 3, 7, len(stream)):
        scanner = SseScanner()
        for i in range(0, len(stream), size):
            scanner.feed(stream[i : i + size])
        scanner.finish()
        assert (scanner.events, scanner.done, scanner.error_event) == (3, True, False), size

    broken = SseScanner()
    broken.feed(b'data: {"id":"1"}\n\ndata: {"error": {"message": "CUDA out of memory."}}\n\n')
    broken.finish()
    assert (broken.events, broken.done, broken.error_event, broken.oom) == (2, False, True, True)


def test_histogram_quantiles_within_a_percent() -> None:
    histogram = Histogram()
    for i in range(1, 1001):
        histogram.add(i / 1000)
    assert histogram.count == 1000 and histogram.max == 1.0
    assert histogram.quantile(0.5) == pytest.approx(0.5, rel=0.011)
    assert histogram.quantile(0.99) == pytest.approx(0.99, rel=0.011)
    assert histogram.quantile(1.0) == 1.0


# --- runs against the fake backend -----------------------------------------------------------


async def test_small_run_records_every_request(tmp_path: Path, fake: Backend) -> None:
    progress = Progress()
    stats, records = await run(
        tmp_path, small(), to(fake), rate=100, requests=100, arrival="fixed", progress=progress
    )
    assert_one_record_each(stats, records)
    assert (stats.planned, stats.sent, stats.ok, stats.stopped_by) == (100, 100, 100, "count")
    assert (progress.sent, progress.completed, progress.ok) == (100, 100, 100)
    assert stats.send_rate > 0 and stats.cpu_s > 0 and stats.peak_rss_mib > 0
    plan_of = {p.seq: p for p in itertools.islice(plans(small()), 100)}
    for record in records:
        plan = plan_of[record.seq]
        assert (record.model, record.kind, record.stream) == (plan.model, plan.kind, plan.stream)
        assert record.status == 200 and record.proper and record.ok, record
        assert record.error is None and not record.oom and not record.error_event
        assert (record.target, record.instance, record.attempts) == ("a", "a", None)
        assert record.ttfb is not None and record.total is not None and record.bytes > 0
        assert record.t == pytest.approx(record.seq / 100)
        if record.stream:
            # 4 tokens per event, then the usage event and [DONE].
            assert record.chunks == math.ceil(record.max_tokens / 4) + 2, record
        else:
            assert record.chunks == 0
    assert any(r.stream for r in records) and not all(r.stream for r in records)
    # The backend saw each request once, tagged with its sequence number.
    log = fake.requests(wait_for=100)
    assert sorted(int(r["headers"]["x-loadgen-seq"]) for r in log) == list(range(100))
    assert {r["outcome"] for r in log} == {"ok"}


async def test_oom_is_detected(tmp_path: Path, fake: Backend) -> None:
    fake.set_faults(oom_rate=1)
    stats, records = await run(tmp_path, small(), to(fake), rate=200, requests=20)
    assert_one_record_each(stats, records)
    assert stats.ok == 0
    assert all(r.status == 500 and r.oom and not r.proper for r in records)


async def test_dying_streams_are_not_proper(tmp_path: Path, fake: Backend) -> None:
    fake.set_faults(die_rate=1, die_after=2)
    stats, records = await run(tmp_path, small(stream_share=1.0), to(fake), rate=200, requests=20)
    assert_one_record_each(stats, records)
    for record in records:
        assert record.stream and not record.proper and not record.ok
        assert record.error is not None or record.error_event, record
        assert record.status == 200 and record.chunks == 1  # die_after 2 = one 4-token event cut


async def test_refused_target_gives_status_0_and_an_error(tmp_path: Path) -> None:
    refused = Target("nobody", f"http://127.0.0.1:{closed_port()}")
    stats, records = await run(
        tmp_path, small(), {m: [refused] for m in MODELS}, rate=200, requests=10
    )
    assert_one_record_each(stats, records)
    for record in records:
        assert record.status == 0 and not record.proper and record.ttfb is None
        assert record.error is not None and record.error.startswith("ClientConnector"), record


async def test_time_limit_and_drain_record_every_sent_request(
    tmp_path: Path, fake: Backend
) -> None:
    # Nothing ever answers: sending stops at the time limit, the drain gives up, and every
    # request sent is still in the ledger, as cancelled.
    fake.set_faults(hang_rate=1)
    progress = Progress()

    async def watch() -> tuple[int, int]:
        await progress.wait_sent(5)
        at_five = progress.sent
        await progress.wait_sent(10**9)  # never reached: released when sending ends
        return at_five, progress.sent

    watcher = asyncio.create_task(watch())
    stats, records = await run(
        tmp_path,
        small(),
        to(fake),
        rate=50,
        requests=10_000,
        arrival="fixed",
        time_limit=0.5,
        drain_timeout=0.2,
        progress=progress,
    )
    at_five, at_end = await asyncio.wait_for(watcher, 5)
    assert at_five == 5 and at_end == stats.sent
    assert stats.stopped_by == "time_limit" and 0 < stats.sent < 10_000
    assert_one_record_each(stats, records)
    assert all(r.error == CANCELLED and r.status == 0 and not r.proper for r in records)
    assert all(r.t < 0.5 for r in records)


async def test_stop_ends_sending(tmp_path: Path, fake: Backend) -> None:
    progress = Progress()

    async def stop_at_ten() -> None:
        await progress.wait_sent(10)
        progress.stop()

    stopper = asyncio.create_task(stop_at_ten())
    stats, records = await run(
        tmp_path, small(), to(fake), rate=200, requests=10_000, progress=progress
    )
    await stopper
    # The waiter runs soon after the 10th send, not inside it: a request or two may follow.
    assert stats.stopped_by == "stop" and 10 <= stats.sent <= 15
    assert_one_record_each(stats, records)
    assert all(r.ok for r in records)


async def test_concurrency_cap_is_never_exceeded(tmp_path: Path, fake: Backend) -> None:
    fake.set_faults(per_token=0.005)  # each request takes 40-160 ms; arrivals are 5 ms apart
    stats, records = await run(
        tmp_path, small(), to(fake), rate=200, requests=30, arrival="fixed", concurrency_cap=3
    )
    assert_one_record_each(stats, records)
    assert stats.ok == 30
    assert stats.max_in_flight == 3
    # Held-back requests record the wait as lag: 30 requests of >= 40 ms, 3 at a time, cannot
    # all go out within the 150 ms the schedule asked for.
    assert max(r.lag for r in records) > 0.1
    # The backend's view agrees: never more than 3 requests at once.
    log = fake.requests(wait_for=30)
    moments = sorted([(r["started"], 1) for r in log] + [(r["ended"], -1) for r in log])
    running = list(itertools.accumulate(change for _, change in moments))
    assert max(running) <= 3


async def test_round_robin_over_two_instances(
    tmp_path: Path, backend_a: Backend, backend_b: Backend
) -> None:
    backend_a.reset()
    backend_b.reset()
    stats, records = await run(tmp_path, small(), to(backend_a, backend_b), rate=200, requests=40)
    assert_one_record_each(stats, records)
    assert stats.ok == 40
    per_pair = Counter((r.model, r.instance) for r in records)
    assert per_pair == {("m1", "a"): 10, ("m1", "b"): 10, ("m2", "a"): 10, ("m2", "b"): 10}
    assert len(backend_a.requests(wait_for=20)) == len(backend_b.requests(wait_for=20)) == 20


def test_cli_runs_and_summarises(
    tmp_path: Path, fake: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.jsonl"
    argv = ["--url", f"a={fake.url}", "--model", "m1", "--model", "m2", "--rate", "200"]
    argv += ["--requests", "20", "--max-tokens", "8:32", "--prompt-tokens", "16:64"]
    argv += ["--progress-every", "0", "--out", str(out)]
    assert cli_main(argv) == 0
    report = capsys.readouterr().out
    assert "sent        20 of 20" in report and "ok          20/20" in report
    records = list(read_records(out))
    assert len(records) == 20 and all(r.ok and r.instance == "a" for r in records)
