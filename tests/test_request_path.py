"""The whole pipeline of `gateway.request_path`, in process: instances in memory
(`tests.memory_upstream`), time virtual (`loadtests.virtual_time`), no socket. Retries, isolation,
timeouts and admission are decided by the real layers, and asserted by order, counts and the
virtual times of events."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from gateway.config import parse_policy
from gateway.config.routes import CHAT
from gateway.core.balancer import MIN_ANSWERED_SHARE, PENALTY_TAU_S, REFERENCE_TOKENS
from gateway.core.breaker import ADMITTING, ISOLATED, PROBING, Transition
from gateway.core.outcome import Outcome as AttemptOutcome
from gateway.core.outcome import Phase
from gateway.errors import GatewayError, Shed
from gateway.pipeline.admit import PoolAdmission
from gateway.pipeline.call import Call, Handler, RequestFacts
from gateway.request_path import build_pipeline
from gateway.runtime import Cancellation
from gateway.upstream.feedback import Feedback
from gateway.upstream.pool import PoolState
from gateway.upstream.registry import Registry
from gateway.upstream.response import Owned, UpstreamResponse
from gateway.upstream.watchdog import Watchdog
from loadtests.virtual_time import run
from tests.memory_upstream import (
    Answer,
    Full,
    Hang,
    MemoryHead,
    MemoryUpstreams,
    Refuse,
    Script,
    always,
)

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}'


def policy_text(instances: list[str], settings: str = "") -> str:
    listed = ", ".join(f'{{name: {name}, url: "http://{name}:8000"}}' for name in instances)
    return f"""
pools:
  chat:
    models: [m]
    instances: [{listed}]
    health: {{enabled: false}}
{settings}
"""


@dataclass
class Outcome:
    """How one request ended: the status the client would get, where, after how many
    attempts, at what virtual time."""

    status: int
    instance: str | None
    attempts: int
    at: float
    code: str | None = None
    retry_after_s: float | None = None
    message: str = ""
    body: bytes | None = None  # a whole answer's, as the backend sent it
    retry_after: str | None = None  # the backend's own Retry-After header


@dataclass
class Pipeline:
    handler: Handler
    pool: PoolState
    upstreams: MemoryUpstreams
    watchdog: Watchdog
    admissions: dict[str, PoolAdmission]
    transitions: list[tuple[str, Transition]] = field(default_factory=list)

    def isolations(self) -> list[str]:
        return [t.instance for _, t in self.transitions if t.to == ISOLATED]

    async def request(
        self, priority: str | None = None, *, stream: bool = False, within_s: float | None = None
    ) -> Outcome:
        """One request (non-streamed unless `stream`), as the front end would send it down
        the pipeline, within the pool's ceiling or `within_s` (`x-gateway-timeout`)."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        call = Call(
            pool=self.pool,
            route=CHAT,
            query="",
            body=BODY,
            headers=[("content-type", "application/json")],
            facts=RequestFacts("m", stream, 16),
            deadline=loop.time() + (within_s or self.pool.policy.timeouts.ceiling),
            cancellation=Cancellation(task),
            priority=priority,  # type: ignore[arg-type]
        )
        try:
            response = await self.handler(call)
        except GatewayError as error:
            return Outcome(
                error.status,
                None,
                call.attempts,
                loop.time(),
                error.code,
                error.retry_after_s,
                error.message,
            )
        with Owned(response) as relayed:
            relayed.ok = True
        return Outcome(
            response.status,
            response.instance.name,
            call.attempts,
            loop.time(),
            body=response.body,
            retry_after=response.header("retry-after"),
        )


def pipeline(
    instances: dict[str, Script], settings: str = "", seed: int = 7
) -> Callable[[], Awaitable[Pipeline]]:
    """A factory to await inside the virtual-time loop: the pipeline as the gateway builds it."""

    async def build() -> Pipeline:
        loop = asyncio.get_running_loop()
        policy = parse_policy(policy_text(list(instances), settings))
        registry = Registry(policy, now=loop.time(), rng=random.Random(seed))
        pool = registry.pools["chat"]
        admissions = {
            name: PoolAdmission(state, state.policy.admission)
            for name, state in registry.pools.items()
            if state.policy.admission is not None
        }
        upstreams = MemoryUpstreams(dict(instances))
        watchdog = Watchdog()
        watchdog.start()
        built = Pipeline(
            handler=lambda call: asyncio.sleep(0),  # type: ignore[arg-type,return-value]
            pool=pool,
            upstreams=upstreams,
            watchdog=watchdog,
            admissions=admissions,
        )
        built.handler = build_pipeline(
            admissions=admissions,
            account_pools=dict(registry.pools),
            on_transition=lambda pool_name, t: built.transitions.append((pool_name, t)),
            client=upstreams,
            watchdog=watchdog,
            clock=loop.time,
        ).handle
        return built

    return build


def requests_in_turn(
    instances: dict[str, Script], settings: str, count: int
) -> tuple[Pipeline, list[Outcome]]:
    """`count` requests one after another through a fresh pipeline, in virtual time."""

    async def scenario() -> tuple[Pipeline, list[Outcome]]:
        p = await pipeline(instances, settings)()
        try:
            return p, [await p.request() for _ in range(count)]
        finally:
            await p.watchdog.close()

    return run(scenario())


def test_a_failed_attempt_is_retried_on_another_instance() -> None:
    async def scenario() -> list[Outcome]:
        p = await pipeline({"a": always(Answer(status=503)), "b": always(Answer())})()
        try:
            return [await p.request() for _ in range(6)]
        finally:
            await p.watchdog.close()

    outcomes = run(scenario())
    assert [(o.status, o.instance) for o in outcomes] == [(200, "b")] * 6
    # Wherever a request went first, it ended on b: after a, in two attempts.
    assert {o.attempts for o in outcomes} <= {1, 2}
    assert any(o.attempts == 2 for o in outcomes)


def test_retries_that_are_answered_do_not_use_up_the_retry_budget() -> None:
    """A budget of 2 retries per 10 s (no ratio) and an instance that refuses a third of its
    requests with an OOM (fast, no work done) while its peer answers: every such request is
    retried on the peer and answered, far more than twice, because each answered retry gives
    its budget back. A retry that fails again stays counted: with both instances failing, the
    budget holds after its 2."""
    oom = Answer(status=500, body=b'{"error": {"message": "CUDA out of memory."}}', after_s=0.001)

    def sometimes_oom(n: int) -> Answer:
        return oom if n % 3 == 0 else Answer()

    # The breaker is held off: what is tested is the budget, not the isolation that would end
    # the failures here.
    settings = (
        "    retries: {budget: {ratio: 0.0, min_per_second: 0.2}}\n"
        "    breaker: {consecutive_failures: 100, error_rate: 1.0}\n"
        "    hedging: false"
    )

    p, outcomes = requests_in_turn({"a": sometimes_oom, "b": always(Answer())}, settings, 40)
    assert all(o.status == 200 for o in outcomes)
    assert sum(1 for o in outcomes if o.attempts == 2) > 2
    assert p.pool.stats.budget_exhausted == 0

    p, outcomes = requests_in_turn({"a": always(oom), "b": always(oom)}, settings, 40)
    assert all(o.status == 500 for o in outcomes)
    assert sum(o.attempts - 1 for o in outcomes) == 2  # within one window of virtual time
    assert outcomes[-1].at < 10.0
    assert p.pool.stats.budget_exhausted >= 1


def test_an_instance_that_keeps_failing_is_isolated_and_gets_no_more_requests() -> None:
    async def scenario() -> tuple[Pipeline, list[Outcome], int]:
        p = await pipeline(
            {"a": always(Refuse()), "b": always(Answer()), "c": always(Answer())},
            settings="    breaker: {consecutive_failures: 2, isolation: 30s}",
        )()
        try:
            outcomes = [await p.request() for _ in range(10)]
            before = p.upstreams.received("a")
            outcomes += [await p.request() for _ in range(20)]  # all within the isolation
            return p, outcomes, before
        finally:
            await p.watchdog.close()

    p, outcomes, tried_before = run(scenario())
    assert all(o.status == 200 for o in outcomes)  # every request was rescued
    assert p.isolations() == ["a"]
    # Refused connections never reach an instance; once isolated, a is not even tried.
    assert p.upstreams.received("a") == 0
    assert tried_before == 0
    assert all(o.attempts == 1 for o in outcomes[10:])
    assert outcomes[-1].at < 30.0  # virtual: still inside the isolation


def test_an_instance_isolated_for_errors_is_probed_early_once_the_others_are_full() -> None:
    """a answers five errors and is isolated for 30 s. While b has room, a stays out. Once b
    holds more than it was seen serving at once, the next request probes a before its
    isolation ends, and a, which recovered, is back at once."""
    settings = (
        "    breaker: {consecutive_failures: 5, isolation: 30s}\n"
        "    hedging: false\n"
        "    retries: {budget: {ratio: 1.0, min_per_second: 10}}"
    )
    errors_first = lambda n: Answer(status=500) if n < 5 else Answer()  # noqa: E731

    async def scenario() -> tuple[Pipeline, list[Outcome], list[Outcome], str]:
        p = await pipeline({"a": errors_first, "b": always(Answer(after_s=0.5))}, settings)()
        try:
            [a, b] = p.pool.instances
            quiet: list[Outcome] = []
            for _ in range(40):  # one at a time: b always has room
                quiet.append(await p.request())
                if a.breaker.state != ADMITTING and len(quiet) >= 10:
                    break
            held = a.breaker.state
            b.capacity_seen = 1  # what b was seen serving at once
            busy = await asyncio.gather(*(p.request() for _ in range(3)))
            return p, quiet, list(busy), held
        finally:
            await p.watchdog.close()

    p, quiet, busy, held = run(scenario())
    assert p.isolations() == ["a"]
    assert held == ISOLATED  # ten requests later, b having room all along
    assert all(o.status == 200 for o in quiet + busy)
    assert [o.instance for o in busy].count("a") == 1  # the one early probe
    [a, _] = p.pool.instances
    assert a.breaker.state == ADMITTING
    assert busy[-1].at < 30.0  # virtual: well before the isolation's end
    assert p.transitions[-1][1].reason == "probe succeeded"


def test_an_instance_that_refuses_connections_leaves_rotation_past_the_isolation_cap() -> None:
    """Pool of three, so at most one may be isolated, and an operator holds c out. A refusing
    b would be kept in rotation by that cap as a suspected outlier: a refused connection says
    it is down, so it leaves at once. Without health checks its breaker holds it out until a
    probe answers (with them, its health verdict would: `tests/test_health.py`)."""

    async def scenario() -> tuple[Pipeline, list[Outcome], int]:
        p = await pipeline(
            {"a": always(Answer()), "b": always(Refuse()), "c": always(Answer())},
            settings="    breaker: {isolation: 30s}",
        )()
        now = asyncio.get_running_loop().time()
        try:
            c = p.pool.instance_named("c")
            assert c is not None
            c.breaker.isolate(now, p.pool.rng, reason="operator")
            outcomes = [await p.request() for _ in range(40)]
            return p, outcomes, p.upstreams.asked("b")
        finally:
            await p.watchdog.close()

    p, outcomes, asked_b = run(scenario())
    assert all((o.status, o.instance) == (200, "a") for o in outcomes)
    assert asked_b == 1  # refused once, then out of rotation (with the cap, 1 in 2 went there)
    assert [(t.instance, t.to, t.reason) for _, t in p.transitions] == [
        ("b", ISOLATED, "connection refused")
    ]
    assert sum(o.attempts for o in outcomes) == 41


async def _queued_on_a(p: Pipeline, for_s: float) -> Outcome:
    """One request while `a` has seen one slot, someone else's attempt streams on it and it
    sends bytes the whole time (its busy engine's progress): the request queues there."""
    a = p.pool.instance_named("a")
    assert a is not None
    a.capacity_seen = 1
    a.in_flight = 1
    loop = asyncio.get_running_loop()

    async def at_work() -> None:
        end = loop.time() + for_s
        while loop.time() < end:
            a.progress_at = loop.time()
            await asyncio.sleep(0.2)

    pump = loop.create_task(at_work())
    try:
        return await p.request()
    finally:
        pump.cancel()
        await p.watchdog.close()


def test_an_attempt_queued_behind_a_working_engine_waits_its_turn() -> None:
    """Its first-byte wait is 1 s; its turn at the busy engine comes after 5 s. The engine sends
    bytes on its other stream all along, and nothing else could start the request sooner, so
    the wait is not cut: one attempt, answered when its turn came (not cancelled, and queued
    again at the back)."""

    async def scenario() -> Outcome:
        p = await pipeline(
            {"a": always(Answer(after_s=5.0))}, settings="    timeouts: {initial: 1s, floor: 1s}"
        )()
        return await _queued_on_a(p, 8.0)

    outcome = run(scenario())
    assert (outcome.status, outcome.instance, outcome.attempts) == (200, "a", 1)
    assert 4.9 < outcome.at < 6.0


def test_a_queued_attempt_moves_once_another_instance_has_room() -> None:
    """Same queue, but b comes back (an operator's restore) after 2 s: the wait that ran out
    at 1 s goes on while nothing else could start it, and moves to b once b can."""

    async def scenario() -> Outcome:
        p = await pipeline(
            {"a": always(Answer(after_s=20.0)), "b": always(Answer())},
            settings="    timeouts: {initial: 1s, floor: 1s}",
        )()
        loop = asyncio.get_running_loop()
        b = p.pool.instance_named("b")
        assert b is not None
        b.breaker.isolate(loop.time(), p.pool.rng)
        loop.call_later(2.0, b.breaker.restore, loop.time() + 2.0)
        return await _queued_on_a(p, 30.0)

    outcome = run(scenario())
    assert (outcome.status, outcome.instance, outcome.attempts) == (200, "b", 2)
    assert 1.9 < outcome.at < 3.0


def test_failure_penalties_do_not_price_each_other_up() -> None:
    """a and b fail, c is held out by an operator: the isolation cap keeps a and b in rotation
    and the balancer steers by penalties instead, each priced on the other's latency. Priced
    on each other's penalties, they doubled at each failure, to
    estimates of hours in which latency no longer counted (seen in chaos runs: every instance
    of a pool at about an hour, the slowest one taking the most traffic)."""

    async def scenario() -> tuple[Pipeline, list[Outcome], list[float], float]:
        p = await pipeline(
            {"a": always(Answer(status=503)), "b": always(Answer(status=503)),
             "c": always(Answer())},
            settings="    breaker: {consecutive_failures: 2, isolation: 30s}",
        )()  # fmt: skip
        loop = asyncio.get_running_loop()
        try:
            a, b, c = (p.pool.instance_named(name) for name in "abc")
            assert a is not None and b is not None and c is not None
            c.breaker.isolate(loop.time(), p.pool.rng, reason="operator")
            outcomes = [await p.request() for _ in range(30)]
            now = loop.time()
            priced = [a.price.cost_latency(now), b.price.cost_latency(now)]
            await asyncio.sleep(20.0)  # they stop being asked: the penalties fade
            later = loop.time()
            return (
                p,
                outcomes,
                priced,
                max(a.price.cost_latency(later), b.price.cost_latency(later)),
            )
        finally:
            await p.watchdog.close()

    p, outcomes, priced, later = run(scenario())
    assert all(o.status == 503 for o in outcomes)
    suppressed = [t for _, t in p.transitions if t.suppressed]
    assert {t.instance for t in suppressed} == {"a", "b"} and len(suppressed) >= 10
    # Each penalty is the other's latency on its own answers (none yet: the initial 1 s) per
    # answer it gives (none: priced at the least answered share).
    assert max(priced) <= 1.0 / MIN_ANSWERED_SHARE + 0.01, priced
    assert later <= max(priced) * math.exp(-20.0 / PENALTY_TAU_S) + 1.0


async def _back_from_an_isolation(p: Pipeline) -> float:
    """`a`, slow before (3 s answers), isolated; its probe answers well past the isolation.
    The virtual time of its return."""
    loop = asyncio.get_running_loop()
    a = p.pool.instance_named("a")
    assert a is not None
    now = loop.time()
    a.price.peak.observe(now, 3.0)  # its slow answers
    for _ in range(2):
        a.breaker.record(now, True, False, p.pool.rng)
    assert a.breaker.state == ISOLATED
    await asyncio.sleep(6.0)  # past the isolation (5 s, jittered by 10 % at most)
    probe = await p.request()
    assert (probe.status, probe.instance) == (200, "a")
    assert a.breaker.state == ADMITTING
    return probe.at


def test_an_instance_back_from_an_isolation_without_a_ramp_gets_its_share_at_once() -> None:
    """Before its isolation `a` answered slowly. A balancer that still remembered that (a peak
    EWMA forgets with a 10 s time constant) would send every request to `b` for half a minute
    after a's probe answered well, while `a` idled and `b` carried the pool."""

    async def scenario() -> tuple[Pipeline, list[Outcome]]:
        p = await pipeline(
            {"a": always(Answer()), "b": always(Answer())},
            settings="    breaker: {consecutive_failures: 2, isolation: 5s, slow_start: 0s}",
        )()
        try:
            await _back_from_an_isolation(p)
            return p, [await p.request() for _ in range(20)]
        finally:
            await p.watchdog.close()

    p, after = run(scenario())
    assert [(t.state_from, t.to) for _, t in p.transitions] == [(PROBING, ADMITTING)]
    assert all(o.status == 200 and o.attempts == 1 for o in after)
    # Both answer alike now: power of two choices splits them (ties go to the first drawn).
    assert 5 <= sum(o.instance == "a" for o in after) <= 15


def test_an_instance_back_from_an_isolation_regains_its_share_along_its_slow_start() -> None:
    """The default ramp (`breaker.slow_start`, 3 s): back from its isolation, `a` gets a small
    share at first, not the backlog its peer carried, and all of its share by the ramp's end.
    A request every 10 ms, each answered in 200 ms: about 20 in flight."""

    async def scenario() -> tuple[float, list[tuple[float, Outcome]]]:
        p = await pipeline(
            {"a": always(Answer(after_s=0.2)), "b": always(Answer(after_s=0.2))},
            settings="    breaker: {consecutive_failures: 2, isolation: 5s}",
        )()
        loop = asyncio.get_running_loop()
        try:
            back_at = await _back_from_an_isolation(p)

            async def sent() -> tuple[float, Outcome]:
                return loop.time(), await p.request()

            tasks = []
            for _ in range(500):  # 5 s of arrivals
                tasks.append(asyncio.ensure_future(sent()))
                await asyncio.sleep(0.01)
            return back_at, list(await asyncio.gather(*tasks))
        finally:
            await p.watchdog.close()

    back_at, sent = run(scenario())
    assert all(o.status == 200 and o.attempts == 1 for _, o in sent)

    def share_of_a(start_s: float, end_s: float) -> float:
        window = [o for at, o in sent if start_s <= at - back_at < end_s]
        assert len(window) >= 40
        return sum(o.instance == "a" for o in window) / len(window)

    first, middle, after = share_of_a(0.0, 0.75), share_of_a(1.25, 2.0), share_of_a(3.5, 5.0)
    assert first < middle < after
    assert first <= 0.25  # from 10 % of its weight: a small share, not the backlog
    assert 0.4 <= after <= 0.6  # the ramp over: an even split


def test_a_slow_instance_loses_its_share_from_its_first_answers() -> None:
    """A fresh pool (a gateway just started): `a` answers in 0.5 s, `b` and `c` in 0.1 s, and
    a request arrives every 10 ms. Priced by the 1 s guess every estimate starts at, which an
    answer faster than it barely moves, the three looked alike for the guess's ten seconds and
    more, and only what `a` had in flight held it back: it took 11 % of the requests, each
    five times slower. (A stream holds its instance long after its first byte, so for the
    length of a stream its instance's count says nothing of its speed: in a chaos run, the
    instance slowed five-fold took a third of its pool's streams.)"""

    async def scenario() -> list[Outcome]:
        p = await pipeline(
            {"a": always(Answer(after_s=0.5)), "b": always(Answer(after_s=0.1)),
             "c": always(Answer(after_s=0.1))},
        )()  # fmt: skip
        loop = asyncio.get_running_loop()
        try:
            tasks = []
            for _ in range(300):  # 3 s of arrivals
                tasks.append(loop.create_task(p.request()))
                await asyncio.sleep(0.01)
            return list(await asyncio.gather(*tasks))
        finally:
            await p.watchdog.close()

    outcomes = run(scenario())
    assert all(o.status == 200 for o in outcomes)
    # Once the first answers are in (0.5 s), a is priced five times its peers.
    later = outcomes[100:]
    assert sum(o.instance == "a" for o in later) / len(later) < 0.05


def _usage(tokens: int) -> bytes:
    return json.dumps({"choices": [], "usage": {"completion_tokens": tokens}}).encode()


def test_a_long_answer_prices_its_instance_as_a_short_one_at_the_same_pace() -> None:
    """Both instances generate at 10 ms a token; `a` happened to get an answer of 1,000
    tokens (10 s), `b` one of 64 (0.64 s). Priced on whole times, `a` would cost fifteen
    times `b` for tens of seconds, and lose every draw of power of two choices to it; the
    length was the client's, not the instance's."""

    async def scenario() -> tuple[float, float]:
        p = await pipeline(
            {
                "a": always(Answer(body=_usage(1000), after_s=10.0)),
                "b": always(Answer(body=_usage(REFERENCE_TOKENS), after_s=0.64)),
            }
        )()
        try:
            a, b = (p.pool.instance_named(name) for name in "ab")
            assert a is not None and b is not None
            now = asyncio.get_running_loop().time()
            for inst in (a, b):  # as learned before: a short answer's time at their pace
                inst.price.start_afresh(now, 0.64)
            priced = {}
            for _ in range(10):  # until each has answered once; its price read at once
                outcome = await p.request()
                assert outcome.status == 200
                answered = a if outcome.instance == "a" else b
                priced.setdefault(answered.name, answered.price.peak.peek(outcome.at))
                if len(priced) == 2:
                    return priced["a"], priced["b"]
            raise AssertionError("a single instance took every request")
        finally:
            await p.watchdog.close()

    a_priced, b_priced = run(scenario())
    assert a_priced == pytest.approx(0.64, rel=0.01)
    assert b_priced == pytest.approx(0.64, rel=0.01)


def test_an_instance_back_in_traffic_is_costed_as_its_peers() -> None:
    async def scenario() -> tuple[float, float, float]:
        p = await pipeline({"a": always(Answer()), "b": always(Answer()), "c": always(Answer())})()
        try:
            now = asyncio.get_running_loop().time()
            a, b, c = (p.pool.instance_named(name) for name in "abc")
            assert a is not None and b is not None and c is not None
            a.price.peak.observe(now, 8.0)
            b.price.peak.observe(now, 0.2)  # their first answers
            c.price.peak.observe(now, 0.4)
            p.pool.rejoined(a, now, ramp=False)  # a new instance's first health check
            assert a.price.ramp(now) == 1.0  # no slow start after no fault
            p.pool.rejoined(a, now)
            assert a.price.ramp(now) == pytest.approx(0.1)  # its slow start begins
            with_both = a.price.peak.peek(now)
            c.breaker.isolate(now, p.pool.rng, reason="operator")  # out: not a peer
            a.price.peak.observe(now, 8.0)
            p.pool.rejoined(a, now)
            with_b = a.price.peak.peek(now)
            b.breaker.isolate(now, p.pool.rng, reason="operator")
            a.price.peak.observe(now, 8.0)
            p.pool.rejoined(a, now)  # alone: nothing to go by, as if it never answered
            assert not a.price.peak.learned
            a.price.peak.observe(now, 0.5)  # its first answer since
            return with_both, with_b, a.price.peak.peek(now)
        finally:
            await p.watchdog.close()

    with_both, with_b, alone = run(scenario())
    assert with_both == pytest.approx(0.3)
    assert with_b == pytest.approx(0.2)
    assert alone == 0.5  # the guess gave way to it, low as it is: not a peak above a guess


def test_health_slow_start_ramps_a_first_health_pass_and_an_unchecked_instance() -> None:
    """`health.slow_start` is the ramp of an instance whose checks just passed (the longer of
    the two windows after a fault), and of one that no check guards, from when it is built."""
    checked = parse_policy(
        policy_text(["a", "b"]).replace("health: {enabled: false}", "health: {slow_start: 10s}")
    )
    pool = Registry(checked, now=0.0, rng=random.Random(1)).pools["chat"]
    a = pool.instance_named("a")
    assert a is not None and a.price.ramp(0.0) == 1.0  # not healthy yet: nothing to ramp
    pool.rejoined(a, 100.0, ramp=False, healthy=True)  # its first pass
    assert a.price.ramp(105.0) == pytest.approx(0.55)
    pool.rejoined(a, 200.0, healthy=True)  # back after a fault: 10 s beats the breaker's 3 s
    assert a.price.ramp(205.0) == pytest.approx(0.55)
    unchecked = parse_policy(
        policy_text(["a"]).replace("enabled: false", "enabled: false, slow_start: 10s")
    )
    built = Registry(unchecked, now=50.0, rng=random.Random(1)).pools["chat"].instances[0]
    assert built.price.ramp(55.0) == pytest.approx(0.55)


def test_the_gateways_own_connection_limit_is_answered_at_once_when_nothing_else_has_room() -> None:
    """A lone instance whose connections are all busy: another attempt would only wait out the
    same busy connections again, so the 503 (with its Retry-After) comes after the first.
    With another instance free, the request goes there."""

    async def scenario() -> tuple[Outcome, list[Outcome]]:
        lone = await pipeline({"a": always(Full())})()
        pair = await pipeline({"a": always(Full()), "b": always(Answer())})()
        try:
            return await lone.request(), [await pair.request() for _ in range(8)]
        finally:
            await lone.watchdog.close()
            await pair.watchdog.close()

    lone, pair = run(scenario())
    assert (lone.status, lone.code, lone.attempts) == (503, "upstream_connection_limit", 1)
    assert lone.retry_after_s == 1.0
    assert all((o.status, o.instance) == (200, "b") for o in pair)
    assert any(o.attempts == 2 for o in pair)  # some drew a first, then went to b


def test_an_instance_silent_through_a_whole_first_byte_timeout_is_not_asked_again() -> None:
    """Nothing learned, so each attempt waits `timeouts.initial` (30 s) for a first byte. A
    lone hung instance costs one such wait, not one per retry; two cost two. A lone instance
    that answered other requests meanwhile is busy, not gone: asked again."""

    async def scenario() -> tuple[Outcome, Outcome, Outcome, float]:
        lone = await pipeline({"a": always(Hang())})()
        pair = await pipeline({"a": always(Hang()), "b": always(Hang())})()
        busy = await pipeline({"a": lambda n: Hang() if n == 0 else Answer(after_s=1.0)})()
        loop = asyncio.get_running_loop()
        try:
            start = loop.time()
            hung = await lone.request()
            both = await pair.request()
            start_busy = loop.time()

            async def others() -> None:
                await asyncio.sleep(1.0)
                for _ in range(5):  # while the first request waits: answered in 1 s each
                    await busy.request()
                    await asyncio.sleep(4.0)

            background = asyncio.create_task(others())
            rescued = await busy.request()
            await background
            return hung, both, rescued, (hung.at - start, rescued.at - start_busy)
        finally:
            for p in (lone, pair, busy):
                await p.watchdog.close()

    hung, both, rescued, (hung_s, rescued_s) = run(scenario())
    assert (hung.status, hung.code, hung.attempts) == (504, "upstream_timeout", 1)
    assert 30.0 <= hung_s < 60.0  # virtual: one wait, not three
    assert (both.status, both.attempts) == (504, 2)
    assert (rescued.status, rescued.instance, rescued.attempts) == (200, "a", 2)
    assert rescued_s > 30.0


def test_an_attempt_past_its_deadline_is_given_up_and_retried_elsewhere() -> None:
    async def scenario() -> tuple[Pipeline, Outcome, float]:
        p = await pipeline(
            {"a": always(Hang()), "b": always(Answer(after_s=0.05))},
            settings="    timeouts: {initial: 2s, floor: 100ms, jitter: 0s}",
            seed=1,
        )()
        try:
            # What the deadline layer gives a's first attempt: nothing learned yet.
            [a, _] = p.pool.instances
            k = p.pool.tiers.choose(p.pool.failure.rate).k
            now = asyncio.get_running_loop().time()
            wait_s = p.pool.timing.timeouts_for(a, k, now, stream=False, max_tokens=16).first_byte_s
            outcomes = [await p.request() for _ in range(4)]
            return p, next(o for o in outcomes if o.attempts == 2), wait_s
        finally:
            await p.watchdog.close()

    p, retried, wait_s = run(scenario())
    assert (retried.status, retried.instance) == (200, "b")
    assert wait_s >= 2.0  # the initial timeout at least, before anything is learned
    hung = next(s for s in p.upstreams.sent if s.instance == "a")
    answered = next(s for s in p.upstreams.sent if s.instance == "b" and s.at > hung.at)
    # The second attempt went out once the first one's deadline had passed, within the
    # watchdog's tick (and the retry's backoff).
    assert answered.at - hung.at == pytest.approx(wait_s, abs=0.1)


def test_admission_holds_a_slot_for_the_whole_exchange_and_sheds_past_the_queue() -> None:
    admission = """    admission:
      concurrency: {mode: fixed, limit: 1}
      batch: {max_queue: 1}"""

    async def scenario() -> list[Outcome]:
        p = await pipeline({"a": always(Answer(after_s=1.0))}, settings=admission)()
        try:
            first = asyncio.ensure_future(p.request("batch"))
            await asyncio.sleep(0.1)  # it holds the only slot now
            second = asyncio.ensure_future(p.request("batch"))  # queued
            await asyncio.sleep(0.1)
            third = asyncio.ensure_future(p.request("batch"))  # the queue is full
            return list(await asyncio.gather(first, second, third))
        finally:
            await p.watchdog.close()

    first, second, third = run(scenario())
    assert (first.status, first.at) == (200, pytest.approx(1.0, abs=0.05))
    # The queued one ran only once the first had left its slot, one second each.
    assert (second.status, second.at) == (200, pytest.approx(2.0, abs=0.05))
    assert (third.status, third.code, third.attempts) == (Shed.status, Shed.code, 0)
    assert third.at == pytest.approx(0.2, abs=0.01)  # refused at once, not after waiting


def test_work_after_a_response_runs_once_in_order_and_past_a_failing_step() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        loop = asyncio.get_running_loop()
        registry = Registry(parse_policy(policy_text(["a"])), now=loop.time())
        [instance] = registry.pools["chat"].instances
        watchdog = Watchdog()
        task = asyncio.current_task()
        assert task is not None
        deadline = watchdog.arm(Cancellation(task), loop.time() + 10, "first_byte")
        response = UpstreamResponse(
            instance,
            MemoryHead(Answer()),
            body=None,
            first_chunk=b"",
            is_sse=False,
            deadline=deadline,
            watchdog=watchdog,
            started_at=loop.time(),
            clock=loop.time,
        )
        ran: list[str] = []

        def failing(r: UpstreamResponse, error: object) -> None:
            ran.append("account")
            raise RuntimeError("a step that fails")

        response.after(lambda r, error: ran.append("span"))
        response.after(failing)
        response.after(lambda r, error: ran.append("slot"))
        with Owned(response) as relayed:
            relayed.ok = True
        first = list(ran)
        with Owned(response) as again:  # a second end runs nothing again
            again.ok = True
        return first, ran

    first, after_second = run(scenario())
    assert first == ["span", "account", "slot"]
    assert after_second == first


def test_a_first_stream_is_priced_at_the_pools_pace_until_the_instance_has_its_own() -> None:
    """Priced on its wait alone (50 ms), a new instance's first stream made it look 26 times
    cheaper than peers priced on 64 tokens at 20 ms too, and drew it every time until that
    stream ended."""
    registry = Registry(parse_policy(policy_text(["a", "b"])), now=0.0)
    a, b = registry.pools["chat"].instances
    a.price.first_byte(1.0, 0.05, a.latency, pool_per_token_s=0.02)
    assert a.price.peak.get(1.0) == pytest.approx(0.05 + REFERENCE_TOKENS * 0.02)
    b.latency.per_token.observe(0.001)  # its own pace, once it has one
    b.price.first_byte(1.0, 0.05, b.latency, pool_per_token_s=0.02)
    assert b.price.peak.get(1.0) == pytest.approx(0.05 + REFERENCE_TOKENS * 0.001)


class TappedHead(MemoryHead):
    """A stream's head whose pieces all wait for the reader's pump, handed to its tap."""

    def __init__(self, pieces: list[bytes]) -> None:
        super().__init__(Answer())
        self.pieces = pieces
        self.stopped = False

    async def pump(self, tap: Callable[[bytes], bool]) -> bytes | None:
        while self.pieces:
            piece = self.pieces.pop(0)
            if not tap(piece):
                return piece
            if self.stopped:
                return None
        return b""

    def stop_pump(self) -> None:
        self.stopped = True


def _tapped_response(head: TappedHead) -> UpstreamResponse:
    loop = asyncio.get_running_loop()
    registry = Registry(parse_policy(policy_text(["a"])), now=loop.time())
    [instance] = registry.pools["chat"].instances
    task = asyncio.current_task()
    assert task is not None
    deadline = Watchdog().arm(Cancellation(task), loop.time() + 10, Phase.FIRST_BYTE)
    return UpstreamResponse(
        instance,
        head,
        body=None,
        first_chunk=b"data: 0\n\n",
        is_sse=True,
        deadline=deadline,
        watchdog=Watchdog(),
        started_at=loop.time(),
        clock=loop.time,
    )


def test_the_pieces_a_pump_taps_are_accounted_as_read_ones_are() -> None:
    async def scenario() -> tuple[UpstreamResponse, bytes | None, list[bytes]]:
        pieces = [b"data: 1\n\n", b"data: 2\n\n", b"data: 3"]
        response = _tapped_response(TappedHead(pieces))
        taken: list[bytes] = []

        def tap(piece: bytes) -> bool:
            if not piece.endswith(b"\n\n"):
                return False
            taken.append(piece)
            return True

        return response, await response.pump(1.0, 100.0, tap), taken

    response, declined, taken = run(scenario())
    assert taken == [b"data: 1\n\n", b"data: 2\n\n"] and declined == b"data: 3"
    assert response.gaps == 3  # each piece, the declined one too, once
    assert (response.before_tail, response.tail) == (b"data: 2\n\n", b"data: 3")
    assert response.instance.progress_at == response.last_at


def test_a_tap_that_fails_fails_the_relay_not_the_upstream() -> None:
    """What the tap raises is the gateway's own failure: raised in the relay's task, not
    passed to the connection's parser, where it would count as the upstream's bad bytes."""

    async def scenario() -> None:
        response = _tapped_response(TappedHead([b"data: 1\n\n", b"data: 2\n\n"]))

        def tap(piece: bytes) -> bool:
            raise LookupError("the tap's own bug")

        await response.pump(1.0, 100.0, tap)

    with pytest.raises(LookupError, match="the tap's own bug"):
        run(scenario())


def test_stalled_streams_isolate_only_an_instance_that_stopped_sending_on_all() -> None:
    """Three idle timeouts in a row isolate an instance that went silent (and move its streams):
    not one that kept sending on its other streams meanwhile (a burst of prefills slowing
    some, a stall of one stream's own), whose stalls count in its error rate instead."""
    idle = AttemptOutcome.from_error("timeout", Phase.IDLE)
    for flowing, isolated in ((True, []), (False, ["a"])):
        registry = Registry(parse_policy(policy_text(["a", "b"])), now=0.0, rng=random.Random(1))
        pool = registry.pools["chat"]
        (instance,) = [i for i in pool.instances if i.name == "a"]
        transitions: list[Transition] = []

        def seen(_pool: str, transition: Transition, into: list[Transition] = transitions) -> None:
            into.append(transition)

        feedback = Feedback(seen)
        for at in (10.0, 10.1, 10.2):
            feedback.attempt_finished(pool, instance, idle, at, 5.0, False, others_flowing=flowing)
        assert [t.instance for t in transitions if t.to == ISOLATED] == isolated
        if isolated:
            assert transitions[-1].silent, "a silent instance's streams are moved"
        else:
            assert instance.failures == 3 and instance.breaker.state == ADMITTING


def test_a_failing_pool_still_retries_on_a_sound_instance_it_has_not_tried() -> None:
    """Two of three instances fail every other request (fast 503s, the breaker held off), so
    the pool's failure rate puts it in a tier of one retry. A request that met both failing
    instances goes on to the third, which fails nothing: a retry there is no storm. With
    every instance failing alike, none is sound and the tier's one retry holds."""
    settings = (
        "    retries:\n"
        "      tiers:\n"
        "        - {below: 0.01, max_retries: 3, backoff: 1ms, k: [1.2, 1.8]}\n"
        "        - {below: 1.0, max_retries: 1, backoff: 1ms, k: [1.8, 3.0]}\n"
        "    breaker: {consecutive_failures: 100, error_rate: 1.0}\n"
        "    hedging: false"
    )

    def every_other(n: int) -> Answer:
        return Answer(status=503, after_s=0.001) if n % 2 == 0 else Answer()

    failing = {"a": every_other, "b": every_other}
    p, outcomes = requests_in_turn({**failing, "c": always(Answer())}, settings, 60)
    assert p.pool.tiers.choose(p.pool.failure.rate).max_retries == 1
    assert [o.status for o in outcomes] == [200] * 60
    assert any(o.attempts == 3 for o in outcomes), "no request met both failing instances"

    p, outcomes = requests_in_turn({**failing, "c": every_other}, settings, 60)
    assert max(o.attempts for o in outcomes[10:]) == 2  # the tier's one retry, once it is in it
    assert any(o.status == 503 for o in outcomes)


def test_an_attempt_timed_as_not_the_last_is_followed_by_one_when_it_times_out() -> None:
    """In a tier of one retry, a fast 503 lets a request go on (a sound instance is left), and
    its second attempt is timed as not its last: a learned, short first-byte timeout. When
    that attempt times out (on an instance that turned silent), the retry it was timed for
    follows, to the instance that answers: never a 504 after a wait shorter than the one a
    last attempt gets."""
    settings = (
        "    retries:\n"
        "      tiers:\n"
        "        - {below: 0.01, max_retries: 3, backoff: 1ms, k: [1.2, 1.8]}\n"
        "        - {below: 1.0, max_retries: 1, backoff: 1ms, k: [1.8, 3.0]}\n"
        "    breaker: {consecutive_failures: 1000, consecutive_timeouts: 1000, error_rate: 1.0}\n"
        "    timeouts: {jitter: 0s}\n"
        "    hedging: false"
    )

    def answers_then_hangs(n: int) -> Answer | Hang:
        return Answer() if n < 15 else Hang()

    p, outcomes = requests_in_turn(
        {
            "a": always(Answer(status=503, after_s=0.001)),
            "b": answers_then_hangs,
            "c": always(Answer()),
        },
        settings,
        120,
    )
    assert p.pool.tiers.choose(p.pool.failure.rate).max_retries == 1
    assert [o.status for o in outcomes] == [200] * 120
    met_both = [o for o in outcomes if o.attempts == 3]
    assert met_both, "no request met the failing and the silent instance"
    assert all(o.instance == "c" for o in met_both)


# -- 429s and Retry-After --------------------------------------------------------------------

RATE_LIMITED = b'{"error": {"message": "rate limited", "type": "rate_limit"}}'


def limited(retry_after: str | None = None) -> Answer:
    """vLLM's (or a proxy's) 429, with a Retry-After when given one."""
    headers = ((b"retry-after", retry_after.encode()),) if retry_after is not None else ()
    return Answer(status=429, body=RATE_LIMITED, headers=headers)


def test_a_lone_instance_rate_limiting_without_retry_after_is_asked_again_ever_later() -> None:
    """A pool of one answering 429 with no Retry-After: each 429 pauses it for a backoff that
    starts at `rate_limit_backoff.base` (0.5 s) and doubles per 429 in a row, so the request's
    attempts are spaced at least 0.5 s, 1 s, 2 s apart (not four within milliseconds), up to
    the most retries a tier allows; then the backend's own 429 goes back."""

    async def scenario() -> tuple[Pipeline, Outcome, list[float]]:
        p = await pipeline({"a": always(limited())}, "    hedging: false")()
        try:
            outcome = await p.request()
            return p, outcome, [s.at for s in p.upstreams.sent]
        finally:
            await p.watchdog.close()

    p, outcome, sent = run(scenario())
    assert (outcome.status, outcome.body) == (429, RATE_LIMITED)
    assert outcome.attempts == len(sent) == p.pool.tiers.most_retries + 1 == 4
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent)]
    for n, gap in enumerate(gaps):
        assert gap >= 0.5 * 2**n, (n, gaps)
    [a] = p.pool.instances
    assert a.rate_limits_in_row == 4
    assert a.not_before - outcome.at >= 0.5 * 2**3  # the fourth 429's pause, 4 s at least


def test_a_rate_limit_run_ends_with_an_answer_that_is_not_a_429() -> None:
    """Two 429s, then answers: the request is answered after the two pauses, and the next
    429 pauses the instance for the base again, not for a third doubling."""
    script = lambda n: limited() if n in (0, 1, 3) else Answer()  # noqa: E731

    async def scenario() -> tuple[Pipeline, list[Outcome], list[float]]:
        p = await pipeline({"a": script}, "    hedging: false")()
        try:
            first = await p.request()
            [a] = p.pool.instances
            after_answer = a.rate_limits_in_row
            second = await p.request()  # its 429 (the fourth answer), then an answer
            return p, [first, second], [after_answer, a.rate_limits_in_row]
        finally:
            await p.watchdog.close()

    p, outcomes, counts = run(scenario())
    assert [(o.status, o.attempts) for o in outcomes] == [(200, 3), (200, 2)]
    assert counts == [0, 0]  # reset by each answer
    sent = [s.at for s in p.upstreams.sent]
    assert sent[1] - sent[0] >= 0.5 and sent[2] - sent[1] >= 1.0
    assert 0.5 <= sent[4] - sent[3] <= 1.0 + 0.1  # one 429 in a row again: the base's range


def test_a_429_whose_wait_outlasts_the_deadline_is_returned_at_once() -> None:
    """A Retry-After of 5 s on a lone instance, a request allowed 2 s: no sleep that could only
    end in a timeout, the backend's 429 goes back as it came (status, body, Retry-After), at
    once. So does a 429 without Retry-After once its backoff outlasts what is left."""

    async def scenario() -> tuple[Outcome, Outcome, list[float]]:
        p = await pipeline({"a": always(limited("5"))}, "    hedging: false")()
        q = await pipeline({"a": always(limited())}, "    hedging: false")()
        try:
            told = await p.request(within_s=2.0)
            backed_off = await q.request(within_s=2.0)
            return told, backed_off, [s.at for s in q.upstreams.sent]
        finally:
            await p.watchdog.close()
            await q.watchdog.close()

    told, backed_off, sent = run(scenario())
    assert (told.status, told.body, told.retry_after) == (429, RATE_LIMITED, "5")
    assert told.attempts == 1
    assert told.at == pytest.approx(0.01)  # its one answer's time: no wait after it
    assert (backed_off.status, backed_off.body, backed_off.retry_after) == (
        429,
        RATE_LIMITED,
        None,
    )
    # Answered right after its last attempt, before the deadline: not at it.
    assert backed_off.at == pytest.approx(sent[-1] + 0.01)
    assert backed_off.at < 2.0


def test_no_attempt_of_any_request_reaches_a_paused_instance_reached_with_our_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lone instance reached with the operator's key (`credentials`: its limit is every
    request's) answers a 429 with Retry-After: 1. A request that may wait for it does (its
    attempt goes out once the pause is over, never before); one that may not is told at once
    (503 + Retry-After, nothing sent)."""
    monkeypatch.setenv("POOL_KEY", "sk-ours")

    async def scenario() -> tuple[Pipeline, list[Outcome], float]:
        p = await pipeline(
            {"a": lambda n: limited("1") if n == 0 else Answer()},
            "    credentials: {from_env: POOL_KEY}",
        )()
        loop = asyncio.get_running_loop()
        try:
            first = await p.request(within_s=0.5)  # its 429, at once
            [a] = p.pool.instances
            paused_until = a.not_before
            hurried = await p.request(within_s=0.3)
            patient = await p.request()
            assert loop.time() >= paused_until
            return p, [first, hurried, patient], paused_until
        finally:
            await p.watchdog.close()

    p, (first, hurried, patient), paused_until = run(scenario())
    assert (first.status, first.retry_after) == (429, "1")
    assert (hurried.status, hurried.code, hurried.attempts) == (503, "no_instance_available", 0)
    assert hurried.retry_after_s == pytest.approx(paused_until - first.at)
    assert (patient.status, patient.attempts) == (200, 1)
    assert [s.at >= paused_until for s in p.upstreams.sent] == [False, True]


def test_a_paused_instance_reached_with_the_clients_keys_is_only_the_last_choice() -> None:
    """Without `credentials`, each client's own key may be the one limited: the request that
    got the 429 waits its Retry-After before its retry, but another client's request still
    goes to the lone instance, as it would going direct; with a second instance, it goes
    there."""

    async def scenario() -> tuple[list[Outcome], list[str], list[Outcome], list[str]]:
        lone = await pipeline({"a": lambda n: limited("1") if n == 0 else Answer()})()
        two = await pipeline(
            {"a": lambda n: limited("1") if n == 0 else Answer(), "b": always(Answer())},
            "    hedging: false",
        )()
        try:
            waited, other = await asyncio.gather(
                lone.request(), _after(0.1, lone.request(within_s=0.3))
            )
            first = await two.request()
            others = [await two.request() for _ in range(3)]
            return (
                [waited, other],
                [s.instance for s in lone.upstreams.sent],
                [first, *others],
                [s.instance for s in two.upstreams.sent],
            )
        finally:
            await lone.watchdog.close()
            await two.watchdog.close()

    (waited, other), lone_sent, answers, two_sent = run(scenario())
    assert (other.status, other.attempts) == (200, 1)  # not held off the lone instance
    assert (waited.status, waited.attempts) == (200, 2)
    assert waited.at >= 1.0  # its own retry honoured the Retry-After
    assert lone_sent == ["a", "a", "a"]
    assert all(answer.status == 200 for answer in answers)
    assert two_sent[-3:] == ["b", "b", "b"]  # while `a` is paused, `b` takes the rest


async def _after(delay_s: float, request: Awaitable[Outcome]) -> Outcome:
    await asyncio.sleep(delay_s)
    return await request


# -- timeouts.first_token_max ----------------------------------------------------------------

SSE = (
    b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
    b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n'
    b"data: [DONE]\n\n"
)


def streamed(after_s: float) -> Answer:
    """A stream whose first byte comes after `after_s` (the whole of it at once)."""
    return Answer(body=SSE, after_s=after_s, content_type=b"text/event-stream")


FIRST_TOKEN_MAX = "    timeouts: {first_token_max: 2s, jitter: 0s}\n    hedging: false"


def test_a_stream_slower_than_first_token_max_moves_to_a_fast_instance() -> None:
    """`first_token_max: 2s`, one instance taking 10 s to its first byte (well within the
    unlearned `initial` of 30 s), one taking 10 ms: every streamed request is answered by the
    fast one, and an attempt on the slow one is given up 2 s after it was sent."""

    async def scenario() -> tuple[Pipeline, list[Outcome]]:
        p = await pipeline(
            {"slow": always(streamed(10.0)), "fast": always(streamed(0.01))}, FIRST_TOKEN_MAX
        )()
        try:
            return p, [await p.request(stream=True) for _ in range(8)]
        finally:
            await p.watchdog.close()

    p, outcomes = run(scenario())
    assert [(o.status, o.instance) for o in outcomes] == [(200, "fast")] * 8
    sent = p.upstreams.sent
    cut = [i for i, s in enumerate(sent) if s.instance == "slow"]
    assert cut, "the balancer never tried the slow instance"
    for i in cut:  # its retry went out once the limit cut it (plus the retry's backoff)
        assert sent[i + 1].instance == "fast"
        assert 2.0 <= sent[i + 1].at - sent[i].at <= 2.0 + 0.15


def test_with_only_slow_instances_the_stream_ends_in_a_504_naming_first_token_max() -> None:
    """Both instances take 10 s to a first byte: each is given 2 s, and sends nothing to anyone
    meanwhile, so neither is asked again (the limit is all a retry there would get): a 504
    whose message names the limit, after two attempts (4 s), not after 30 s or one more
    wait per retry."""

    async def scenario() -> Outcome:
        p = await pipeline(
            {"a": always(streamed(10.0)), "b": always(streamed(10.0))}, FIRST_TOKEN_MAX
        )()
        try:
            return await p.request(stream=True)
        finally:
            await p.watchdog.close()

    outcome = run(scenario())
    assert (outcome.status, outcome.code) == (504, "upstream_timeout")
    assert outcome.message == "no first token within timeouts.first_token_max (2s)"
    assert outcome.attempts == 2
    assert 4.0 <= outcome.at <= 4.0 + 0.25  # plus the watchdog's ticks and the retry's backoff


def test_first_token_max_does_not_bound_a_whole_answer() -> None:
    """A non-streamed answer's first byte is the whole generation: 10 s to it is within the
    unlearned timeout (30 s), whatever `first_token_max` says; a learned timeout that cuts a
    stream says so in its own words."""

    async def scenario() -> tuple[Outcome, Outcome]:
        p = await pipeline({"a": always(Answer(after_s=10.0))}, FIRST_TOKEN_MAX)()
        q = await pipeline({"a": always(Answer(after_s=40.0))}, "    hedging: false")()
        try:
            return await p.request(), await q.request(stream=True)
        finally:
            await p.watchdog.close()
            await q.watchdog.close()

    whole, unlimited = run(scenario())
    assert (whole.status, whole.attempts) == (200, 1)
    assert whole.at == pytest.approx(10.0, abs=0.1)
    assert (unlimited.status, unlimited.message) == (504, "the upstream timed out (first_byte)")
