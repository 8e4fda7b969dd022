"""The balancer prices an instance by its pace, not by a stall of the whole engine its attempts
lived through. When every stream an instance runs goes silent at once for long (a freeze, a
pause), that silence is left out of the prices of the attempts it delayed: a stream's pace
after its first byte, a wait for a first byte, a whole answer's time; a wait is priced at no
less than a usual one there (at none, the engine would look free for having stalled). A
silence while bytes flow on other streams is no stall of the engine.

Driven through `Feedback.attempt_finished`, the one way an attempt's outcome reaches its
instance, with the instance's own record of the bytes it sent (`progressed`)."""

from __future__ import annotations

import pytest

from gateway.core.balancer import REFERENCE_TOKENS
from gateway.core.outcome import Outcome
from gateway.upstream.feedback import Feedback
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from tests.test_lost_races import Clock
from tests.test_lost_races import setting as base_setting

OK = Outcome("ok", 200)


def setting() -> tuple[PoolState, InstanceState, Clock]:
    """A pool whose instance `a` has learned its streams' largest gaps (0.1 s) and first bytes
    (0.2 s)."""
    _, pool, a, clock = base_setting()
    for _ in range(5):
        a.latency.gap.observe(0.1)
        a.latency.ttfb.observe(0.2)
    return pool, a, clock


def running(a: InstanceState, start: float, streams: int) -> None:
    """`streams` sent at `start`, each past its first byte at 0.1 s."""
    for _ in range(streams):
        a.attempt_started(0)
        a.first_byte(start, start + 0.1)
        a.stream_started()


def frozen_engine(a: InstanceState, clock: Clock) -> None:
    """Two streams from t = 0 to 4 s, an event every 0.1 s, none from 1 to 2 s on either."""
    start = clock.now
    running(a, start, 2)
    for tenth in range(2, 41):
        if not 1.0 < tenth / 10 < 2.0:
            a.progressed(start + tenth / 10)
    clock.now = start + 4.0


def flowing_engine(a: InstanceState, clock: Clock) -> None:
    """The same two streams, the first silent from 1 to 2 s while the second's events go on."""
    start = clock.now
    running(a, start, 2)
    for tenth in range(2, 41):
        a.progressed(start + tenth / 10)
    clock.now = start + 4.0


def finish(
    pool: PoolState, a: InstanceState, clock: Clock, first_byte_s: float | None, tokens: int
) -> float:
    """An attempt sent 4 s ago ends well now (a stream past its first byte after
    `first_byte_s`, or a whole answer: None): what the balancer prices it at then."""
    feedback = Feedback(lambda pool_name, transition: None)
    a.attempt_ended(0)
    if first_byte_s is not None:
        a.stream_ended()
    feedback.attempt_finished(pool, a, OK, clock.now, 4.0, False, first_byte_s, tokens=tokens)
    return a.price.peak.peek(clock.now)


def test_a_stall_of_the_whole_engine_is_left_out_of_the_streams_it_froze() -> None:
    pool, a, clock = setting()
    start = clock.now
    frozen_engine(a, clock)
    assert (a.stall.since, a.stall.until) == (start + 1.0, start + 2.0)
    # Priced at the 3 s the stream took besides the stall, not at its 4 s.
    assert finish(pool, a, clock, 0.1, REFERENCE_TOKENS) == pytest.approx(3.0)


def test_a_long_streams_pace_leaves_the_stall_out_and_keeps_its_first_byte() -> None:
    """Twice the reference length: its first byte, then half of the rest at its pace."""
    pool, a, clock = setting()
    frozen_engine(a, clock)
    priced = finish(pool, a, clock, 0.1, 2 * REFERENCE_TOKENS)
    assert priced == pytest.approx(0.1 + (4.0 - 0.1 - 1.0) / 2)


def test_a_wait_for_a_first_byte_through_a_stall_is_priced_as_a_usual_wait() -> None:
    """A stream sent just before the engine froze got its first byte 0.05 s after it thawed:
    priced at a usual first byte there (0.2 s), not at the 1.15 s it waited, nor at 0.15 s."""
    _, a, clock = setting()
    start = clock.now
    frozen_engine(a, clock)
    usual = a.latency.ttfb.mean
    assert a.stall.unstalled_wait_s(start + 0.9, start + 2.05, usual) == pytest.approx(0.2)
    # Out of the stall, a wait is its own, however short or long.
    assert a.stall.unstalled_wait_s(start + 2.5, start + 2.55, usual) == pytest.approx(0.05)
    assert a.stall.unstalled_wait_s(start + 2.5, start + 3.9, usual) == pytest.approx(1.4)


def test_a_stream_that_waited_out_a_stall_is_priced_by_a_usual_first_byte_and_its_pace() -> None:
    """Sent at 0.9 s, first byte at 2.05 s, ended at 4 s: a usual first byte, then 1.95 s."""
    pool, a, clock = setting()
    frozen_engine(a, clock)
    feedback = Feedback(lambda pool_name, transition: None)
    a.attempt_ended(0)
    a.stream_ended()
    feedback.attempt_finished(pool, a, OK, clock.now, 3.1, False, 1.15, tokens=REFERENCE_TOKENS)
    assert a.price.peak.peek(clock.now) == pytest.approx(0.2 + 1.95)


def test_a_whole_answer_that_lived_through_a_stall_is_priced_without_it() -> None:
    pool, a, clock = setting()
    frozen_engine(a, clock)
    assert finish(pool, a, clock, None, REFERENCE_TOKENS) == pytest.approx(3.0)


def test_a_silence_while_bytes_flow_on_other_streams_is_no_stall() -> None:
    pool, a, clock = setting()
    start = clock.now
    flowing_engine(a, clock)
    assert a.stall.until < start
    assert finish(pool, a, clock, 0.1, REFERENCE_TOKENS) == pytest.approx(4.0)


def test_a_lone_streams_silence_is_no_stall_of_the_engine() -> None:
    """With one stream, its silence and the engine's cannot be told apart: priced as its own."""
    _, a, clock = setting()
    start = clock.now
    running(a, start, 1)
    a.progressed(start + 1.5)
    assert a.stall.active_s(start, start + 2.0) == 2.0


def test_silences_within_the_engines_usual_gaps_are_its_pace() -> None:
    """An engine whose streams' largest gaps are usually 0.3 s (a slow one): all of them
    silent for 0.9 s at once is within four such gaps, its pace, and priced so."""
    _, a, clock = setting()
    for _ in range(20):
        a.latency.gap.observe(0.3)
    start = clock.now
    running(a, start, 2)
    a.progressed(start + 1.0)
    assert a.stall.active_s(start, start + 2.0) == 2.0
    a.progressed(start + 2.5)  # 1.5 s: past four gaps, a stall
    assert a.stall.active_s(start, start + 3.0) == 1.5


def test_no_stall_is_told_before_the_usual_gaps_are_learned() -> None:
    """On an engine whose gaps nothing has taught yet, a usual step may outlast the floor."""
    _, _, a, clock = base_setting()
    start = clock.now
    running(a, start, 2)
    a.progressed(start + 2.0)
    assert a.stall.active_s(start, start + 3.0) == 3.0


def test_a_first_byte_that_ends_a_silence_is_no_stall() -> None:
    """Two streams silent for 1 s, then a new request's first byte, before any of theirs: that
    may be its own prefill's pause, or an engine that turned slower. Its wait is its own."""
    _, a, clock = setting()
    start = clock.now
    running(a, start, 2)
    a.attempt_started(0)
    a.first_byte(start + 0.5, start + 1.6)
    a.progressed(start + 1.65)
    assert a.stall.until < start
    assert a.stall.unstalled_wait_s(start + 0.5, start + 1.6, a.latency.ttfb.mean) == pytest.approx(
        1.1
    )
