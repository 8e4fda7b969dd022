from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.config.models import TimeoutsPolicy
from gateway.core.latency import LatencyState
from gateway.core.timeouts import AttemptTimeouts, TimeoutsConfig, attempt_timeouts


def policy(**overrides: Any) -> TimeoutsConfig:
    """The default timeouts policy with `overrides`; no token headroom unless asked, so the
    arithmetic of the rule can be checked term by term."""
    return TimeoutsPolicy.model_validate(
        {"token_headroom": 0.0, "initial_per_token": 0.1, **overrides}
    )


def learned(
    ttfb: list[float], gap: list[float] | None = None, per_token: list[float] | None = None
) -> LatencyState:
    """Streams with these figures (gaps for the first len(gap) only; 100 tokens with `per_token`).

    Note that after n equal samples the deviation is still .85**(n-1) * x/2: 12% of x at 10.
    """
    state = LatencyState(0.85)
    for i, ttfb_s in enumerate(ttfb):
        gap_s = gap[i] if gap and i < len(gap) else None
        tokens = 100 if per_token else None
        rate = per_token[i] if per_token else 0.0
        state.observe_stream(ttfb_s, gap_s, ttfb_s + 100 * rate, tokens)
    return state


def figures(result: AttemptTimeouts) -> tuple[float, float, float]:
    """The three timeouts, for pytest.approx (an idle timeout of None as -1)."""
    idle = -1.0 if result.idle_s is None else result.idle_s
    return result.first_byte_s, idle, result.connect_s


def timeouts(
    state: LatencyState,
    *,
    k: float = 1.2,
    stream: bool = True,
    max_tokens: int | None = None,
    jitter_s: float = 0.0,
    **overrides: Any,
) -> AttemptTimeouts:
    return attempt_timeouts(
        state, policy(**overrides), k, stream=stream, max_tokens=max_tokens, jitter_s=jitter_s
    )


@pytest.mark.parametrize(
    ("stream", "max_tokens", "expected"),
    [
        # Nothing learned: `initial` (30 s) per phase, no spread.
        (True, None, AttemptTimeouts(30.0, 30.0, 1.0)),
        (True, 100, AttemptTimeouts(30.0, 30.0, 1.0)),  # max_tokens plays no part in a stream
        # Non-streamed: initial + n * initial_per_token (100 ms).
        (False, 100, AttemptTimeouts(40.0, None, 1.0)),
        (False, None, AttemptTimeouts(30.0 + 409.6, None, 1.0)),  # assumed_max_tokens: 4096
        (False, 0, AttemptTimeouts(30.0, None, 1.0)),
        (False, 100_000, AttemptTimeouts(600.0, None, 1.0)),  # clamped to the ceiling
    ],
)
def test_before_learning(stream: bool, max_tokens: int | None, expected: AttemptTimeouts) -> None:
    result = timeouts(LatencyState(0.85), stream=stream, max_tokens=max_tokens)
    assert figures(result) == pytest.approx(figures(expected))


def test_a_healthy_4096_token_generation_fits_before_learning() -> None:
    # Even at a slow 50 ms per token (20 tokens/s) with a slow 10 s prefill.
    limit = timeouts(LatencyState(0.85), stream=False, max_tokens=4096).first_byte_s
    assert 10.0 + 4096 * 0.05 < limit <= 600.0


def test_a_fast_instance_gets_floor_timeouts_once_learned() -> None:
    # 20 ms TTFT, 10 ms gaps: a hang is given up on after the floor (250 ms), not 30 s.
    state = learned(ttfb=[0.02] * 20, gap=[0.01] * 20)
    assert timeouts(state, k=4.0) == AttemptTimeouts(0.25, 0.25, 1.0)


def test_a_streams_idle_timeout_is_a_guess_until_its_gaps_are_learned() -> None:
    # The response paces such a stream by its own gaps (`UpstreamResponse.next_chunk`).
    assert timeouts(LatencyState(0.85)).idle_guessed
    assert not timeouts(learned(ttfb=[0.02] * 20, gap=[0.01] * 20)).idle_guessed
    assert timeouts(learned(ttfb=[0.02] * 20)).idle_guessed  # first bytes say nothing of gaps
    assert not timeouts(LatencyState(0.85), stream=False).idle_guessed


def test_initial_until_min_samples() -> None:
    state = learned(ttfb=[2.0] * 9)
    assert timeouts(state).first_byte_s == 30.0  # one sample short of min_samples (10)
    state.ttfb.observe(2.0)
    # Learned: 2 s plus k times what is left of the first deviation, .85**9 * 1 s.
    assert timeouts(state).first_byte_s == pytest.approx(2.0 + 1.2 * 0.85**9)
    assert timeouts(state).idle_s == 30.0  # no gap samples at all


def test_min_samples_is_per_phase() -> None:
    state = learned(ttfb=[2.0] * 10, gap=[0.5] * 3)
    result = timeouts(state, min_samples=3)
    assert result.first_byte_s == pytest.approx(2.0 + 1.2 * 0.85**9)
    assert result.idle_s == pytest.approx(0.5 + 1.2 * 0.85**2 * 0.25)
    assert timeouts(state, min_samples=4).idle_s == 30.0


def test_stream_rule_per_phase_and_k() -> None:
    state = learned(ttfb=[1.0, 3.0] * 10, gap=[0.4, 0.8] * 10)
    ttfb, gap = state.ttfb, state.gap
    for k in (1.2, 3.0):
        result = timeouts(state, k=k, jitter_s=0.005)
        assert result.first_byte_s == pytest.approx(ttfb.mean + k * ttfb.deviation + 0.005)
        assert result.idle_s == pytest.approx(gap.mean + k * gap.deviation + 0.005)
    # A wider k widens each phase by the deviation times the difference.
    wide, narrow = timeouts(state, k=3.0), timeouts(state, k=1.2)
    assert wide.first_byte_s - narrow.first_byte_s == pytest.approx(1.8 * ttfb.deviation)
    assert ttfb.deviation > 0.1


@pytest.mark.parametrize(
    ("ttfb", "gap", "overrides", "expected"),
    [
        ([0.01] * 60, [0.001] * 60, {}, AttemptTimeouts(0.25, 0.25, 1.0)),  # raised to the floor
        ([0.01] * 60, [0.001] * 60, {"floor": 0.005}, AttemptTimeouts(0.01, 0.005, 1.0)),
        ([900.0] * 10, [700.0] * 10, {}, AttemptTimeouts(600.0, 600.0, 1.0)),  # to the ceiling
    ],
)
def test_clamping(
    ttfb: list[float], gap: list[float], overrides: dict[str, Any], expected: AttemptTimeouts
) -> None:
    result = timeouts(learned(ttfb, gap), **overrides)
    assert figures(result) == pytest.approx(figures(expected), rel=1e-3)


def test_non_streamed_rule() -> None:
    state = learned(ttfb=[0.2, 0.4] * 10, per_token=[0.018, 0.022] * 10)
    ttfb, tok = state.ttfb, state.per_token
    for n in (1, 256, 4096):
        result = timeouts(state, k=1.8, stream=False, max_tokens=n, jitter_s=0.005)
        spread = math.sqrt(ttfb.deviation**2 + (n * tok.deviation) ** 2)
        expected = ttfb.mean + n * tok.mean + 1.8 * spread + 0.005
        assert figures(result) == pytest.approx((max(expected, 0.25), -1.0, 1.0))


def test_a_healthy_4096_token_generation_fits_once_learned() -> None:
    # Learned from short answers at 18-22 ms a token; a long one at the slow end still fits.
    state = learned(ttfb=[0.2, 0.4] * 10, per_token=[0.018, 0.022] * 10)
    limit = timeouts(state, k=1.2, stream=False, max_tokens=4096).first_byte_s
    assert limit > 0.4 + 4096 * 0.022
    # ... but a hung instance is given up on long before the 30 s + 409.6 s of an unknown one.
    assert limit < 120.0
    assert timeouts(state, stream=False, max_tokens=16).first_byte_s < 1.5


def test_non_streamed_uses_initial_per_token_until_learned() -> None:
    state = learned(ttfb=[0.5] * 60)  # streams without token counts: TTFB only
    result = timeouts(state, stream=False, max_tokens=1000)
    assert result.first_byte_s == pytest.approx(0.5 + 1000 * 0.1, rel=1e-6)
    assert timeouts(state, stream=False, max_tokens=1000, initial_per_token=0.05).first_byte_s == (
        pytest.approx(0.5 + 1000 * 0.05, rel=1e-6)
    )


def test_non_streamed_without_max_tokens_assumes_the_policy_value() -> None:
    state = learned(ttfb=[0.5] * 60, per_token=[0.02] * 60)
    assumed = timeouts(state, stream=False, max_tokens=None, assumed_max_tokens=2000)
    explicit = timeouts(state, stream=False, max_tokens=2000)
    assert assumed == explicit
    assert assumed.first_byte_s == pytest.approx(0.5 + 2000 * 0.02, rel=1e-4)


def test_token_headroom_scales_only_the_generation() -> None:
    state = learned([0.5] * 10, per_token=[0.02] * 10)
    plain = timeouts(state, stream=False, max_tokens=1000)
    roomy = timeouts(state, stream=False, max_tokens=1000, token_headroom=0.5)
    assert roomy.first_byte_s - plain.first_byte_s == pytest.approx(
        0.5 * 1000 * state.per_token.mean
    )


def test_an_instance_taught_only_by_whole_responses_needs_no_first_byte_guess() -> None:
    state = LatencyState(0.85)
    for _ in range(10):
        state.observe_whole(total_s=2.0, tokens=100)  # 20 ms per token, prefill included
    result = timeouts(state, stream=False, max_tokens=100)
    assert result.first_byte_s == pytest.approx(
        100 * state.per_token.mean + 1.2 * 100 * state.per_token.deviation
    )
    assert result.first_byte_s < 5.0  # not initial (30 s) plus the generation


def test_embeddings_learn_their_own_latency() -> None:
    state = LatencyState(0.85)
    for _ in range(10):
        state.observe_whole(total_s=0.04, tokens=None)
    result = timeouts(state, stream=False, max_tokens=0)
    assert result.first_byte_s == 0.25  # learned ~40 ms, clamped to the floor; not 30 s


def test_first_token_max_caps_every_first_byte_wait_of_a_stream() -> None:
    """The pool's limit on a stream's first byte: the unlearned `initial` (30 s) and the last
    attempt's stretch are held to it, as is a learned time above it, below the floor too (the
    limit is the operator's word); a learned time under it is left as it was, and says so."""
    unlearned = timeouts(LatencyState(0.85), first_token_max=2.0)
    assert unlearned.first_byte_s == 2.0
    assert unlearned.limit_s == 2.0 and unlearned.capped
    assert unlearned.idle_s == 30.0  # the gaps of the stream are not its business
    final = attempt_timeouts(
        learned([0.8] * 10),
        policy(first_token_max=2.0),
        1.2,
        stream=True,
        max_tokens=None,
        jitter_s=0.0,
        final=True,
    )
    assert final.first_byte_s == 2.0 and final.capped  # four times ~0.9 s, held to the limit
    quick = timeouts(learned([0.5] * 10), first_token_max=2.0)
    assert 0.5 < quick.first_byte_s < 2.0
    assert quick.limit_s == 2.0 and not quick.capped
    below_floor = timeouts(LatencyState(0.85), first_token_max=0.1, floor=0.25)
    assert below_floor.first_byte_s == 0.1 and below_floor.capped


def test_first_token_max_leaves_whole_answers_alone() -> None:
    """A non-streamed answer's first byte is the whole generation: the limit on a first token
    does not bound it, and the attempt carries no limit."""
    whole = timeouts(LatencyState(0.85), stream=False, max_tokens=100, first_token_max=2.0)
    assert whole.first_byte_s == pytest.approx(40.0)
    assert whole.limit_s is None and not whole.capped


def test_without_first_token_max_nothing_is_capped() -> None:
    result = timeouts(LatencyState(0.85))
    assert result.first_byte_s == 30.0
    assert result.limit_s is None and not result.capped
