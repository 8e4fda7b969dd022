"""The open-loop load generator: each request leaves at its scheduled time, answered or not.

A scheduler walks the plan sequence and the arrival times together, sleeping until each
absolute send time on the event loop's clock (so sleep overshoot never accumulates), and starts
one task per request. Every request ends in exactly one `Record`, written to the ledger when it
ends; only counters and constant-size histograms stay in memory, so hours of load stay flat.

Sending stops at the request count, the time limit or `Progress.stop()`, whichever comes first;
in-flight requests then get `drain_timeout` seconds to finish, and the rest are cancelled and
recorded with `error: "cancelled: run ended"`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from loadtests.ledger import JsonlWriter, Record
from loadtests.loadgen.arrivals import Arrival, Schedule, arrival_times, check_schedule, mean_rate
from loadtests.loadgen.client import (
    DEFAULT_TIMEOUT_S,
    Target,
    describe,
    new_record,
    new_session,
    send,
    timeout_of,
)
from loadtests.loadgen.progress import Progress
from loadtests.loadgen.stats import Histogram, LoadStats, cpu_seconds, peak_rss_mib
from loadtests.loadgen.workload import RequestPlan, WorkloadSpec, plans

CANCELLED = "cancelled: run ended"
# uvloop's timers have millisecond resolution: a wake-up this close to the due time is on time.
EARLY_TOLERANCE_S = 0.001


async def run_load(
    spec: WorkloadSpec,
    targets: Mapping[str, Sequence[Target]],
    writer: JsonlWriter,
    *,
    rate: float | None = None,
    requests: int,
    time_limit: float | None = None,
    arrival: Arrival = "poisson",
    rate_steps: Sequence[tuple[float, float]] | None = None,
    concurrency_cap: int = 0,
    drain_timeout: float = 30.0,
    request_timeout: float = DEFAULT_TIMEOUT_S,
    progress: Progress | None = None,
    on_record: Callable[[Record], None] | None = None,
) -> LoadStats:
    """Send `requests` requests of `spec` at `rate` per second, for at most `time_limit` s.

    `rate_steps` ((start_s, rate), ...; the first at 0) makes the rate piecewise constant and
    replaces `rate`; one of the two is needed. `targets` maps every model of `spec` to where its
    requests go, round robin: a model's instances (direct), or one gateway target for every
    model. `concurrency_cap` > 0 holds a request back while that many are in flight (its `lag`
    includes the wait). `on_record` sees each record after it is written (keep it cheap; it
    must not raise).
    """
    run = _Run(
        spec,
        targets,
        writer,
        rate=rate,
        rate_steps=rate_steps,
        requests=requests,
        time_limit=time_limit,
        arrival=arrival,
        concurrency_cap=concurrency_cap,
        drain_timeout=drain_timeout,
        request_timeout=request_timeout,
        progress=progress or Progress(),
        on_record=on_record,
    )
    return await run.run()


class _Run:
    def __init__(
        self,
        spec: WorkloadSpec,
        targets: Mapping[str, Sequence[Target]],
        writer: JsonlWriter,
        *,
        rate: float | None,
        rate_steps: Sequence[tuple[float, float]] | None,
        requests: int,
        time_limit: float | None,
        arrival: Arrival,
        concurrency_cap: int,
        drain_timeout: float,
        request_timeout: float,
        progress: Progress,
        on_record: Callable[[Record], None] | None,
    ) -> None:
        missing = [m for m in spec.models if not targets.get(m)]
        if missing:
            raise ValueError(f"no target for model(s): {', '.join(missing)}")
        if requests < 0 or concurrency_cap < 0:
            raise ValueError("requests and concurrency_cap must be >= 0")
        if time_limit is not None and time_limit < 0:
            raise ValueError("time_limit must be >= 0")
        self.spec = spec
        self.targets = {m: list(targets[m]) for m in spec.models}
        self.next_target = dict.fromkeys(spec.models, 0)
        self.writer = writer
        if rate_steps is None and rate is None:
            raise ValueError("give a rate or rate steps")
        # A plain rate is the one-step schedule: a single code path for the target rate.
        self.rate_steps: Schedule | None = (
            None if rate_steps is None else check_schedule(rate_steps)
        )
        self.schedule = self.rate_steps or ((0.0, rate or 0.0),)
        self.requests = requests
        self.time_limit = time_limit
        # Checks arrival and rate.
        self.times = arrival_times(arrival, rate or 0.0, spec.seed, self.rate_steps)
        self.cap = concurrency_cap
        self.drain_timeout = drain_timeout
        self.timeout = timeout_of(request_timeout)
        self.progress = progress
        self.on_record = on_record
        # In-flight requests and their records; a record leaves when it is written.
        self.tasks: dict[asyncio.Task[None], Record] = {}
        self.max_in_flight = 0
        self.lag = Histogram()
        self.first_send: float | None = None
        self.last_send = 0.0
        self.last_offset = 0.0  # the scheduled time of the last send
        self.last_record = 0.0
        self.stopped_by = "count"
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None
        self._want_slot = False
        self.t0 = 0.0

    async def run(self) -> LoadStats:
        loop = asyncio.get_running_loop()
        progress = self.progress
        self.t0 = t0 = progress.start_clock()
        # The same origin on the loop's clock, which schedules the sends.
        loop_t0 = loop.time() - (time.perf_counter() - t0)
        cpu_before = cpu_seconds()
        progress._attach(self._stop_requested)
        if progress.stop_requested:
            self._end("stop")
        limit = None
        if self.time_limit is not None:
            limit = loop.call_at(loop_t0 + self.time_limit, self._end, "time_limit")
        session = new_session()
        try:
            await self._schedule(loop, loop_t0, session)
            self._ended = True
            progress._end_sending()
            if self.tasks:
                await asyncio.wait(list(self.tasks), timeout=self.drain_timeout)
        finally:
            self._ended = True
            progress._end_sending()
            if limit is not None:
                limit.cancel()
            leftovers = list(self.tasks)
            for task in leftovers:
                task.cancel()  # `_done` records each as cancelled
            if leftovers:
                await asyncio.gather(*leftovers, return_exceptions=True)
            await session.close()
        end = max(self.last_record, self.last_send, t0)
        sent = progress.sent
        window = self.last_send - self.first_send if self.first_send is not None else 0.0
        return LoadStats(
            planned=self.requests,
            sent=sent,
            completed=progress.completed,
            ok=progress.ok,
            duration_s=end - t0,
            target_rate=mean_rate(self.schedule, self.last_offset),
            send_rate=(sent - 1) / window if sent > 1 and window > 0 else 0.0,
            max_lag_s=self.lag.max,
            p99_lag_s=self.lag.quantile(0.99),
            max_in_flight=self.max_in_flight,
            cpu_s=cpu_seconds() - cpu_before,
            peak_rss_mib=peak_rss_mib(),
            stopped_by=self.stopped_by,
            rate_steps=self.rate_steps,
        )

    async def _schedule(
        self, loop: asyncio.AbstractEventLoop, loop_t0: float, session: aiohttp.ClientSession
    ) -> None:
        progress = self.progress
        sequence = plans(self.spec)
        for offset in self.times:
            if progress.sent >= self.requests:
                self.stopped_by = "count"
                return
            if self.time_limit is not None and offset >= self.time_limit:
                self.stopped_by = "time_limit"
                return
            due = loop_t0 + offset
            waited = False
            while not self._ended and loop.time() < due - EARLY_TOLERANCE_S:
                await self._wait(loop, due)
                waited = True
            if not waited:
                # Behind schedule (after a stall): catch up, but let the loop run between two
                # sends, so a stop, the time limit and the requests in flight are not held
                # back by a burst.
                await asyncio.sleep(0)
            if self.cap:
                while not self._ended and len(self.tasks) >= self.cap:
                    self._want_slot = True
                    await self._wait(loop, None)
                    self._want_slot = False
            if self._ended:
                return
            self._launch(loop, session, next(sequence), offset)

    def _launch(
        self,
        loop: asyncio.AbstractEventLoop,
        session: aiohttp.ClientSession,
        plan: RequestPlan,
        offset: float,
    ) -> None:
        now = time.perf_counter()
        lag = max(0.0, now - (self.t0 + offset))
        self.lag.add(lag)
        if self.first_send is None:
            self.first_send = now
        self.last_send = now
        self.last_offset = offset
        choices = self.targets[plan.model]
        index = self.next_target[plan.model]
        self.next_target[plan.model] = (index + 1) % len(choices)
        target = choices[index]
        record = new_record(plan, target, offset, lag)
        task = loop.create_task(self._one(session, target, plan, record))
        self.tasks[task] = record
        task.add_done_callback(self._done)
        if len(self.tasks) > self.max_in_flight:
            self.max_in_flight = len(self.tasks)
        self.progress._on_sent()

    async def _one(
        self, session: aiohttp.ClientSession, target: Target, plan: RequestPlan, record: Record
    ) -> None:
        await send(session, target, plan, record, self.timeout)
        task = asyncio.current_task()
        assert task is not None
        del self.tasks[task]
        self._finish(record)

    def _done(self, task: asyncio.Task[None]) -> None:
        record = self.tasks.pop(task, None)
        if record is not None:
            # Ended without writing its record: cancelled (possibly before it even started,
            # so `send` never ran) or failed outside `send`. Every request gets its record.
            exc = None if task.cancelled() else task.exception()
            record.error = describe(exc) if exc is not None else CANCELLED
            record.proper = False
            if record.total is None:
                sent_at = self.t0 + record.t + record.lag
                record.total = round(time.perf_counter() - sent_at, 6)
            self._finish(record)
        if self._want_slot:
            self._wake()

    def _finish(self, record: Record) -> None:
        self.writer.write(record)
        self.last_record = time.perf_counter()
        self.progress._on_completed(record.ok)
        if self.on_record is not None:
            self.on_record(record)

    # --- waiting, woken by a timer, a free slot, the time limit or a stop ------------------

    async def _wait(self, loop: asyncio.AbstractEventLoop, due: float | None) -> None:
        future = loop.create_future()
        self._waiter = future
        timer = loop.call_at(due, self._wake) if due is not None else None
        try:
            await future
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _end(self, reason: str) -> None:
        if not self._ended:
            self._ended = True
            self.stopped_by = reason
            self._wake()

    def _stop_requested(self) -> None:
        self._end("stop")
