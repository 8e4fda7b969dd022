"""Command line: `python -m loadtests.loadgen --url URL --model M --rate 200 --requests N ...`.

Every URL serves every model (round robin over the URLs per model). `--url NAME=URL` names a
target (default: host:port, or "gateway" with --gateway). With --gateway the instance and the
attempt count of each record come from the gateway's x-gateway-* headers.

`--rate-steps 0:100,20:300` (start seconds:rate) replaces `--rate` with a step schedule;
`--priority-mix interactive=0.2,standard=0.3,batch=0.5` sends x-gateway-priority headers in
those shares and adds a per-class table to the closing summary.

`--anthropic-model NAME` (repeatable) sends that model's requests with Anthropic's Messages API
(`POST /v1/messages`, streamed or not per --stream-share); it joins the --model list if absent.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from loadtests.ledger import JsonlWriter, Record
from loadtests.loadgen.arrivals import ARRIVALS, Schedule, parse_rate_steps
from loadtests.loadgen.classes import ClassTally, class_table
from loadtests.loadgen.client import DEFAULT_TIMEOUT_S, Target
from loadtests.loadgen.generator import run_load
from loadtests.loadgen.progress import Progress
from loadtests.loadgen.stats import Histogram, LoadStats
from loadtests.loadgen.workload import WorkloadSpec, parse_priority_mix


def token_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        values = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH (or N), got {text!r}") from None
    if not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"need 1 <= LOW <= HIGH, got {text!r}")
    return values


def rate_steps(text: str) -> Schedule:
    try:
        return parse_rate_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def priority_mix(text: str) -> tuple[tuple[str, float], ...]:
    try:
        return parse_priority_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.loadgen", description=__doc__)
    parser.add_argument("--url", action="append", required=True, help="[NAME=]URL, repeatable")
    parser.add_argument("--model", action="append", default=[], help="repeatable")
    parser.add_argument(
        "--anthropic-model",
        action="append",
        default=[],
        help="repeatable: a model sent with the Anthropic Messages API (/v1/messages)",
    )
    parser.add_argument("--gateway", action="store_true", help="the URL is a gateway")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second")
    parser.add_argument(
        "--rate-steps", type=rate_steps, help="START:RATE,... (seconds:per second); over --rate"
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds of sending")
    parser.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--chat-share", type=float, default=0.7)
    parser.add_argument("--stream-share", type=float, default=0.5)
    parser.add_argument("--prompt-tokens", type=token_range, default=(512, 4096))
    parser.add_argument("--max-tokens", type=token_range, default=(512, 4096))
    parser.add_argument(
        "--priority-mix", type=priority_mix, default=(), help="CLASS=SHARE,... (x-gateway-priority)"
    )
    parser.add_argument("--concurrency-cap", type=int, default=0, help="0: no cap")
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--progress-every", type=float, default=10.0, help="seconds; 0: quiet")
    parser.add_argument("--out", type=Path, default=Path("ledger.jsonl"))
    args = parser.parse_args(argv)
    if not args.model and not args.anthropic_model:
        parser.error("give at least one --model or --anthropic-model")
    return args


def models_of(args: argparse.Namespace) -> list[str]:
    """--model in order, then any --anthropic-model not already among them."""
    models = list(args.model)
    models.extend(m for m in dict.fromkeys(args.anthropic_model) if m not in models)
    return models


def targets_of(urls: list[str], gateway: bool) -> list[Target]:
    targets = []
    for item in urls:
        name, sep, url = item.partition("=")
        if not sep or "://" in name:
            name, url = "", item
        if not name:
            name = "gateway" if gateway else (urlsplit(url).netloc or url)
        targets.append(Target(name, url, gateway=gateway))
    return targets


class Summary:
    """Figures for the closing report, fed one record at a time (constant memory)."""

    def __init__(self) -> None:
        self.total = Histogram()
        self.ttfb = Histogram()
        self.outcomes: Counter[str] = Counter()
        self.classes = ClassTally()

    def add(self, record: Record) -> None:
        self.classes.add(record)
        if record.ok:
            self.outcomes["ok"] += 1
            if record.total is not None:
                self.total.add(record.total)
            if record.stream and record.ttfb is not None:
                # A plain response's first byte comes with its last: only streams tell here.
                self.ttfb.add(record.ttfb)
        elif record.error:
            self.outcomes[record.error.split(":", 1)[0]] += 1
        else:
            extra = " oom" if record.oom else " error-event" if record.error_event else ""
            extra = " shed" if record.shed else extra
            self.outcomes[f"status {record.status}{extra}"] += 1

    def report(self, stats: LoadStats) -> str:
        ok_pct = 100.0 * stats.ok / stats.completed if stats.completed else 0.0
        ms = 1000.0
        target = f"{stats.target_rate:g}/s target"
        if stats.rate_steps is not None:
            target = f"{stats.target_rate:.1f}/s target (steps {steps_text(stats.rate_steps)})"
        lines = [
            f"sent        {stats.sent} of {stats.planned} planned in {stats.duration_s:.1f} s "
            f"(stopped by {stats.stopped_by})",
            f"send rate   {stats.send_rate:.1f}/s achieved vs {target}; "
            f"lag p99 {stats.p99_lag_s * ms:.1f} ms, max {stats.max_lag_s * ms:.1f} ms",
            f"ok          {stats.ok}/{stats.completed} ({ok_pct:.1f} %); "
            f"max in flight {stats.max_in_flight}",
            f"total (ok)  p50 {self.total.quantile(0.5):.3f} s, "
            f"p99 {self.total.quantile(0.99):.3f} s",
            f"ttfb (ok streams) p50 {self.ttfb.quantile(0.5) * ms:.1f} ms, "
            f"p99 {self.ttfb.quantile(0.99) * ms:.1f} ms",
            f"generator   CPU {stats.cpu_percent:.1f} % of one core ({stats.cpu_s:.1f} s), "
            f"peak RSS {stats.peak_rss_mib:.0f} MiB",
        ]
        failures = [(k, v) for k, v in self.outcomes.most_common() if k != "ok"]
        if failures:
            lines.append("failures    " + ", ".join(f"{k}: {v}" for k, v in failures[:8]))
        if self.classes.has_priorities:
            lines.append("per priority class (latencies of ok requests, ttfb of ok streams):")
            lines.append(class_table(self.classes.summaries()))
        return "\n".join(lines)


def steps_text(steps: Iterable[tuple[float, float]]) -> str:
    return ",".join(f"{start:g}:{rate:g}" for start, rate in steps)


async def _report_progress(progress: Progress, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        print(
            f"[{progress.elapsed():7.1f} s] sent {progress.sent}, done {progress.completed}, "
            f"ok {progress.ok}, in flight {progress.in_flight}",
            file=sys.stderr,
            flush=True,
        )


async def run(args: argparse.Namespace) -> tuple[LoadStats, Summary]:
    targets = targets_of(args.url, args.gateway)
    spec = WorkloadSpec(
        models=models_of(args),
        chat_share=args.chat_share,
        stream_share=args.stream_share,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
        priorities=args.priority_mix,
        anthropic_models=tuple(dict.fromkeys(args.anthropic_model)),
    )
    summary = Summary()
    progress = Progress()
    progress.start_clock()
    reporter = None
    if args.progress_every > 0:
        reporter = asyncio.create_task(_report_progress(progress, args.progress_every))
    writer = JsonlWriter(args.out)
    try:
        stats = await run_load(
            spec,
            dict.fromkeys(spec.models, targets),
            writer,
            rate=args.rate,
            requests=args.requests,
            time_limit=args.time_limit,
            arrival=args.arrival,
            rate_steps=args.rate_steps,
            concurrency_cap=args.concurrency_cap,
            drain_timeout=args.drain_timeout,
            request_timeout=args.request_timeout,
            progress=progress,
            on_record=summary.add,
        )
    finally:
        writer.close()
        if reporter is not None:
            reporter.cancel()
    return stats, summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency of the gateway
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            stats, summary = runner.run(run(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary.report(stats))
    print(f"ledger      {args.out}")
    return 0
