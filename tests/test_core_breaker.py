from __future__ import annotations

import math
import random

import pytest

from gateway.config.models import BreakerPolicy
from gateway.core.breaker import (
    ADMITTING,
    ISOLATED,
    PROBING,
    BreakerState,
    PoolBreakers,
    Transition,
    isolation_cap,
)

# 3 timeouts, > 15 % over 60 s with >= 20, 5 s doubling to 120 s. The window rules are tested
# apart from consecutive failures (tested on their own below).
POLICY = BreakerPolicy(consecutive_failures=10_000)
RNG = random.Random(7)


def breaker(policy: BreakerPolicy = POLICY, jitter: float = 0.0) -> BreakerState:
    return BreakerState(policy, "a", jitter=jitter)


def ok(b: BreakerState, now: float, probe: bool = False) -> Transition | None:
    return b.record(now, False, False, RNG, probe)


def fail(b: BreakerState, now: float, probe: bool = False) -> Transition | None:
    return b.record(now, True, False, RNG, probe)


def timeout(b: BreakerState, now: float, probe: bool = False) -> Transition | None:
    return b.record(now, True, True, RNG, probe)


def trip_on_timeouts(b: BreakerState, now: float) -> Transition:
    for _ in range(POLICY.consecutive_timeouts - 1):
        assert timeout(b, now) is None
    transition = timeout(b, now)
    assert transition is not None
    return transition


# -- ADMITTING: the two trip rules --------------------------------------------------------------


def test_three_consecutive_timeouts_isolate() -> None:
    b = breaker()
    assert b.try_admit(0.0)
    assert timeout(b, 0.1) is None
    assert timeout(b, 0.2) is None
    assert timeout(b, 0.3) == Transition(
        "a", ADMITTING, ISOLATED, "3 consecutive timeouts", 5.3, silent=True
    )
    assert b.state == ISOLATED
    assert (b.backoff.streak, b.isolations, b.isolated_until) == (1, 1, 5.3)


@pytest.mark.parametrize(
    ("between", "isolated"),
    [
        (None, True),  # timeout, timeout, timeout
        (ok, False),  # a success resets the count
        (fail, False),  # so does a non-timeout failure
    ],
)
def test_any_other_result_resets_the_consecutive_timeouts(between: object, isolated: bool) -> None:
    b = breaker()
    timeout(b, 1.0)
    timeout(b, 1.0)
    if callable(between):
        between(b, 1.0)
    timeout(b, 1.0)
    assert (b.state == ISOLATED) is isolated


@pytest.mark.parametrize(
    ("successes", "failures", "isolated"),
    [
        (17, 3, False),  # 3/20 = 0.15: not strictly above 0.15
        (16, 4, True),  # 4/20 = 0.20
        (15, 4, False),  # 4/19 > 0.15 but fewer than min_requests (20) results
        (0, 19, False),  # 19 failures, 19 results: still below min_requests
        (0, 20, True),
    ],
)
def test_error_rate_over_the_window(successes: int, failures: int, isolated: bool) -> None:
    b = breaker()
    for i in range(successes):
        ok(b, i * 0.1)
    last = None
    for _ in range(failures):
        last = fail(b, 5.0)
    assert (b.state == ISOLATED) is isolated
    if isolated:
        assert last is not None
        results = successes + failures
        assert last.reason == (
            f"error rate {failures / results:.2f} over 60 s ({failures}/{results})"
        )


def test_error_rate_reason_text() -> None:
    b = breaker(BreakerPolicy(consecutive_failures=10_000, min_requests=50))
    for _ in range(29):
        ok(b, 1.0)
    transitions = [fail(b, 2.0) for _ in range(21)]
    assert transitions[-1] is not None
    assert transitions[-1].reason == "error rate 0.42 over 60 s (21/50)"
    assert [t for t in transitions[:-1] if t is not None] == []


def test_a_success_never_trips_even_when_it_completes_min_requests() -> None:
    b = breaker()
    for _ in range(10):
        fail(b, 1.0)
    for _ in range(10):
        assert ok(b, 1.0) is None  # 10/20 failed, but the last result was a success
    assert b.state == ADMITTING
    assert fail(b, 1.0) is not None  # the next failure trips: 11/21


def test_the_window_slides_per_second() -> None:
    b = breaker()
    for _ in range(10):
        fail(b, 0.5)  # second 0
    for _ in range(30):
        ok(b, 30.5)  # second 30
    assert b.counts.window_counts(30.5) == (40, 10)
    # Second 59 still holds second 0 (60 buckets: 0..59); second 60 has dropped it.
    assert b.counts.window_counts(59.9) == (40, 10)
    assert b.counts.window_counts(60.0) == (30, 0)
    # Second 90 drops second 30 too.
    assert b.counts.window_counts(90.0) == (0, 0)


def test_old_failures_leave_the_window_before_they_can_trip() -> None:
    b = breaker()
    for _ in range(15):
        fail(b, 0.0)  # 15 failures, under min_requests
    for _ in range(5):
        ok(b, 1.0)
    assert b.state == ADMITTING
    # At second 60 the failures are gone: 5 more failures are 5/10, under min_requests.
    for _ in range(5):
        fail(b, 60.0)
    assert b.state == ADMITTING
    assert b.counts.window_counts(60.0) == (10, 5)


def test_a_long_gap_empties_the_window() -> None:
    b = breaker()
    for _ in range(19):
        fail(b, 100.0)
    assert b.counts.window_counts(100.0) == (19, 19)
    assert b.counts.window_counts(10_000.0) == (0, 0)
    fail(b, 10_000.0)
    assert b.state == ADMITTING


def test_a_clock_that_goes_back_counts_in_the_newest_bucket() -> None:
    b = breaker()
    ok(b, 10.0)
    ok(b, 5.0)
    assert b.counts.window_counts(10.0) == (2, 0)


def test_a_fractional_window_has_whole_second_buckets() -> None:
    b = breaker(BreakerPolicy(consecutive_failures=10_000, window=0.5, min_requests=2))
    ok(b, 0.1)
    assert b.counts.window_counts(0.9) == (1, 0)
    assert b.counts.window_counts(1.0) == (0, 0)


# -- ISOLATED: how long -------------------------------------------------------------------------


def test_isolations_double_up_to_the_cap_and_decay_after_successful_probes() -> None:
    b = breaker(BreakerPolicy(isolation=5.0, max_isolation=60.0))
    now = 0.0
    durations = [trip_on_timeouts(b, now).until]
    for _ in range(5):  # five failed probes in a row
        now = b.isolated_until
        assert b.try_admit(now)
        transition = timeout(b, now, probe=True)
        assert transition is not None
        assert (transition.state_from, transition.to, transition.reason) == (
            PROBING,
            ISOLATED,
            "probe timed out",
        )
        assert transition.until is not None
        durations.append(transition.until - now)
    assert durations == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert (b.backoff.streak, b.isolations) == (6, 6)

    # A successful probe: ADMITTING, the streak down by one (6 -> 5).
    now = b.isolated_until
    assert b.try_admit(now)
    assert ok(b, now, probe=True) == Transition("a", PROBING, ADMITTING, "probe succeeded")
    assert b.backoff.streak == 5
    assert b.counts.window_counts(now) == (0, 0)
    assert b.counts.consecutive_timeouts == 0
    # Tripping again at once is the 6th in the streak: still at the cap.
    assert trip_on_timeouts(b, now).until == now + 60.0


@pytest.mark.parametrize(
    ("admitting_s", "streak_before", "isolation_s"),
    [
        (0.0, 3, 40.0),  # at once: streak 3 -> 4th isolation, 5 * 2**3
        (119.0, 3, 40.0),  # less than one max_isolation (120 s): nothing forgiven
        (120.0, 2, 20.0),  # one forgiven
        (359.0, 1, 10.0),  # two
        (360.0, 0, 5.0),  # three: back to the first step
        (10_000.0, 0, 5.0),  # never below zero
    ],
)
def test_the_streak_decays_with_probes_and_with_time_admitting(
    admitting_s: float, streak_before: int, isolation_s: float
) -> None:
    b = breaker()
    now = 0.0
    trip_on_timeouts(b, now)
    for _ in range(3):  # failed probes: streak 4
        now = b.isolated_until
        b.try_admit(now)
        fail(b, now, probe=True)
    assert b.backoff.streak == 4
    now = b.isolated_until
    b.try_admit(now)
    ok(b, now, probe=True)
    assert b.backoff.streak == 3  # the successful probe forgave one
    now += admitting_s
    transition = trip_on_timeouts(b, now)
    assert transition.until == now + isolation_s
    assert b.backoff.streak == streak_before + 1


def test_jitter_stays_within_ten_percent() -> None:
    rng = random.Random(1234)
    seen = []
    for _ in range(200):
        b = BreakerState(POLICY, "a")  # default jitter 0.1
        for _ in range(3):
            transition = b.record(0.0, True, True, rng)
        assert transition is not None and transition.until is not None
        seen.append(transition.until)
    assert all(4.5 <= until <= 5.5 for until in seen)
    assert max(seen) - min(seen) > 0.5  # it does vary


def test_jitter_is_reproducible_with_a_seed() -> None:
    def until(seed: int) -> float | None:
        b = BreakerState(POLICY, "a")
        rng = random.Random(seed)
        for _ in range(3):
            transition = b.record(0.0, True, True, rng)
        assert transition is not None
        return transition.until

    assert until(42) == until(42)
    assert until(42) != until(43)


def test_jitter_applies_after_the_cap() -> None:
    class High(random.Random):
        def random(self) -> float:
            return 0.999999

    b = BreakerState(BreakerPolicy(isolation=100.0, max_isolation=100.0), "a")
    for _ in range(3):
        b.record(0.0, True, True, High())
    assert b.isolated_until == pytest.approx(110.0, abs=1e-3)


# -- ISOLATED -> PROBING -> ... -----------------------------------------------------------------


def test_no_traffic_while_isolated_then_exactly_one_probe() -> None:
    b = breaker()
    trip_on_timeouts(b, 0.0)
    assert [b.try_admit(t) for t in (0.0, 1.0, 4.999)] == [False, False, False]
    assert b.remaining_s(2.0) == 3.0
    admitted = [b.try_admit(5.0 + i * 0.01) for i in range(100)]
    assert admitted.count(True) == 1 and admitted[0]
    assert b.state == PROBING
    assert b.remaining_s(6.0) == 0.0


def test_late_results_of_earlier_requests_do_not_decide_the_probe() -> None:
    b = breaker()
    trip_on_timeouts(b, 0.0)
    assert ok(b, 1.0) is None  # ISOLATED: ignored
    assert b.try_admit(5.0)
    assert ok(b, 5.5) is None  # not the probe: ignored
    assert fail(b, 5.6) is None
    assert b.state == PROBING
    assert fail(b, 6.0, probe=True) == Transition("a", PROBING, ISOLATED, "probe failed", 16.0)


def test_a_released_probe_lets_the_next_caller_probe() -> None:
    b = breaker()
    trip_on_timeouts(b, 0.0)
    assert b.try_admit(5.0)
    assert not b.try_admit(6.0)
    assert b.release_probe(7.0) == Transition("a", PROBING, ISOLATED, "probe released", 5.0)
    assert b.state == ISOLATED
    assert b.release_probe(7.0) is None  # not probing: nothing to release
    assert b.try_admit(7.0)
    assert not b.try_admit(7.0)
    assert b.backoff.streak == 1  # a cancelled probe is no evidence either way


def test_a_probe_outstanding_longer_than_max_isolation_lets_another_through() -> None:
    b = breaker()  # max_isolation 120 s
    trip_on_timeouts(b, 0.0)
    assert b.try_admit(5.0)
    assert not b.try_admit(125.0)  # exactly 120 s: not longer
    assert b.try_admit(125.5)
    assert not b.try_admit(126.0)
    assert ok(b, 130.0, probe=True) is not None
    assert b.state == ADMITTING


# -- operator actions ---------------------------------------------------------------------------


def test_operator_isolate_holds_until_restore() -> None:
    b = breaker()
    assert b.isolate(1.0, RNG) == Transition("a", ADMITTING, ISOLATED, "operator", math.inf)
    assert b.forced and b.remaining_s(2.0) == math.inf
    assert not b.try_admit(1e9)
    assert b.isolate(2.0, RNG) is None  # already forced
    assert ok(b, 3.0, probe=True) is None
    assert b.restore(4.0) == Transition("a", ISOLATED, ADMITTING, "operator")
    assert b.try_admit(4.0) and not b.forced
    assert b.restore(5.0) is None


def test_operator_isolate_overrides_a_probe_and_restore_clears_everything() -> None:
    b = breaker()
    for _ in range(15):
        ok(b, 0.0)
    trip_on_timeouts(b, 0.0)
    assert b.try_admit(5.0)
    transition = b.isolate(6.0, RNG, reason="maintenance")
    assert transition == Transition("a", PROBING, ISOLATED, "maintenance", math.inf)
    assert ok(b, 7.0, probe=True) is None  # the probe's late result changes nothing
    assert b.state == ISOLATED
    assert b.restore(8.0) is not None
    assert (b.backoff.streak, b.counts.consecutive_timeouts) == (0, 0)
    assert b.counts.window_counts(8.0) == (0, 0)
    assert b.isolations == 2


def test_an_unforced_isolate_is_a_regular_trip() -> None:
    b = breaker()
    transition = b.isolate(1.0, RNG, reason="health check failed", forced=False)
    assert transition == Transition("a", ADMITTING, ISOLATED, "health check failed", 6.0)
    assert b.isolate(2.0, RNG, reason="again", forced=False) is None
    assert b.try_admit(6.0)  # it probes back like any other


def test_an_uncapped_isolate_ignores_the_pools_cap() -> None:
    """An instance known down (it refused a connection) leaves whatever the cap: the cap is
    for statistical verdicts, where keeping a suspect in rotation may save capacity."""
    pool = PoolBreakers(POLICY, ["a", "b", "c"], jitter=0.0)
    assert pool.cap == 1
    assert pool["a"].isolate(0.0, RNG, reason="operator") is not None
    capped = pool["b"].isolate(0.0, RNG, reason="suspect", forced=False)
    assert capped is not None and capped.suppressed and pool["b"].state == ADMITTING
    down = pool["b"].isolate(0.0, RNG, reason="connection refused", forced=False, capped=False)
    assert down == Transition("b", ADMITTING, ISOLATED, "connection refused", 5.0)
    assert pool["b"].isolate(1.0, RNG, reason="again", forced=False, capped=False) is None
    assert pool["b"].try_admit(5.0) and pool["b"].state == PROBING  # back through a probe


# -- the pool's ejection cap --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "size", "cap"),
    [
        (0.5, 3, 1),
        (0.5, 4, 2),
        (0.0, 5, 1),
        (1.0, 1, 0),
        (0.5, 1, 0),
        (0.5, 2, 1),
        (0.29, 100, 29),
        (0.1, 3, 1),
    ],
)
def test_isolation_cap(fraction: float, size: int, cap: int) -> None:
    assert isolation_cap(fraction, size) == cap


def test_the_cap_suppresses_a_second_isolation_until_the_first_returns() -> None:
    pool = PoolBreakers(POLICY, ["a", "b", "c"], jitter=0.0)
    assert pool.cap == 1
    a, b = pool["a"], pool["b"]
    trip_on_timeouts(a, 0.0)
    assert a.state == ISOLATED and pool.isolated_count() == 1

    timeout(b, 1.0)
    timeout(b, 1.0)
    marker = timeout(b, 1.0)
    assert marker == Transition(
        "b", ADMITTING, ADMITTING, "3 consecutive timeouts (suppressed: cap)", None, True
    )
    assert b.state == ADMITTING and b.try_admit(1.0)
    assert b.suppressed_isolations == 1
    # It keeps failing: each further trip is refused and counted.
    assert timeout(b, 2.0) is not None
    assert (b.suppressed_isolations, pool.suppressed_isolations) == (2, 2)
    assert ok(b, 2.0) is None  # a success does not ask

    # While `a` probes it still counts; once `a` is back, `b` isolates on its next failures.
    assert a.try_admit(5.0)
    assert timeout(b, 5.5) is None  # consecutive count restarted by the success above
    timeout(b, 5.5)
    assert timeout(b, 5.5) is not None and b.state == ADMITTING
    assert ok(a, 6.0, probe=True) == Transition("a", PROBING, ADMITTING, "probe succeeded")
    transition = timeout(b, 6.0)
    assert transition is not None and not transition.suppressed
    assert (transition.to, transition.reason) == (ISOLATED, "4 consecutive timeouts")
    assert pool.isolated_count() == 1
    assert b.suppressed_isolations == 3


def test_operator_isolation_ignores_the_cap_but_counts_toward_it() -> None:
    pool = PoolBreakers(POLICY, ["a", "b", "c"], jitter=0.0)
    assert pool["a"].isolate(0.0, RNG) is not None
    assert pool["b"].isolate(0.0, RNG) is not None  # forced: allowed past the cap
    assert pool.isolated_count() == 2
    marker = pool["c"].isolate(0.0, RNG, reason="health", forced=False)
    assert marker is not None and marker.suppressed
    assert pool["c"].state == ADMITTING


def test_a_pool_of_one_never_isolates_its_only_instance() -> None:
    # A sidecar's only vLLM failing some requests: isolating it would fail them all.
    pool = PoolBreakers(POLICY, ["only"], jitter=0.0)
    only = pool["only"]
    assert pool.cap == 0
    markers = [timeout(only, now / 10) for now in range(10)]
    assert markers[:2] == [None, None]
    assert all(m is not None and m.suppressed for m in markers[2:])
    assert only.state == ADMITTING and only.try_admit(1.0)
    assert only.suppressed_isolations == 8
    # The operator still can.
    assert only.isolate(3.0, RNG) is not None and only.state == ISOLATED
    assert len(pool) == 1 and [x.instance for x in pool] == ["only"]


def test_instances_unavailable_for_other_reasons_count_against_the_cap() -> None:
    # Two instances: b is dead (its health checks fail, its breaker still admits). a failing a
    # third of its requests must not be isolated as well: that would leave nothing.
    down: set[str] = set()
    pool = PoolBreakers(
        POLICY, ["a", "b"], jitter=0.0, unavailable=lambda now, name, back: len(down - {name})
    )
    assert pool.cap == 1
    down.add("b")
    marker = trip_on_timeouts(pool["a"], 0.0)
    assert marker is not None and marker.suppressed and pool["a"].state == ADMITTING
    assert not pool.may_isolate(0.0, "a")
    # b itself may go, though: it is not counted against its own isolation.
    assert pool.may_isolate(0.0, "b")
    # b is back: a may go now, on its next trip.
    down.clear()
    assert pool.may_isolate(1.0, "a")
    transition = timeout(pool["a"], 1.0)
    assert transition is not None and transition.to == ISOLATED


def test_the_availability_count_is_asked_with_the_time_of_the_trip() -> None:
    asked: list[tuple[float, str]] = []

    def unavailable(now: float, name: str, back: str) -> int:
        asked.append((now, name))
        return 0

    pool = PoolBreakers(POLICY, ["a", "b", "c"], jitter=0.0, unavailable=unavailable)
    trip_on_timeouts(pool["a"], 7.5)
    assert asked == [(7.5, "a")] and pool["a"].state == ISOLATED
    # Once the cap is reached by isolations alone, nothing else needs asking.
    trip_on_timeouts(pool["b"], 8.0)
    assert asked == [(7.5, "a")] and pool["b"].state == ADMITTING


def test_a_shared_decision_is_held_to_the_availability_aware_cap() -> None:
    down = {"b"}
    pool = PoolBreakers(
        POLICY, ["a", "b"], jitter=0.0, unavailable=lambda now, name, back: len(down - {name})
    )
    marker = pool["a"].adopt(0.0, 5.0, "isolated by replica r2")
    assert marker is not None and marker.suppressed and pool["a"].state == ADMITTING
    down.clear()
    transition = pool["a"].adopt(0.0, 5.0, "isolated by replica r2")
    assert transition is not None and transition.to == ISOLATED


def test_duplicate_instance_names_are_refused() -> None:
    with pytest.raises(ValueError):
        PoolBreakers(POLICY, ["a", "a"])


def test_a_standalone_breaker_has_no_cap() -> None:
    b = breaker()
    trip_on_timeouts(b, 0.0)
    assert b.suppressed_isolations == 0 and b.state == ISOLATED


def test_consecutive_failures_trip_before_the_window_would() -> None:
    # A long healthy history keeps the error rate low; five refusals in a row still isolate.
    b = breaker(BreakerPolicy(consecutive_failures=5))
    rng = random.Random(0)
    for i in range(500):
        assert b.record(float(i) / 10, False, False, rng) is None
    for i in range(4):
        assert b.record(50.0 + i / 10, True, False, rng) is None
    transition = b.record(51.0, True, False, rng)
    assert transition is not None and transition.reason == "5 consecutive failures"
    assert b.state == "ISOLATED"


def test_a_success_resets_the_consecutive_failures() -> None:
    b = breaker(BreakerPolicy(consecutive_failures=3, min_requests=1000))
    rng = random.Random(0)
    for now, failed in [(1.0, True), (1.1, True), (1.2, False), (1.3, True), (1.4, True)]:
        assert b.record(now, failed, False, rng) is None
    assert b.record(1.5, True, False, rng) is not None


# -- the worse instance takes the place ---------------------------------------------------------


def test_a_tripping_instance_that_answers_nothing_takes_the_place_of_one_that_answers() -> None:
    # a (50x slow) ran out of time first and was isolated; a retry sent there since was answered.
    # b (frozen) then trips too, having answered nothing since before: a is let back, b goes out.
    pool = PoolBreakers(POLICY, ["a", "b"], jitter=0.0)
    a, b = pool["a"], pool["b"]
    ok(b, 0.0)
    trip_on_timeouts(a, 1.0)
    assert a.state == ISOLATED
    assert ok(a, 1.5) is None and a.state == ISOLATED  # counted for nothing but the evidence
    transition = trip_on_timeouts(b, 2.0)
    assert (transition.instance, transition.to, transition.suppressed) == ("b", ISOLATED, False)
    assert transition.displaced == Transition("a", ISOLATED, ADMITTING, "let back: b is worse")
    assert (a.state, b.state) == (ADMITTING, ISOLATED)
    assert a.try_admit(2.0) and not b.try_admit(2.0)
    assert pool.isolated_count() == 1
    # b never answers: a's next trips are refused, not swapped back.
    marker = trip_on_timeouts(a, 3.0)
    assert marker.suppressed and marker.displaced is None and b.state == ISOLATED


def test_an_instance_that_was_answering_when_isolated_is_let_back_for_one_that_was_not() -> None:
    # a (slow, failing 30 %) went out on its error rate while still answering; b froze before
    # that and trips on timeouts: b has answered nothing for longer, so b goes out instead.
    policy = BreakerPolicy(consecutive_failures=10_000, min_requests=5)
    pool = PoolBreakers(policy, ["a", "b"], jitter=0.0)
    a, b = pool["a"], pool["b"]
    ok(b, 0.5)
    for _ in range(4):
        ok(a, 1.0)
    transition = fail(a, 1.1)  # 1 of 5
    assert transition is not None and transition.reason.startswith("error rate")
    assert a.state == ISOLATED
    transition = trip_on_timeouts(b, 2.0)
    assert transition.to == ISOLATED and transition.displaced is not None
    assert (a.state, b.state) == (ADMITTING, ISOLATED)


def test_an_instance_that_cannot_take_traffic_anyway_is_not_let_back() -> None:
    # a went out, then its health checks failed too: letting it back would not make room.
    down: set[str] = set()
    pool = PoolBreakers(
        POLICY,
        ["a", "b", "c"],
        jitter=0.0,
        unavailable=lambda now, name, back: len(
            {n for n in down - {name} if pool[n].state == ADMITTING or n == back}
        ),
    )
    a, b = pool["a"], pool["b"]
    trip_on_timeouts(a, 1.0)
    ok(a, 1.5)
    down.add("a")
    marker = trip_on_timeouts(b, 2.0)
    assert marker.suppressed and marker.displaced is None
    assert (a.state, b.state) == (ISOLATED, ADMITTING)


def test_no_place_is_taken_for_an_instance_that_answered_later_than_the_isolated_one() -> None:
    pool = PoolBreakers(POLICY, ["a", "b"], jitter=0.0)
    a, b = pool["a"], pool["b"]
    trip_on_timeouts(a, 1.0)
    ok(a, 1.2)
    ok(b, 1.5)  # b answered after a did: both answer; the first to go stays out
    marker = trip_on_timeouts(b, 2.0)
    assert marker.suppressed and (a.state, b.state) == (ISOLATED, ADMITTING)


def test_an_error_rate_trip_takes_no_place() -> None:
    # A share of failures is not "answers nothing": such trips never displace anyone.
    pool = PoolBreakers(POLICY, ["a", "b"], jitter=0.0)
    a, b = pool["a"], pool["b"]
    for _ in range(17):
        ok(b, 0.1)
    trip_on_timeouts(a, 0.2)
    ok(a, 0.3)
    for _ in range(3):
        assert fail(b, 1.0) is None  # 3/20 is not above 15 %
    marker = fail(b, 1.0)
    assert marker is not None and marker.suppressed and marker.displaced is None
    assert marker.reason.startswith("error rate")
    assert (a.state, b.state) == (ISOLATED, ADMITTING)


def test_operator_isolations_and_probes_keep_their_place() -> None:
    pool = PoolBreakers(POLICY, ["a", "b", "c"], jitter=0.0)
    a, b, c = pool["a"], pool["b"], pool["c"]
    assert a.isolate(0.0, RNG) is not None  # the operator's: fills the cap of 1
    ok(a, 0.5)
    assert trip_on_timeouts(b, 1.0).suppressed and a.forced

    pool = PoolBreakers(POLICY, ["a", "b", "c"], jitter=0.0)
    a, b, c = pool["a"], pool["b"], pool["c"]
    trip_on_timeouts(a, 0.0)
    assert a.try_admit(POLICY.isolation + 1) and a.state == PROBING
    ok(a, POLICY.isolation + 1.5)  # not the probe's result: a stays PROBING
    assert a.state == PROBING
    assert trip_on_timeouts(b, POLICY.isolation + 2).suppressed
    assert c.state == ADMITTING


def test_no_place_is_taken_when_the_pool_would_still_be_over_its_cap() -> None:
    # c stops taking traffic (unhealthy) after a went out: letting a back would not make room
    # for b, so a stays out and b stays in.
    down: set[str] = set()
    pool = PoolBreakers(
        POLICY, ["a", "b", "c"], jitter=0.0, unavailable=lambda now, name, back: len(down - {name})
    )
    a, b = pool["a"], pool["b"]
    trip_on_timeouts(a, 1.0)
    ok(a, 1.5)
    down.add("c")
    marker = trip_on_timeouts(b, 2.0)
    assert marker.suppressed and marker.displaced is None
    assert (a.state, b.state) == (ISOLATED, ADMITTING)


def test_only_an_isolation_for_answered_failures_may_end_early_for_a_probe() -> None:
    failures = BreakerPolicy(consecutive_failures=2, isolation=30.0)
    answered = breaker(failures)
    fail(answered, 0.0)
    assert fail(answered, 0.5) is not None and answered.state == ISOLATED
    assert not answered.try_admit(1.0)  # not due: 30 s
    assert answered.try_admit(1.0, early=True) and answered.state == PROBING
    # The early probe fails: isolated again, the next isolation longer; no second early probe
    # within a second of the first.
    transition = fail(answered, 1.2, probe=True)
    assert transition is not None and transition.to == ISOLATED
    assert answered.isolated_until == pytest.approx(1.2 + 60.0)
    assert not answered.try_admit(1.9, early=True)
    assert answered.try_admit(2.0, early=True)
    # Its request was cancelled: the isolation goes on to its end, early probes a second
    # apart as before (released, it once lifted the whole isolation).
    released = answered.release_probe(2.05)
    assert released is not None and released.until == pytest.approx(1.2 + 60.0)
    assert answered.remaining_s(2.05) == pytest.approx(1.2 + 60.0 - 2.05)
    assert not answered.try_admit(2.1) and not answered.try_admit(2.1, early=True)
    assert answered.try_admit(3.0, early=True)
    assert ok(answered, 3.1, probe=True) is not None and answered.state == ADMITTING

    silent = breaker()  # three timeouts: silent, maybe hung
    for t in (0.0, 0.1, 0.2):
        timeout(silent, t)
    assert silent.state == ISOLATED and not silent.try_admit(2.0, early=True)

    forced = breaker(failures)
    forced.isolate(0.0, RNG)  # the operator
    assert not forced.try_admit(2.0, early=True)

    down = breaker(failures)
    down.isolate(0.0, RNG, "refused", forced=False, capped=False)  # known down
    assert not down.try_admit(2.0, early=True)

    shared = breaker(failures)
    shared.adopt(0.0, 30.0, "another replica")
    assert not shared.try_admit(2.0, early=True)


def test_the_share_it_fails_is_its_window_rate_or_its_run_of_failures() -> None:
    b = breaker()  # a 60 s window; no trip on failures in a row
    assert b.failure_share(0.0) == 1.0  # nothing known
    for t in range(6):
        ok(b, float(t))
    for t in (6.0, 7.0):
        fail(b, t)
    assert b.failure_share(7.0) == pytest.approx(2 / 3)  # two in a row outweigh 2 of 8
    ok(b, 8.0)
    assert b.failure_share(8.0) == pytest.approx(2 / 9)  # the window's rate
    for t in range(9, 18):
        fail(b, float(t))
    assert b.failure_share(17.0) == pytest.approx(0.9)  # nine in a row: 11 of 18 in the window


def test_an_instance_back_up_by_its_health_checks_is_probed_at_once() -> None:
    b = breaker(BreakerPolicy(consecutive_failures=2, isolation=30.0))
    fail(b, 0.0)
    fail(b, 0.1)
    assert b.state == ISOLATED and not b.try_admit(5.0)
    assert b.back_up(5.0)
    assert b.try_admit(5.0) and b.state == PROBING  # the next request probes it
    assert ok(b, 5.1, probe=True) is not None and b.state == ADMITTING
    assert not b.back_up(6.0)  # admitting: nothing to end
    forced = breaker()
    forced.isolate(0.0, RNG)  # the operator's
    assert not forced.back_up(1.0) and not forced.try_admit(1.0)


def test_spare_probes_come_a_second_apart_and_leave_the_isolation_as_it_was() -> None:
    """Nothing admits and fallbacks answer meanwhile: an isolated instance may be probed before
    its isolation ends, a second apart; a failed spare probe neither lengthens the isolation
    nor counts as a new one, a cancelled one leaves it running, a good one ends it."""
    down = breaker(BreakerPolicy(consecutive_failures=2, isolation=30.0))
    down.isolate(0.0, RNG, "refused", forced=False, capped=False)
    until, isolations = down.isolated_until, down.isolations
    assert not down.try_admit(1.0)  # not due, and not spare
    assert down.try_admit(1.0, spare=True) and down.state == PROBING
    assert fail(down, 1.1, probe=True) is None  # nothing to tell: isolated as it was
    assert down.state == ISOLATED
    assert (down.isolated_until, down.isolations) == (until, isolations)
    assert not down.try_admit(1.9, spare=True)  # a second after the last one
    assert down.try_admit(2.0, spare=True)
    released = down.release_probe(2.1)  # its request was cancelled
    assert released is not None and down.isolated_until == until
    assert down.try_admit(3.1, spare=True)
    assert ok(down, 3.2, probe=True) is not None and down.state == ADMITTING

    forced = breaker()
    forced.isolate(0.0, RNG)  # the operator's: never probed ahead
    assert not forced.try_admit(5.0, spare=True)
