"""The load generator against real fake-vLLM subprocesses (behaviour only, no speed thresholds)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import itertools
import json
import math
import statistics
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from loadtests.ledger import JsonlWriter, Record, read_records
from loadtests.loadgen import (
    CANCELLED,
    Histogram,
    LoadStats,
    Progress,
    Target,
    WorkloadSpec,
    arrival_times,
    parse_priority_mix,
    parse_rate_steps,
    per_class_summary,
    plans,
    run_load,
)
from loadtests.loadgen.arrivals import mean_rate
from loadtests.loadgen.cli import main as cli_main
from loadtests.loadgen.client import is_shed
from loadtests.loadgen.sse import AnthropicSseScanner, SseScanner
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


# --- priority classes and rate steps ---------------------------------------------------------

MIX = (("interactive", 0.2), ("standard", 0.3), ("batch", 0.5))


def test_priority_mix_is_seeded_with_its_shares_and_leaves_the_rest_alone() -> None:
    spec = WorkloadSpec(models=["m1", "m2"], seed=5, priorities=MIX)
    first = list(itertools.islice(plans(spec), 10_000))
    assert [p.priority for p in first] == [
        p.priority for p in itertools.islice(plans(spec), 10_000)
    ]
    other = WorkloadSpec(models=["m1", "m2"], seed=6, priorities=MIX)
    assert [p.priority for p in first] != [
        p.priority for p in itertools.islice(plans(other), 10_000)
    ]
    shares = Counter(p.priority for p in first)
    for name, share in MIX:
        assert shares[name] / 10_000 == pytest.approx(share, abs=0.015), shares
    # The mix has its own generator: every other field is as without a mix.
    plain = itertools.islice(plans(WorkloadSpec(models=["m1", "m2"], seed=5)), 10_000)
    assert [dataclasses.replace(p, priority=None) for p in first] == list(plain)


def test_no_mix_means_no_priority_and_mixes_are_normalised() -> None:
    spec = WorkloadSpec(models=["m"])
    assert spec.priorities == ()
    assert all(p.priority is None for p in itertools.islice(plans(spec), 100))
    mix = WorkloadSpec(models=["m"], priorities=(("interactive", 2), ("batch", 6))).priorities
    assert mix == (("interactive", 0.25), ("batch", 0.75))
    assert parse_priority_mix("interactive=0.2, standard=0.3,batch=0.5") == MIX
    one = WorkloadSpec(models=["m"], priorities=(("batch", 3.0),))
    assert {p.priority for p in itertools.islice(plans(one), 100)} == {"batch"}


@pytest.mark.parametrize(
    "mix",
    [
        (("urgent", 1.0),),
        (("batch", 0.0),),
        (("batch", -1.0),),
        (("batch", math.nan),),
        (("batch", math.inf),),
        (("batch", 0.5), ("batch", 0.5)),
    ],
)
def test_bad_priority_mixes_are_refused(mix: tuple[tuple[str, float], ...]) -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(models=["m"], priorities=mix)


@pytest.mark.parametrize("text", ["batch", "batch=x", "batch=1,", "nobody=1", "batch=0"])
def test_bad_priority_mix_text_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_priority_mix(text)


def counts_per_step(times: Iterator[float], bounds: list[float]) -> list[int]:
    """How many of `times` (before bounds[-1]) fall in each [bounds[k], bounds[k + 1])."""
    counts = [0] * (len(bounds) - 1)
    for t in itertools.takewhile(lambda t: t < bounds[-1], times):
        counts[bisect.bisect_right(bounds, t) - 1] += 1
    return counts


def test_fixed_rate_steps_give_exact_counts() -> None:
    steps = ((0.0, 100.0), (2.0, 300.0), (3.0, 50.0))
    times = list(itertools.takewhile(lambda t: t < 5, arrival_times("fixed", 1.0, 1, steps)))
    assert counts_per_step(iter(times), [0, 2, 3, 5]) == [200, 300, 100]
    # Each step's grid starts at its boundary.
    assert times[0] == 0.0 and times[200] == 2.0 and times[500] == 3.0
    assert times[501] == pytest.approx(3.02)
    assert all(b > a for a, b in itertools.pairwise(times))


def test_poisson_rate_steps_follow_each_rate() -> None:
    steps = ((0.0, 200.0), (10.0, 1000.0), (20.0, 100.0))
    bounds = [0.0, 10.0, 20.0, 30.0]
    counts = counts_per_step(arrival_times("poisson", 1.0, 3, steps), bounds)
    assert counts == counts_per_step(arrival_times("poisson", 1.0, 3, steps), bounds)
    for count, expected in zip(counts, (2000, 10_000, 1000), strict=True):
        # Seeded, so deterministic; 4 standard deviations of a Poisson count.
        assert abs(count - expected) < 4 * math.sqrt(expected), counts


def test_one_step_is_the_plain_rate() -> None:
    for arrival in ("fixed", "poisson"):
        plain = list(itertools.islice(arrival_times(arrival, 200.0, 4), 3000))
        stepped = list(itertools.islice(arrival_times(arrival, 1.0, 4, ((0, 200),)), 3000))
        assert plain == stepped, arrival


def test_rate_steps_parsing_and_checks() -> None:
    assert parse_rate_steps("0:100, 20:300") == ((0.0, 100.0), (20.0, 300.0))
    for text in ("", "0", "0:100,x:3", "5:100", "0:100,0:200", "0:100,10:0", "0:100,10:-1"):
        with pytest.raises(ValueError):
            parse_rate_steps(text)
    with pytest.raises(ValueError):
        arrival_times("fixed", 100.0, 1, ())
    assert mean_rate(((0.0, 100.0), (20.0, 300.0)), 40.0) == pytest.approx(200.0)
    assert mean_rate(((0.0, 100.0), (20.0, 300.0)), 10.0) == pytest.approx(100.0)


def rate_limited(messages: bool, message: str, code: str) -> dict[str, Any]:
    """A 429's body in the route's shape: Anthropic's has no code."""
    if messages:
        return {"type": "error", "error": {"type": "rate_limit_error", "message": message}}
    return {"error": {"message": message, "type": "rate_limit_error", "code": code}}


@contextlib.asynccontextmanager
async def tiny_gateway() -> AsyncIterator[tuple[str, dict[int, str | None]]]:
    """A loopback server answering like the gateway under load: batch is shed (429 marked
    `x-gateway-error: shed`), standard seqs divisible by 4 get a backend's 429 (unmarked), the
    rest succeed; on /v1/messages in Anthropic's shapes. It notes the x-gateway-priority header
    it received per x-loadgen-seq."""
    seen: dict[int, str | None] = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        seq = int(request.headers["x-loadgen-seq"])
        priority = request.headers.get("x-gateway-priority")
        seen[seq] = priority
        body = await request.json()
        messages = request.path == "/v1/messages"
        if priority == "batch":
            shed = rate_limited(messages, "shed", "shed")
            headers = {"Retry-After": "1", "x-gateway-error": "shed"}
            return web.json_response(shed, status=429, headers=headers)
        if priority == "standard" and seq % 4 == 0:
            refused = rate_limited(messages, "slow down", "rate_limit_exceeded")
            return web.json_response(refused, status=429)
        if not body["stream"]:
            return web.json_response({"type": "message"} if messages else {"choices": []})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if messages:
            await response.write(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        else:
            await response.write(b'data: {"choices":[]}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        app.router.add_post(path, handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("anthropic", [False, True])
async def test_priority_header_sent_and_shed_counted_per_class(
    tmp_path: Path, anthropic: bool
) -> None:
    # With m2 on Anthropic's Messages API, whose error body has no code: the header counts.
    spec = small(priorities=MIX, anthropic_models=("m2",) if anthropic else ())
    async with tiny_gateway() as (url, seen):
        gateway = [Target("gateway", url, gateway=True)]
        stats, records = await run(
            tmp_path, spec, dict.fromkeys(MODELS, gateway), rate=1000, requests=200
        )
        assert_one_record_each(stats, records)
        plan_of = {p.seq: p for p in itertools.islice(plans(spec), 200)}
        assert seen == {seq: plan.priority for seq, plan in plan_of.items()}
        if anthropic:
            assert {r.kind for r in records if r.model == "m2"} == {"messages"}
        assert all(r.priority == plan_of[r.seq].priority for r in records)

        summary = per_class_summary(records)
        assert list(summary) == ["interactive", "standard", "batch"]
        by_class = Counter(r.priority for r in records)
        refused = sum(1 for r in records if r.priority == "standard" and r.seq % 4 == 0)
        interactive, standard, batch = summary.values()
        n_batch = by_class["batch"]
        assert (batch.count, batch.ok, batch.shed, batch.status_429) == (
            n_batch,
            0,
            n_batch,
            n_batch,
        )
        assert (batch.p50_s, batch.p99_s, batch.ttfb_p99_s) == (None, None, None)
        assert (standard.count, standard.shed, standard.status_429) == (
            by_class["standard"],
            0,
            refused,
        )
        assert standard.ok == by_class["standard"] - refused
        assert (interactive.count, interactive.ok) == (by_class["interactive"],) * 2
        assert interactive.ok_percent == 100.0 and interactive.shed == 0
        assert interactive.p50_s is not None and interactive.ttfb_p99_s is not None

        # Without a mix, no header at all.
        seen.clear()
        await run(tmp_path, small(), dict.fromkeys(MODELS, gateway), rate=1000, requests=10)
        assert seen == dict.fromkeys(range(10))


def test_a_shed_is_the_429_the_gateway_marks_as_one() -> None:
    anthropic = json.dumps(rate_limited(True, "busy", "shed")).encode()
    openai_shed = json.dumps(rate_limited(False, "busy", "shed")).encode()
    openai_other = json.dumps(rate_limited(False, "busy", "rate_limit_exceeded")).encode()
    assert is_shed("shed", anthropic) and is_shed("shed", openai_shed)
    assert not is_shed(None, anthropic)  # a backend's 429 on the Messages route
    assert not is_shed(None, openai_other) and not is_shed(None, b"not json")
    # The header, when there, decides; the body's code only without it (an older gateway).
    assert not is_shed("no_instance_available", openai_shed)
    assert is_shed(None, openai_shed)


def test_cli_rate_steps_and_priority_mix(
    tmp_path: Path, fake: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.jsonl"
    argv = ["--url", f"a={fake.url}", "--model", "m1", "--arrival", "fixed"]
    argv += ["--rate-steps", "0:100,0.1:400", "--requests", "30"]
    argv += ["--priority-mix", "interactive=1,batch=3"]
    argv += ["--max-tokens", "8:32", "--prompt-tokens", "16:64"]
    argv += ["--progress-every", "0", "--out", str(out)]
    assert cli_main(argv) == 0
    report = capsys.readouterr().out
    assert "steps 0:100,0.1:400" in report and "per priority class" in report
    lines = report.splitlines()
    assert any(line.startswith("interactive") for line in lines)
    assert any(line.startswith("batch") for line in lines)
    records = sorted(read_records(out), key=lambda r: r.seq)
    # 10 sends at 100/s in the first 0.1 s, then 400/s from 0.1 s.
    assert [r.t for r in records[9:12]] == pytest.approx([0.09, 0.1, 0.1025])
    assert {r.priority for r in records} == {"interactive", "batch"}
    log = fake.requests(wait_for=30)
    sent = {int(r["headers"]["x-loadgen-seq"]): r["headers"]["x-gateway-priority"] for r in log}
    assert sent == {r.seq: r.priority for r in records}


def test_cli_refuses_bad_steps_and_mixes(capsys: pytest.CaptureFixture[str]) -> None:
    for flag, value in (("--rate-steps", "5:100"), ("--priority-mix", "urgent=1")):
        with pytest.raises(SystemExit):
            cli_main(["--url", "http://127.0.0.1:1", "--model", "m", flag, value])
    assert "rate step" in capsys.readouterr().err


# --- Anthropic Messages API traffic -----------------------------------------------------------


def test_messages_kind_for_anthropic_models_leaves_other_models_alone() -> None:
    spec = WorkloadSpec(models=["m1", "m2"], seed=5, anthropic_models=("m2",))
    first = list(itertools.islice(plans(spec), 200))
    assert first == list(itertools.islice(plans(spec), 200))
    plain = list(itertools.islice(plans(WorkloadSpec(models=["m1", "m2"], seed=5)), 200))
    for plan, before in zip(first, plain, strict=True):
        # The same draws: every field but kind, path and body is unchanged.
        assert (plan.seq, plan.model, plan.stream, plan.prompt_tokens, plan.max_tokens) == (
            before.seq,
            before.model,
            before.stream,
            before.prompt_tokens,
            before.max_tokens,
        )
        if plan.model == "m1":
            assert plan == before
            continue
        assert (plan.kind, plan.path) == ("messages", "/v1/messages")
        body = json.loads(plan.body)
        assert set(body) == {"model", "max_tokens", "messages", "stream"}
        assert body["model"] == "m2" and body["max_tokens"] == plan.max_tokens
        assert body["stream"] is plan.stream
        [message] = body["messages"]
        assert message["role"] == "user"
        assert len(message["content"].split()) == plan.prompt_tokens
    streams = [p.stream for p in first if p.model == "m2"]
    assert any(streams) and not all(streams)
    with pytest.raises(ValueError, match="anthropic models"):
        WorkloadSpec(models=["m1"], anthropic_models=("m9",))


def test_anthropic_scanner_needs_message_stop_and_no_error_event() -> None:
    stream = (
        b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n'
        b'event: ping\ndata: {"type":"ping"}\n\n'
        b'event: content_block_delta\r\ndata: {"type":"content_block_delta"}\r\n\r\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    for size in (1, 3, len(stream)):
        scanner = AnthropicSseScanner()
        for i in range(0, len(stream), size):
            scanner.feed(stream[i : i + size])
        scanner.finish()
        assert (scanner.events, scanner.done, scanner.error_event) == (4, True, False), size

    broken = AnthropicSseScanner()
    broken.feed(stream[: stream.index(b"event: ping")])  # message_start only
    broken.feed(
        b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
        b'"message":"CUDA out of memory."}}\n\n'
    )
    broken.finish()
    assert (broken.done, broken.error_event, broken.oom) == (False, True, True)


def anthropic_spec(**overrides: Any) -> WorkloadSpec:
    return small(anthropic_models=("m2",), **overrides)


async def test_anthropic_model_runs_ok_streamed_and_not(tmp_path: Path, fake: Backend) -> None:
    stats, records = await run(
        tmp_path, anthropic_spec(), to(fake), rate=200, requests=60, arrival="fixed"
    )
    assert_one_record_each(stats, records)
    assert stats.ok == 60
    messages = [r for r in records if r.model == "m2"]
    assert {r.kind for r in messages} == {"messages"}
    assert {r.kind for r in records if r.model == "m1"} <= {"chat", "completions"}
    assert {r.stream for r in messages} == {True, False}
    for record in messages:
        assert record.status == 200 and record.proper and record.ok, record
        assert not record.error_event and not record.oom and record.error is None
        assert record.ttfb is not None and record.bytes > 0
        if record.stream:
            # message_start, content_block_start, ping, a delta per 4 tokens, then
            # content_block_stop, message_delta and message_stop.
            assert record.chunks == math.ceil(record.max_tokens / 4) + 6, record
        else:
            assert record.chunks == 0
    log = fake.requests(wait_for=60)
    paths = {r["path"] for r in log if r["model"] == "m2"}
    assert paths == {"/v1/messages"}


async def test_anthropic_stream_error_events_are_not_proper(tmp_path: Path, fake: Backend) -> None:
    fake.set_faults(stream_error_rate=1, stall_after=2)
    stats, records = await run(
        tmp_path,
        WorkloadSpec(
            models=["m2"],
            anthropic_models=("m2",),
            stream_share=1.0,
            prompt_tokens=(16, 64),
            max_tokens=(8, 32),
        ),
        {"m2": [Target(fake.name, fake.url)]},
        rate=200,
        requests=20,
    )
    assert_one_record_each(stats, records)
    assert stats.ok == 0
    for record in records:
        assert record.kind == "messages" and record.stream and record.status == 200
        assert record.error_event and not record.proper and not record.ok, record
        assert record.error is None and not record.oom


async def test_anthropic_oom_and_overloaded_answers(tmp_path: Path, fake: Backend) -> None:
    spec = WorkloadSpec(models=["m2"], anthropic_models=("m2",), max_tokens=(8, 32))
    targets = {"m2": [Target(fake.name, fake.url)]}
    fake.set_faults(oom_rate=1)
    _, records = await run(tmp_path, spec, targets, rate=200, requests=10)
    assert all(r.status == 500 and r.oom and not r.proper for r in records)
    fake.reset()
    fake.set_faults(overloaded_rate=1)
    _, records = await run(tmp_path, spec, targets, rate=200, requests=10)
    assert all(r.status == 529 and not r.oom and not r.proper for r in records)


def test_cli_anthropic_model(
    tmp_path: Path, fake: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ledger.jsonl"
    argv = ["--url", f"a={fake.url}", "--model", "m1", "--anthropic-model", "m2"]
    argv += ["--rate", "200", "--requests", "20", "--prompt-tokens", "16:32"]
    argv += ["--max-tokens", "8:16", "--progress-every", "0", "--out", str(out)]
    assert cli_main(argv) == 0
    assert "ok          20/20" in capsys.readouterr().out
    records = list(read_records(out))
    assert {r.kind for r in records if r.model == "m2"} == {"messages"}
    assert {r.model for r in records} == {"m1", "m2"}


def test_long_prompts_take_their_share_and_leave_the_rest_alone() -> None:
    plain_spec = WorkloadSpec(models=["m1", "m2"], seed=5, prompt_tokens=(4, 32))
    spec = dataclasses.replace(plain_spec, long_prompt_share=0.1, long_prompt_tokens=300)
    first = list(itertools.islice(plans(spec), 5_000))
    assert first == list(itertools.islice(plans(spec), 5_000))
    long = [p for p in first if p.prompt_tokens == 300]
    assert len(long) / 5_000 == pytest.approx(0.1, abs=0.015)
    for plan in long:
        text = json.loads(plan.body)
        prompt = text["messages"][0]["content"] if plan.kind == "chat" else text["prompt"]
        assert len(prompt.split()) == 300
    # Drawn apart: every other request is exactly as without long prompts, body included, and
    # a long one differs from it in its prompt only.
    plain = list(itertools.islice(plans(plain_spec), 5_000))
    for without, with_long in zip(plain, first, strict=True):
        if with_long.prompt_tokens == 300:
            fields = ("seq", "model", "kind", "stream", "max_tokens")
            assert [getattr(with_long, f) for f in fields] == [getattr(without, f) for f in fields]
        else:
            assert with_long == without
    with pytest.raises(ValueError, match="long_prompt_share"):
        dataclasses.replace(plain_spec, long_prompt_share=1.5)
