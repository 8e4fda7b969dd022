from __future__ import annotations

from gateway.core.health import HealthState


def test_unknown_until_the_first_pass_then_cold_start_is_recorded() -> None:
    state = HealthState(now=100.0, healthy_threshold=2, unhealthy_threshold=2)
    assert state.healthy is None and state.cold_start_s is None
    assert state.record(101.0, False, "connection refused") is None
    change = state.record(102.0, False, "connection refused")
    assert change is not None and change.healthy is False
    assert state.record(103.0, True, "200") is None  # one pass is not enough (threshold 2)
    change = state.record(104.0, True, "200")
    assert change is not None and change.healthy is True
    assert state.cold_start_s == 4.0 and state.healthy_since == 104.0


def test_thresholds_in_both_directions() -> None:
    state = HealthState(now=0.0, healthy_threshold=1, unhealthy_threshold=3)
    assert state.record(1.0, True, "200") is not None
    assert state.record(2.0, False, "503") is None
    assert state.record(3.0, True, "200") is None  # a pass resets the failure streak
    assert state.record(4.0, False, "503") is None
    assert state.record(5.0, False, "503") is None
    change = state.record(6.0, False, "503")
    assert change is not None and not change.healthy and state.healthy_since is None
    assert state.record(7.0, True, "200") is not None
    assert state.healthy_since == 7.0 and state.cold_start_s == 1.0  # the first, not the latest


def test_back_is_healthy_again_after_a_spell_not_healthy_for_the_first_time() -> None:
    state = HealthState(now=0.0, healthy_threshold=1, unhealthy_threshold=1)
    assert state.record(1.0, False, "connection refused") is not None
    assert not state.back  # never healthy yet
    assert state.record(2.0, True, "200") is not None
    assert not state.back  # a new instance's first pass: no fault behind it
    assert state.record(3.0, False, "503") is not None
    assert not state.back  # down
    assert state.record(4.0, True, "200") is not None
    assert state.back


def test_assumed_healthy_without_checks() -> None:
    state = HealthState.assumed_healthy(5.0)
    assert state.healthy is True and state.cold_start_s == 0.0


def test_in_doubt_while_checks_disagree_with_the_verdict() -> None:
    state = HealthState(0.0, healthy_threshold=2, unhealthy_threshold=2)
    assert not state.in_doubt  # unknown, nothing passed yet
    state.record(1.0, True, "HTTP 200")
    assert state.healthy is None and state.in_doubt  # one pass of two: check again soon
    state.record(2.0, True, "HTTP 200")
    assert state.healthy is True and not state.in_doubt
    state.record(3.0, False, "no answer within 1s")
    assert state.healthy is True and state.in_doubt
    state.record(4.0, False, "no answer within 1s")
    assert state.healthy is False and not state.in_doubt
    state.record(5.0, True, "HTTP 200")
    assert state.healthy is False and state.in_doubt
    state.record(6.0, False, "HTTP 503")
    assert not state.in_doubt


def test_a_refused_connection_is_unhealthy_at_once_and_checks_bring_it_back() -> None:
    state = HealthState(0.0, healthy_threshold=2, unhealthy_threshold=5)
    state.record(1.0, True, "HTTP 200")
    state.record(2.0, True, "HTTP 200")
    assert state.healthy is True and state.answered
    state.record(2.5, False, "HTTP 503")  # a failed check first: the run is 1 of 5
    change = state.refused("cannot connect to the upstream: Connection refused")
    assert change is not None and change.healthy is False  # not after 4 more failures
    assert state.healthy_since is None and not state.answered
    assert state.refused("again") is None  # no second change
    assert state.record(3.0, True, "HTTP 200") is None  # its threshold, as from any verdict
    change = state.record(4.0, True, "HTTP 200")
    assert change is not None and change.healthy is True and state.healthy_since == 4.0


def test_a_refused_connection_before_any_verdict_leaves_it_unknown() -> None:
    state = HealthState(0.0, healthy_threshold=1, unhealthy_threshold=2)
    assert state.refused("refused") is None
    assert state.healthy is None


def test_a_down_instance_with_nothing_answering_is_watched_an_answering_one_is_not() -> None:
    state = HealthState(0.0, healthy_threshold=1, unhealthy_threshold=1)
    state.record(1.0, True, "HTTP 200")
    assert not state.watched  # healthy, no doubt: the regular interval
    state.refused("refused")
    assert state.watched  # down, nothing listening: a restart is looked for soon
    state.record(2.0, False, "HTTP 503", answered=True)
    assert not state.watched  # down but answering: it is not restarting
    state.record(3.0, False, "ClientConnectorError", answered=False)
    assert state.watched
