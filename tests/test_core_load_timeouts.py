"""Timeouts that know the load and the pool: priors for young instances, the queue the gateway
put on an instance, a prompt's own prefill and the pause it imposes on running streams.

Pure arithmetic with fixed figures: no clock, no event loop."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.models import TimeoutsPolicy
from gateway.core.latency import LatencyState, pool_prior
from gateway.core.panic import least_bad
from gateway.core.timeouts import (
    FINAL_ATTEMPT_HEADROOM,
    PRIOR_HEADROOM,
    AttemptTimeouts,
    Load,
    attempt_timeouts,
)

POLICY = TimeoutsPolicy.model_validate({"token_headroom": 0.0, "jitter": 0})


def streams(
    n: int, ttfb_s: float, gap_s: float, total_s: float, prompt_tokens: int = 0
) -> LatencyState:
    state = LatencyState(0.85)
    for _ in range(n):
        state.observe_stream(ttfb_s, gap_s, total_s, 10, prompt_tokens)
    return state


def timeouts(state: LatencyState, **kwargs: Any) -> AttemptTimeouts:
    args: dict[str, Any] = {"stream": True, "max_tokens": None, "jitter_s": 0.0, **kwargs}
    return attempt_timeouts(state, POLICY, 1.0, **args)


# -- priors -------------------------------------------------------------------------------------


def test_the_prior_averages_the_learned_instances_only() -> None:
    fast = streams(20, 0.2, 0.05, 1.0)
    slow = streams(20, 0.6, 0.15, 3.0)
    young = streams(3, 9.0, 9.0, 9.0)  # too few samples to count
    prior = pool_prior([fast, slow, young], 10, 0.85)
    assert prior.ttfb.samples == 10
    assert prior.ttfb.mean == pytest.approx(0.4)
    assert prior.gap.mean == pytest.approx(0.1)
    assert prior.ttfb.deviation == pytest.approx((fast.ttfb.deviation + slow.ttfb.deviation) / 2)
    assert pool_prior([young], 10, 0.85).ttfb.samples == 0


def test_a_young_instance_is_timed_from_its_pool_not_the_static_initial() -> None:
    prior = pool_prior([streams(20, 1.0, 0.5, 2.0)], 10, 0.85)
    fresh = LatencyState(0.85)
    without = timeouts(fresh)
    assert (without.first_byte_s, without.idle_s) == (30.0, 30.0)  # timeouts.initial
    result = timeouts(fresh, prior=prior)
    dev = prior.ttfb.deviation
    assert result.first_byte_s == pytest.approx(PRIOR_HEADROOM * (1.0 + dev))
    assert result.idle_s == pytest.approx(PRIOR_HEADROOM * (0.5 + prior.gap.deviation))


def test_each_timeout_under_the_prior_doubles_its_headroom_until_a_success() -> None:
    prior = pool_prior([streams(20, 1.0, 0.5, 2.0)], 10, 0.85)
    fresh = LatencyState(0.85)
    first = timeouts(fresh, prior=prior).first_byte_s
    fresh.timeouts_in_row = 2
    assert timeouts(fresh, prior=prior).first_byte_s == pytest.approx(4 * first)
    fresh.observe_stream(5.0, 1.0, 6.0, 10)  # it answered: back to the plain headroom
    assert fresh.timeouts_in_row == 0
    assert timeouts(fresh, prior=prior).first_byte_s == pytest.approx(first)


def test_an_instance_that_learned_ignores_the_prior() -> None:
    own = streams(20, 0.1, 0.02, 0.3)
    prior = pool_prior([streams(20, 5.0, 1.0, 9.0)], 10, 0.85)
    assert timeouts(own, prior=prior) == timeouts(own)


# -- the queue the gateway put on the instance ---------------------------------------------------


@pytest.mark.parametrize(
    ("in_flight", "capacity", "waves"),
    [
        (0, 4, 0),  # room for it
        (3, 4, 0),  # the fourth of four slots
        (4, 4, 1),  # the fifth waits for one to end
        (7, 4, 1),
        (8, 4, 2),
        (5, 0, 5),  # capacity never seen: taken as 1, five ahead of it
    ],
)
def test_a_queued_attempt_waits_for_whole_exchanges_to_end(
    in_flight: int, capacity: int, waves: int
) -> None:
    state = streams(20, 0.5, 0.05, 4.0)  # 0.5 s to the first byte: above the floor
    plain = timeouts(state)
    loaded = timeouts(state, load=Load(in_flight, capacity, 0))
    service = state.service.mean + state.service.deviation  # k = 1
    assert loaded.first_byte_s == pytest.approx(plain.first_byte_s + waves * service)
    assert loaded.idle_s == plain.idle_s  # once it streams, it streams like the others


def test_no_queue_allowance_before_the_service_time_is_known() -> None:
    fresh = LatencyState(0.85)
    assert timeouts(fresh, load=Load(10, 1, 0)).first_byte_s == 30.0


# -- prefill --------------------------------------------------------------------------------------


def test_a_long_prompt_gets_its_prefill_and_announces_the_pause() -> None:
    # 100-token prompts answered in 0.2 s: 2 ms per prompt token; the largest gap 50 ms.
    state = streams(20, 0.2, 0.05, 1.0, prompt_tokens=100)
    short = timeouts(state, load=Load(0, 4, 100))
    assert short.pause_s == 0.0  # 0.2 s: within what the streams tolerate (the 250 ms floor)
    long = timeouts(state, load=Load(0, 4, 1500))
    assert long.pause_s == pytest.approx(1500 * 0.002)
    assert long.first_byte_s == pytest.approx(3.0 + state.ttfb.deviation)


def test_queued_streams_do_not_teach_the_prefill_rate() -> None:
    state = LatencyState(0.85)
    state.observe_stream(5.0, 0.05, 6.0, 10, prompt_tokens=100, queued=True)
    assert state.prefill.samples == 0 and state.ttfb.samples == 1
    state.observe_stream(0.2, 0.05, 1.0, 10, prompt_tokens=100)
    assert state.prefill.mean == pytest.approx(0.002)


def test_a_non_streamed_request_gets_the_queue_and_prefill_too() -> None:
    state = streams(20, 0.2, 0.05, 4.0, prompt_tokens=100)
    for _ in range(20):
        state.observe_whole(1.2, 100)
    plain = timeouts(state, stream=False, max_tokens=100)
    loaded = timeouts(state, stream=False, max_tokens=100, load=Load(4, 4, 1500))
    extra = loaded.first_byte_s - plain.first_byte_s
    service = state.service.mean + state.service.deviation
    prefill_over_ttfb = 1500 * state.prefill.mean - state.ttfb.mean
    assert extra == pytest.approx(service + prefill_over_ttfb)
    assert loaded.idle_s is None


# -- panic routing --------------------------------------------------------------------------------

HEALTH = {
    "ok": (True, True),
    "isolated": (True, True),
    "sick": (False, True),
    "dead": (False, False),
}


def panic(names: list[str], tried: tuple[str, ...] = (), refused: tuple[str, ...] = ()) -> Any:
    def healthy(name: str) -> bool:
        return HEALTH[name.rstrip("0123456789")][0]

    def answered(name: str) -> bool:
        return HEALTH[name.rstrip("0123456789")][1]

    return least_bad(names, healthy, answered, tried, refused)


def test_panic_prefers_healthy_then_answering_then_tries_the_silent() -> None:
    assert panic(["isolated1", "sick1", "dead1"]) == ["isolated1"]
    assert panic(["sick1", "dead1", "sick2"]) == ["sick1", "sick2"]
    # None answers its checks: each is tried (it may be back), once per request.
    assert panic(["dead1", "dead2"]) == ["dead1", "dead2"]
    assert panic(["dead1", "dead2"], refused=("dead1",)) == ["dead2"]
    assert panic(["dead1", "dead2"], refused=("dead1", "dead2")) is None


def test_panic_prefers_untried_and_skips_those_that_refused() -> None:
    assert panic(["sick1", "sick2"], tried=("sick1",)) == ["sick2"]
    assert panic(["sick1", "sick2"], tried=("sick1", "sick2")) == ["sick1", "sick2"]
    assert panic(["isolated1", "sick1"], refused=("isolated1",)) == ["sick1"]
    assert panic(["isolated1"], refused=("isolated1",)) is None


# -- the last attempt -----------------------------------------------------------------------------


def test_the_last_attempt_waits_longer_but_never_past_the_unlearned_timeout() -> None:
    state = streams(20, 0.5, 0.05, 1.0)
    learned = timeouts(state).first_byte_s
    last = timeouts(state, final=True)
    assert last.first_byte_s == pytest.approx(FINAL_ATTEMPT_HEADROOM * learned)
    assert last.idle_s == timeouts(state).idle_s  # after the first byte nothing changes
    slow = streams(20, 20.0, 0.05, 30.0)  # 4 x 20 s would pass the 30 s of an unlearned one
    assert timeouts(slow, final=True).first_byte_s == pytest.approx(
        max(POLICY.initial, timeouts(slow).first_byte_s)
    )
    # Nothing learned: the static timeout as it was.
    assert timeouts(LatencyState(0.85), final=True).first_byte_s == POLICY.initial
    whole = timeouts(LatencyState(0.85), stream=False, max_tokens=10, final=True)
    assert whole.first_byte_s == pytest.approx(POLICY.initial + 10 * POLICY.initial_per_token)


def test_the_prefill_line_separates_the_fixed_cost_from_the_per_token_one() -> None:
    # A GPU-like instance: 100 ms whatever the prompt, plus 0.1 ms per prompt token.
    state = LatencyState(0.85)
    for i in range(40):
        tokens = 100 + 400 * (i % 5)
        state.observe_stream(0.1 + 0.0001 * tokens, 0.05, 1.0, 10, prompt_tokens=tokens)
    assert state.fit.slope() == pytest.approx(0.0001)
    # A 5,000-token prompt costs its 0.5 s of prefill, not 5,000 times the ratio (about 0.4 ms).
    long = timeouts(state, load=Load(0, 4, 5000))
    assert long.first_byte_s == pytest.approx(
        max(state.ttfb.mean, 5000 * 0.0001) + state.ttfb.deviation
    )


def test_a_backend_whose_first_byte_ignores_the_prompt_announces_no_pause() -> None:
    state = LatencyState(0.85)
    for i in range(40):
        state.observe_stream(0.05, 0.01, 0.3, 10, prompt_tokens=64 + 448 * (i % 2))
    assert state.fit.slope() == 0.0
    result = timeouts(state, load=Load(0, 4, 2000))
    assert result.pause_s == 0.0 and result.first_byte_s == 0.25  # the floor


def test_prompts_of_one_size_cannot_tell_a_slope_and_only_long_ones_pause_the_streams() -> None:
    state = streams(20, 0.2, 0.05, 1.0, prompt_tokens=100)
    assert state.fit.slope() is None
    assert timeouts(state, load=Load(0, 4, 150)).pause_s == 0.0  # not twice the usual size
    assert timeouts(state, load=Load(0, 4, 1500)).pause_s > 0.0


def test_timeouts_in_row_back_the_last_attempt_off_until_an_answer() -> None:
    # An instance that turned slower: its learned time would cut every attempt.
    state = streams(20, 0.4, 0.05, 1.0)
    learned = timeouts(state).first_byte_s
    for n in (1, 2, 3):
        state.timeouts_in_row = n
        assert timeouts(state).first_byte_s == learned  # a retry elsewhere is still better
        last = timeouts(state, final=True).first_byte_s
        assert last == pytest.approx(FINAL_ATTEMPT_HEADROOM * learned * 2**n)
    state.timeouts_in_row = 10
    # Never past the unlearned timeout.
    assert timeouts(state, final=True).first_byte_s == POLICY.initial
    state.observe_stream(1.0, 0.05, 2.0, 10)
    assert state.timeouts_in_row == 0


def test_the_last_attempt_is_stretched_from_the_floor_when_the_learned_time_is_below_it() -> None:
    # Learned 10 ms: four times that is still under the 250 ms floor, which a 50x slowdown
    # (500 ms) exceeds; the last attempt waits four floors.
    state = streams(20, 0.01, 0.001, 0.05)
    assert timeouts(state).first_byte_s == POLICY.floor
    assert timeouts(state, final=True).first_byte_s == pytest.approx(
        FINAL_ATTEMPT_HEADROOM * POLICY.floor
    )
    whole = timeouts(state, stream=False, max_tokens=0)
    assert timeouts(state, stream=False, max_tokens=0, final=True).first_byte_s == (
        pytest.approx(FINAL_ATTEMPT_HEADROOM * whole.first_byte_s)
    )


def test_attempts_timed_out_together_back_off_once() -> None:
    # Fifty attempts sent at once to a frozen instance all time out: one round, one doubling.
    state = streams(20, 0.4, 0.05, 1.0)
    sent = [timeouts(state, final=True) for _ in range(50)]
    assert {t.backoff for t in sent} == {0}
    for attempt in sent:
        state.timed_out(attempt.backoff)
    assert state.timeouts_in_row == 1
    # The next round waited twice as long, and doubles it again when it times out too.
    again = timeouts(state, final=True)
    assert again.backoff == 1
    assert again.first_byte_s == pytest.approx(2 * sent[0].first_byte_s)
    state.timed_out(again.backoff)
    state.timed_out(sent[0].backoff)  # a straggler of the first round changes nothing
    assert state.timeouts_in_row == 2


def test_a_queue_that_does_not_move_is_not_waited_on() -> None:
    state = streams(20, 0.5, 0.05, 4.0)
    turn = state.service.mean + state.service.deviation
    moving = timeouts(state, load=Load(8, 4, 0, quiet_s=0.1))
    frozen = timeouts(state, load=Load(8, 4, 0, quiet_s=turn + 0.1))
    assert moving.first_byte_s == pytest.approx(timeouts(state).first_byte_s + 2 * turn)
    assert frozen.first_byte_s == timeouts(state).first_byte_s


def test_idle_timeouts_in_row_back_the_idle_timeout_off_until_a_stream_ends() -> None:
    state = streams(20, 0.1, 0.3, 1.0)
    idle = timeouts(state).idle_s
    assert idle is not None
    state.idle_timeouts_in_row = 2
    assert timeouts(state).idle_s == pytest.approx(4 * idle)
    state.idle_timeouts_in_row = 20  # at most 2^6, never past the unlearned timeout
    assert timeouts(state).idle_s == pytest.approx(min(64 * idle, POLICY.initial))
    state.observe_stream(0.1, 1.2, 5.0, 10)
    assert state.idle_timeouts_in_row == 0
