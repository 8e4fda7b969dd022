"""Shared decisions: the codec, ordering, and how another replica's decision meets our breaker."""

from __future__ import annotations

import json
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
)
from gateway.core.decision import (
    Decision,
    MalformedDecision,
    Marks,
    apply_remote,
    decode,
    from_transition,
    withdraw,
)

RNG = random.Random(3)
POLICY = BreakerPolicy(consecutive_timeouts=1, isolation=5.0, max_isolation=60.0)
WALL0 = 1_800_000_000.0  # wall clock when the monotonic clock reads 0
TTL = 3.0


def isolated(at: float, until: float | None, replica: str = "r2", forced: bool = False) -> Decision:
    return Decision("p", "a", "ISOLATED", "3 consecutive timeouts", replica, at, until, forced)


def restored(at: float, replica: str = "r2", forced: bool = False) -> Decision:
    return Decision("p", "a", "ADMITTING", "probe succeeded", replica, at, None, forced)


def apply(b: BreakerState, marks: Marks, d: Decision, now: float) -> Transition | None:
    return apply_remote(b, marks, d, now, WALL0 + now, TTL)


# -- codec ------------------------------------------------------------------------------------


def test_encode_decode_round_trip() -> None:
    d = isolated(WALL0 + 1.5, WALL0 + 6.5)
    assert decode(d.encode()) == d
    forced = isolated(WALL0, None, forced=True)
    assert decode(forced.encode().decode()) == forced
    assert json.loads(d.encode())["state"] == "ISOLATED"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"v": 2}', "unknown version"),
        (b"\xff\xfe", "not JSON"),
        (b"x" * 5000, "more than"),
    ],
)
def test_decode_rejects_what_is_not_a_decision(raw: bytes, message: str) -> None:
    with pytest.raises(MalformedDecision, match=message):
        decode(raw)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"state": "OPEN"}, "unknown state"),
        ({"pool": ""}, "pool must be"),
        ({"instance": 3}, "instance must be"),
        ({"at": "soon"}, "at must be"),
        ({"at": True}, "at must be"),
        ({"until": 1e400}, "until must be"),
        ({"until": None}, "needs an end"),
        ({"forced": "yes"}, "forced must be"),
        ({"extra": 1}, "unknown fields"),
    ],
)
def test_decode_checks_every_field(change: dict[str, object], message: str) -> None:
    data = json.loads(isolated(WALL0, WALL0 + 5).encode())
    data.update(change)
    with pytest.raises(MalformedDecision, match=message):
        decode(json.dumps(data).encode())


# -- our own transitions, as decisions ----------------------------------------------------------


def test_a_trip_becomes_an_isolation_with_a_wall_clock_end() -> None:
    t = Transition("a", ADMITTING, ISOLATED, "3 consecutive timeouts", until=12.0)
    d = from_transition("p", t, "r1", wall_now=WALL0 + 10, mono_now=10.0)
    assert d == Decision(
        "p", "a", "ISOLATED", "3 consecutive timeouts", "r1", WALL0 + 10, WALL0 + 12, False
    )


def test_operator_isolation_and_restore_are_forced() -> None:
    iso = from_transition(
        "p", Transition("a", ADMITTING, ISOLATED, "operator", math.inf), "r1", 5, 5
    )
    assert iso is not None and iso.forced and iso.until is None
    back = Transition("a", ISOLATED, ADMITTING, "operator")
    restore = from_transition("p", back, "r1", 6, 6, operator=True)
    assert restore is not None and restore.forced and restore.state == "ADMITTING"
    probe_ok = from_transition(
        "p", Transition("a", PROBING, ADMITTING, "probe succeeded"), "r1", 6, 6
    )
    assert probe_ok is not None and not probe_ok.forced


def test_refused_trips_and_released_probes_are_not_shared() -> None:
    refused = Transition("a", ADMITTING, ADMITTING, "x (suppressed: cap)", None, True)
    assert from_transition("p", refused, "r1", 1, 1) is None
    released = Transition("a", PROBING, ISOLATED, "probe released", 1.0)
    assert from_transition("p", released, "r1", 1, 1) is None


# -- adopting another replica's isolation ------------------------------------------------------


def test_isolation_is_adopted_until_its_end_or_the_ttl() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    t = apply(b, marks, isolated(WALL0 + 10, WALL0 + 12), now=10.0)
    assert t is not None and t.to == ISOLATED and t.reason.startswith("shared by r2")
    assert b.state == ISOLATED and b.isolated_until == pytest.approx(12.0)
    assert marks.decided_by == "r2"
    # A longer isolation is trusted only for the TTL, then must be heard of again.
    b2, marks2 = BreakerState(POLICY, "a"), Marks()
    apply(b2, marks2, isolated(WALL0 + 10, WALL0 + 100), now=10.0)
    assert b2.isolated_until == pytest.approx(10.0 + TTL)
    # Heard again a second later: extended, and still no more than the TTL ahead.
    assert apply(b2, marks2, isolated(WALL0 + 10, WALL0 + 100), now=11.0) is None
    assert b2.isolated_until == pytest.approx(11.0 + TTL)


def test_an_operator_isolation_elsewhere_lasts_while_it_is_renewed() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    apply(b, marks, isolated(WALL0, None, forced=True), now=0.0)
    assert b.state == ISOLATED and b.isolated_until == pytest.approx(TTL)
    assert not b.forced  # only our own operator's isolation is forced here


def test_an_isolation_already_over_is_not_adopted() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    assert apply(b, marks, isolated(WALL0 + 1, WALL0 + 4), now=5.0) is None
    assert b.state == ADMITTING


def test_the_cap_holds_against_shared_decisions() -> None:
    pool = PoolBreakers(POLICY.model_copy(update={"max_isolated_fraction": 0.5}), list("abcd"))
    results = []
    for name in "abcd":
        d = Decision("p", name, "ISOLATED", "forged", "evil", WALL0, WALL0 + 1e6)
        results.append(apply_remote(pool[name], Marks(), d, 0.0, WALL0, TTL))
    assert [b.state for b in pool] == [ISOLATED, ISOLATED, ADMITTING, ADMITTING]
    assert [t is not None and t.suppressed for t in results] == [False, False, True, True]
    assert pool.suppressed_isolations == 2


def test_a_probe_in_flight_is_not_overruled() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    b.record(0.0, True, True, RNG)  # trips: one timeout
    assert b.try_admit(10.0) and b.state == PROBING
    assert apply(b, marks, isolated(WALL0 + 10, WALL0 + 20), now=10.0) is None
    assert b.state == PROBING


# -- lifting ------------------------------------------------------------------------------------


def test_a_restore_elsewhere_lifts_the_isolation_here() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    apply(b, marks, isolated(WALL0 + 1, WALL0 + 6), now=1.0)
    t = apply(b, marks, restored(WALL0 + 7), now=2.0)
    assert t is not None and t.to == ADMITTING and t.reason.startswith("restored by r2")
    assert b.state == ADMITTING and marks.decided_by is None
    assert b.try_admit(2.0)


def test_our_own_isolation_is_lifted_by_a_newer_restore() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    trip = b.record(1.0, True, True, RNG)
    assert trip is not None
    own = from_transition("p", trip, "r1", WALL0 + 1, 1.0)
    assert own is not None
    marks.own(own)
    assert apply(b, marks, restored(WALL0 + 0.5), now=1.2) is None  # older: stale
    assert b.state == ISOLATED
    assert apply(b, marks, restored(WALL0 + 7), now=7.0) is not None
    assert b.state == ADMITTING


def test_stale_isolations_are_ignored_after_a_restore() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    apply(b, marks, isolated(WALL0 + 1, WALL0 + 6), now=1.0)
    apply(b, marks, restored(WALL0 + 2), now=2.0)
    # A renewal of the old isolation, written just before its holder heard of the restore.
    assert apply(b, marks, isolated(WALL0 + 1, WALL0 + 6), now=2.1) is None
    assert b.state == ADMITTING
    # A new isolation after the restore is adopted.
    assert apply(b, marks, isolated(WALL0 + 3, WALL0 + 8), now=3.0) is not None


def test_an_operator_isolation_yields_only_to_an_operator_restore() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    b.isolate(0.0, RNG)  # our operator
    assert apply(b, marks, restored(WALL0 + 1), now=1.0) is None
    assert b.state == ISOLATED and b.forced
    assert apply(b, marks, restored(WALL0 + 2, forced=True), now=2.0) is not None
    assert b.state == ADMITTING
    # Elsewhere: an operator's isolation survives a probe's restore that is newer...
    b2, marks2 = BreakerState(POLICY, "a"), Marks()
    marks2.note(restored(WALL0 + 5))
    apply(b2, marks2, isolated(WALL0 + 4, None, forced=True), now=6.0)
    assert b2.state == ISOLATED
    # ...but not an operator's restore that is newer.
    b3, marks3 = BreakerState(POLICY, "a"), Marks()
    marks3.note(restored(WALL0 + 5, forced=True))
    assert apply(b3, marks3, isolated(WALL0 + 4, None, forced=True), now=6.0) is None
    assert b3.state == ADMITTING


def test_duplicate_restores_do_nothing() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    apply(b, marks, isolated(WALL0 + 1, WALL0 + 6), now=1.0)
    assert apply(b, marks, restored(WALL0 + 2), now=2.0) is not None
    assert apply(b, marks, restored(WALL0 + 2), now=2.5) is None


# -- the probe lease gate ------------------------------------------------------------------------


def test_probing_waits_for_the_lease() -> None:
    b = BreakerState(POLICY, "a", jitter=0.0)
    b.record(0.0, True, True, RNG)
    assert b.isolated_until == pytest.approx(5.0)
    b.lease_until = 0.0  # shared: another replica may hold the probe
    assert not b.try_admit(6.0) and b.state == ISOLATED
    b.lease_until = 7.0  # the lease is ours until 7
    assert b.try_admit(6.5) and b.state == PROBING
    assert b.changed_at == 6.5


def test_an_expired_lease_does_not_start_a_probe() -> None:
    b = BreakerState(POLICY, "a", jitter=0.0)
    b.record(0.0, True, True, RNG)
    b.lease_until = 6.0
    assert not b.try_admit(6.0)


def test_lift_after_a_probe_elsewhere_lowers_the_streak() -> None:
    b = BreakerState(POLICY, "a", jitter=0.0)
    b.record(0.0, True, True, RNG)
    assert b.backoff.streak == 1
    b.lift(1.0, "restored by r2")
    assert b.backoff.streak == 0 and b.state == ADMITTING and b.counts.consecutive_timeouts == 0


def test_a_newer_isolation_elsewhere_supersedes_ours() -> None:
    b, marks = BreakerState(POLICY, "a", jitter=0.0), Marks()
    trip = b.record(1.0, True, True, RNG)
    assert trip is not None
    own = from_transition("p", trip, "r1", WALL0 + 1, 1.0)
    assert own is not None
    marks.own(own)
    # An older one does not take it over; a newer one does, and extends the isolation.
    apply(b, marks, isolated(WALL0 + 0.5, WALL0 + 5.5, replica="r0"), now=1.1)
    assert marks.decided_by is None
    apply(b, marks, isolated(WALL0 + 2, WALL0 + 8, replica="r3"), now=2.0)
    assert marks.decided_by == "r3"
    assert b.isolated_until == pytest.approx(6.0)  # the later end of the two is kept


def test_a_withdrawn_decision_is_lifted_only_where_it_was_adopted() -> None:
    b, marks = BreakerState(POLICY, "a"), Marks()
    apply(b, marks, isolated(WALL0, WALL0 + 30), now=0.0)
    t = withdraw(b, marks, 1.0)
    assert t is not None and t.to == ADMITTING and "withdrawn or expired" in t.reason
    assert marks.decided_by is None and b.state == ADMITTING
    # Our own isolation, or a probe of ours, is not for the store to lift.
    own = BreakerState(POLICY, "a")
    own.record(0.0, True, True, RNG)
    assert withdraw(own, Marks(), 1.0) is None and own.state == ISOLATED
    probing, marks2 = BreakerState(POLICY, "a"), Marks()
    apply(probing, marks2, isolated(WALL0, WALL0 + 1), now=0.0)
    assert probing.try_admit(2.0)
    assert withdraw(probing, marks2, 2.0) is None and probing.state == PROBING
