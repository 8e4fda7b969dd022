"""Hedged first attempts through the whole pipeline, in process and in virtual time: a first
attempt slow to answer gets a second one on another instance, the first to answer wins, and
the other is given up. Asserted by where requests ended, their attempts, the virtual times of
events and the pool's hedge counts."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.config import parse_policy
from gateway.pipeline.account import Account
from gateway.pipeline.call import Call, Handler
from gateway.pipeline.deadline import DeadlineLayer
from gateway.pipeline.hedge import _in_its_turn
from gateway.upstream.registry import Registry
from gateway.upstream.response import UpstreamResponse
from loadtests.virtual_time import run
from tests.memory_upstream import Answer, AnswerWhen, Hang, Script, always
from tests.test_request_path import Outcome, Pipeline, pipeline, policy_text

LEARN = 12  # answers each instance gives fast first: more than `timeouts.min_samples`
FAST_S = 0.01
SETTINGS = "    timeouts: {jitter: 0s}"


class FastThen:
    """Fast answers while the gateway learns the instances (`learned`), then `act`. Each
    instance answers fast until all have answered `LEARN` times: the balancer need not split
    the learning requests evenly, and one that learned first must not start its act while
    the others still learn."""

    def __init__(self, act: Answer | AnswerWhen | Hang) -> None:
        self.act = act
        self.learning = True

    def __call__(self, n: int) -> Answer | AnswerWhen | Hang:
        return Answer(after_s=FAST_S) if self.learning else self.act


def fast_then(act: Answer | AnswerWhen | Hang) -> Script:
    return FastThen(act)


async def learned(p: Pipeline) -> None:
    """Requests until every instance has answered `LEARN` times; then each goes on to its act."""
    names = [i.name for i in p.pool.instances]
    for _ in range(10 * LEARN):
        if all(p.upstreams.received(name) >= LEARN for name in names):
            for script in p.upstreams.scripts.values():
                if isinstance(script, FastThen):
                    script.learning = False
            return
        await p.request()
    raise AssertionError("the instances never all learned")


def test_a_first_attempt_on_a_hung_instance_is_hedged_long_before_its_timeout() -> None:
    async def scenario() -> tuple[Pipeline, list[Outcome], float, float]:
        p = await pipeline(
            {"a": fast_then(Hang()), "b": always(Answer(after_s=FAST_S))}, SETTINGS
        )()
        try:
            await learned(p)
            [a, _] = p.pool.instances
            loop = asyncio.get_running_loop()
            k = p.pool.tiers.choose(p.pool.failure.rate).k
            timeout_s = p.pool.timing.timeouts_for(a, k, loop.time(), stream=False, max_tokens=16)
            delay = p.pool.timing.hedge_delay(a, loop.time(), stream=False, max_tokens=16)
            assert delay is not None
            starts: list[float] = []
            outcomes: list[Outcome] = []
            for _ in range(20):
                starts.append(loop.time())
                outcomes.append(await p.request())
            durations = [o.at - s for o, s in zip(outcomes, starts, strict=True)]
            return p, outcomes, max(durations), min(timeout_s.first_byte_s, delay * 10)
        finally:
            await p.watchdog.close()

    p, outcomes, slowest, bound = run(scenario())
    assert all((o.status, o.instance) == (200, "b") for o in outcomes)
    hedged = [o for o in outcomes if o.attempts == 2]
    assert hedged, "some first attempts went to the hung instance"
    assert p.pool.stats.hedges.get("won", 0) == len(hedged)
    # Virtual time: a hedged request ended at its hedge delay plus b's answer, well before the
    # hung attempt's own first-byte timeout.
    assert slowest < bound


def test_a_pool_of_one_never_hedges() -> None:
    async def scenario() -> tuple[Pipeline, Outcome]:
        p = await pipeline({"a": fast_then(Answer(after_s=0.2))}, SETTINGS)()
        try:
            await learned(p)
            return p, await p.request()
        finally:
            await p.watchdog.close()

    p, slow = run(scenario())
    assert (slow.status, slow.attempts) == (200, 1)
    assert p.pool.stats.hedges == {}


def test_hedging_off_sends_no_second_attempt() -> None:
    async def scenario() -> tuple[Pipeline, list[Outcome]]:
        p = await pipeline(
            {"a": fast_then(Answer(after_s=0.2)), "b": fast_then(Answer(after_s=0.2))},
            SETTINGS + "\n    hedging: false",
        )()
        try:
            await learned(p)
            return p, [await p.request() for _ in range(4)]
        finally:
            await p.watchdog.close()

    p, outcomes = run(scenario())
    assert [(o.status, o.attempts) for o in outcomes] == [(200, 1)] * 4
    assert p.pool.stats.hedges == {}


def test_the_first_answer_wins_and_the_other_attempt_is_dropped() -> None:
    # After learning, a answers in 50 ms (past its hedge delay) and b takes a second: whichever
    # went first, the request ends on a, with the other attempt given up.
    async def scenario() -> tuple[Pipeline, list[Outcome]]:
        p = await pipeline(
            {"a": fast_then(Answer(after_s=0.05)), "b": fast_then(Answer(after_s=1.0))},
            SETTINGS,
        )()
        try:
            await learned(p)
            return p, [await p.request() for _ in range(6)]
        finally:
            await p.watchdog.close()

    p, outcomes = run(scenario())
    assert [(o.status, o.instance) for o in outcomes] == [(200, "a")] * 6
    hedged = sum(1 for o in outcomes if o.attempts == 2)
    assert hedged >= 1
    hedges = p.pool.stats.hedges
    assert hedges.get("won", 0) + hedges.get("lost", 0) == hedged


def test_a_hedge_overtaken_before_it_left_is_late_and_gives_its_budget_back() -> None:
    """The first attempt answers in the very moment its hedge's timer fires, before the hedge
    chose an instance: nothing went out (no instance received a second request), so the race
    is not a lost hedge (wasted work) but a late one, and its share of the retry budget
    comes back."""

    async def scenario() -> tuple[Pipeline, Outcome, int, int, int]:
        answered = asyncio.Event()
        p = await pipeline(
            {"a": fast_then(AnswerWhen(answered)), "b": fast_then(AnswerWhen(answered))},
            SETTINGS + "\n    hedging: {min_delay: 100ms}",
            # Two timers due at the same instant run in the order the loop\'s heap gives them:
            # with this seed the answer\'s runs first, as the scenario needs.
            seed=2,
        )()
        try:
            await learned(p)
            loop = asyncio.get_running_loop()
            now = loop.time()
            delay = p.pool.policy.hedging.min_delay
            for inst in p.pool.instances:  # the floor, not a prediction, times either hedge
                predicted = p.pool.timing.hedge_delay(inst, now, stream=False, max_tokens=16)
                assert predicted is not None and predicted < delay
            before = len(p.upstreams.sent)
            # Set before the request, so it fires first at the instant the hedge's timer does.
            loop.call_at(now + delay, answered.set)
            outcome = await p.request()
            _, spent = p.pool.budget.counts(loop.time())
            return p, outcome, before, len(p.upstreams.sent), spent
        finally:
            await p.watchdog.close()

    p, outcome, before, after, spent = run(scenario())
    assert (outcome.status, outcome.attempts) == (200, 1)
    assert after == before + 1, "the hedge never left"
    assert p.pool.stats.hedges == {"late": 1}
    assert spent == 0


def test_hedges_stop_when_the_retry_budget_is_spent() -> None:
    async def scenario() -> tuple[Pipeline, list[Outcome]]:
        p = await pipeline(
            {"a": fast_then(Answer(after_s=0.1)), "b": fast_then(Answer(after_s=0.1))},
            SETTINGS + "\n    retries: {budget: {ratio: 0.0001, min_per_second: 0.0001}}",
        )()
        try:
            await learned(p)
            return p, [await p.request() for _ in range(5)]
        finally:
            await p.watchdog.close()

    p, outcomes = run(scenario())
    assert [(o.status, o.attempts) for o in outcomes] == [(200, 1)] * 5
    assert p.pool.stats.hedges.get("no_budget", 0) >= 1
    assert set(p.pool.stats.hedges) == {"no_budget"}


def test_hedges_leave_half_the_retry_budget_to_retries() -> None:
    # A budget of 2 retries over the window (no ratio): hedges may take 1 of them. Three
    # instances turn slow: the balancer, having learned the first one slow, tries the others.
    async def scenario() -> tuple[Pipeline, list[Outcome], bool]:
        slow = {name: fast_then(Answer(after_s=0.1)) for name in "abc"}
        p = await pipeline(
            slow,
            SETTINGS + "\n    retries: {budget: {ratio: 0.0, min_per_second: 0.2}}",
        )()
        try:
            await learned(p)
            outcomes = [await p.request() for _ in range(6)]
            # A retry still finds its half of the budget.
            return p, outcomes, p.pool.budget.try_spend(asyncio.get_running_loop().time())
        finally:
            await p.watchdog.close()

    p, outcomes, retry_allowed = run(scenario())
    assert all(o.status == 200 for o in outcomes)
    hedges = p.pool.stats.hedges
    assert hedges.get("won", 0) + hedges.get("lost", 0) == 1
    assert hedges.get("no_budget", 0) >= 1
    assert retry_allowed


def test_only_an_attempt_stuck_queued_or_on_a_silent_instance_is_hedged() -> None:
    """An attempt its instance serves in its turn (the instance sends, has a slot for it, and
    has answered nothing sent after it) waits, however slow the instance: a hedge would start
    it over from nothing. Each of the other cases gets its hedge."""
    registry = Registry(parse_policy(policy_text(["a", "b", "c"])), now=0.0, rng=random.Random(3))
    pool = registry.pools["chat"]
    a, b, c = pool.instances
    for inst in (a, b, c):
        inst.price.peak.observe(1.0, 0.5)
        inst.capacity_seen = 4
    a.in_flight = 2
    sent = 10.0

    def in_turn() -> bool:
        return _in_its_turn(a, sent, 10.5)

    a.first_byte(9.0, 9.5)  # sent before this attempt: nothing since, nobody overtook it
    assert not in_turn(), "silent since it was sent"
    a.first_byte(9.8, 10.3)  # an earlier one answered while this one waits: its turn comes
    assert in_turn()
    a.in_flight = 6
    assert not in_turn(), "more in flight than it was seen serving: queued"
    a.in_flight = 2
    a.price.peak.observe(10.4, 5.0)
    assert in_turn(), "ten times slower than its peers, yet serving it in its turn"
    a.first_byte(10.1, 10.4)  # one sent after this attempt answered first: this one is stuck
    assert not in_turn()


def test_a_hedge_answered_with_a_429_pauses_its_instance() -> None:
    """After learning, a answers in 150 ms (past its hedge delay) and b answers 429 without
    Retry-After: a request that went to a first is hedged to b, whose 429 pauses b (its
    backoff, as after any attempt's 429: no attempt of any request goes there meanwhile)
    though the request is answered by a and the 429 never reaches the retry loop. (Where the
    first attempt goes is the balancer's draw between two equal instances: pools seeded
    differently until one draws a.)"""
    rate_limited = Answer(status=429, body=b'{"error": {"message": "rate limited"}}')

    async def scenario(seed: int) -> tuple[Pipeline, list[tuple[str, float]], Outcome]:
        p = await pipeline(
            {"a": fast_then(Answer(after_s=0.15)), "b": fast_then(rate_limited)},
            SETTINGS,
            seed=seed,
        )()
        try:
            await learned(p)
            before = len(p.upstreams.sent)
            outcome = await p.request()
            return p, [(s.instance, s.at) for s in p.upstreams.sent[before:]], outcome
        finally:
            await p.watchdog.close()

    for seed in range(40):
        p, sent, outcome = run(scenario(seed))
        if [name for name, _ in sent] == ["a", "b"]:  # first on a, hedged to b
            break
    else:
        raise AssertionError("no request went to a first and was hedged to b")
    assert (outcome.status, outcome.instance, outcome.attempts) == (200, "a", 2)
    b = p.pool.instance_named("b")
    assert b is not None and b.rate_limits_in_row == 1
    assert b.not_before >= sent[1][1] + 0.5  # at least the base backoff after its 429


def test_a_first_attempt_that_fails_with_an_unknown_error_ends_its_race(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first attempt fails, while its hedge waits on the other instance, with an error of
    no kind the race knows (a defect in a layer under the hedge): the request ends with it,
    and so does the hedge, which gives its instance back rather than holding it with nobody
    to end its answer."""
    defect = asyncio.Event()
    account = Account.__call__

    async def defective(self: Account, call: Call, next_handler: Handler) -> UpstreamResponse:
        instance = call.attempt.instance
        if defect.is_set() and call.attempts == 1 and instance is not None and instance.name == "a":
            await asyncio.sleep(0.05)  # past its hedge's delay
            raise RuntimeError("a defect under the hedge")
        return await account(self, call, next_handler)

    monkeypatch.setattr(Account, "__call__", defective)

    async def scenario() -> tuple[Pipeline, list[str], int]:
        p = await pipeline(
            {"a": fast_then(Answer(after_s=FAST_S)), "b": fast_then(Answer(after_s=1.0))},
            SETTINGS,
        )()
        try:
            await learned(p)
            defect.set()
            failed: list[str] = []
            for _ in range(20):  # until a request's first attempt goes to a
                try:
                    await p.request()
                except RuntimeError as error:
                    failed.append(str(error))
                    break
            await asyncio.sleep(2.0)  # past b's answer: a hedge left running would have it
            b = next(i for i in p.pool.instances if i.name == "b")
            return p, failed, b.in_flight
        finally:
            await p.watchdog.close()

    p, failed, b_in_flight = run(scenario())
    assert failed == ["a defect under the hedge"]
    assert p.upstreams.sent[-1].instance == "b"  # its hedge had left for b
    assert b_in_flight == 0


def test_an_attempt_that_fails_with_an_unknown_error_gives_its_instance_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A defect under the accounting layer (here, in the deadline layer) ends the request
    with it; the attempt ends too, counted neither for nor against its instance, rather than
    holding its slot for good."""
    defect = asyncio.Event()
    deadline = DeadlineLayer.__call__

    async def defective(self: DeadlineLayer, call: Call, next_handler: Handler) -> UpstreamResponse:
        if defect.is_set():
            defect.clear()  # once
            raise RuntimeError("a defect under the accounting")
        return await deadline(self, call, next_handler)

    monkeypatch.setattr(DeadlineLayer, "__call__", defective)

    async def scenario() -> tuple[Pipeline, str, int, int, Outcome]:
        p = await pipeline({"a": always(Answer(after_s=FAST_S))}, SETTINGS)()
        try:
            await p.request()
            a = p.pool.instances[0]
            failures = a.failures
            defect.set()
            try:
                await p.request()
                failed = ""
            except RuntimeError as error:
                failed = str(error)
            in_flight = a.in_flight
            return p, failed, in_flight, a.failures - failures, await p.request()
        finally:
            await p.watchdog.close()

    _, failed, in_flight, failures, after = run(scenario())
    assert failed == "a defect under the accounting"
    assert (in_flight, failures) == (0, 0)
    assert (after.status, after.instance) == (200, "a")
