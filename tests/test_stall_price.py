"""The balancer prices an instance by its pace, not by a stall of the whole engine its attempts
lived through. When every stream an instance runs goes silent at once for long (a freeze, a
pause), the time it was silent is left out of the prices its attempts give it; a stream that
stalls alone while the others flow is priced with its stall (that is its instance's pace).

Driven through `Feedback.attempt_finished`, the one way an attempt's outcome reaches its
instance, with the instance's own record of the bytes it sent (`progressed`)."""

from __future__ import annotations

from gateway.core.outcome import Outcome
from gateway.upstream.feedback import Feedback
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from tests.test_lost_races import Clock, setting

OK = Outcome("ok", 200)
TOKENS = 64  # the balancer's reference answer: priced at its whole time


def streams_with_a_silence(a: InstanceState, clock: Clock, together: bool) -> None:
    """Two streams from t = 0 to 4 s, an event every 0.1 s, silent from 1 to 2 s: both of them
    (`together`: the engine froze), or the first alone while the second flows."""
    start = clock.now
    running(a, start, 2)
    for tenth in range(2, 41):
        at = start + tenth / 10
        if not 1.0 < tenth / 10 < 2.0 or not together:
            a.progressed(at)
    clock.now = start + 4.0


def running(a: InstanceState, start: float, streams: int) -> None:
    """`streams` sent at `start`, each past its first byte at 0.1 s."""
    for _ in range(streams):
        a.attempt_started(0, start)
        a.first_byte(start, start + 0.1)
        a.stream_started()


def finish_both(pool: PoolState, a: InstanceState, clock: Clock) -> float:
    """Both streams end at 4 s (first bytes at 0.1 s): what the balancer prices it at then."""
    feedback = Feedback(lambda pool_name, transition: None)
    for _ in range(2):
        a.attempt_ended(0)
        a.stream_ended()
        feedback.attempt_finished(
            pool, a, OK, clock.now, 4.0, False, 0.1, tokens=TOKENS, sent_with=2
        )
    return a.price.peak.peek(clock.now)


def test_a_stall_of_the_whole_engine_is_left_out_of_its_price() -> None:
    _, pool, a, clock = setting()
    start = clock.now
    streams_with_a_silence(a, clock, together=True)
    assert (a.stall_from, a.stall_to) == (start + 1.0, start + 2.0)
    assert a.active_s(start, start + 4.0) == 3.0
    # Priced at the 3 s the streams took besides the stall, not at their 4 s.
    assert abs(finish_both(pool, a, clock) - 3.0) < 1e-9


def test_a_stream_silent_while_its_peers_flow_is_priced_with_its_silence() -> None:
    _, pool, a, clock = setting()
    start = clock.now
    streams_with_a_silence(a, clock, together=False)
    assert a.stall_to < start  # no stall of the engine
    assert abs(finish_both(pool, a, clock) - 4.0) < 1e-9


def test_a_lone_streams_silence_is_no_stall_of_the_engine() -> None:
    """With one stream, its silence and the engine's cannot be told apart: priced as its own."""
    _, _, a, clock = setting()
    start = clock.now
    running(a, start, 1)
    a.progressed(start + 1.5)
    assert a.active_s(start, start + 2.0) == 2.0


def test_silences_within_the_engines_usual_gaps_are_its_pace() -> None:
    """An engine whose streams' largest gaps are usually 0.3 s (a slow one): all of them
    silent for 0.9 s at once is within four such gaps, its pace, and priced so."""
    _, _, a, clock = setting()
    for _ in range(5):
        a.latency.gap.observe(0.3)
    start = clock.now
    running(a, start, 2)
    a.progressed(start + 1.0)
    assert a.active_s(start, start + 2.0) == 2.0
    a.progressed(start + 2.5)  # 1.5 s: past four gaps, a stall
    assert a.active_s(start, start + 3.0) == 1.5
