from __future__ import annotations

import pytest

from gateway.core.ewma import Ewma
from gateway.core.failure_rate import FailureRateState
from gateway.core.latency import LatencyState


@pytest.mark.parametrize(
    ("samples", "mean", "deviation"),
    [
        ([], 0.0, 0.0),
        ([100.0], 100.0, 50.0),  # RFC 6298: the first deviation is half the first sample
        # dev = .85*50 + .15*|200-100| = 57.5; mean = .85*100 + .15*200 = 115
        ([100.0, 200.0], 115.0, 57.5),
        # dev = .85*57.5 + .15*|100-115| = 51.125; mean = .85*115 + .15*100 = 112.75
        ([100.0, 200.0, 100.0], 112.75, 51.125),
    ],
)
def test_ewma_hand_computed(samples: list[float], mean: float, deviation: float) -> None:
    ewma = Ewma(0.85)
    for x in samples:
        ewma.observe(x)
    assert ewma.mean == pytest.approx(mean)
    assert ewma.deviation == pytest.approx(deviation)
    assert ewma.samples == len(samples)


def test_constant_samples_drive_the_deviation_to_zero() -> None:
    ewma = Ewma(0.85)
    for _ in range(200):
        ewma.observe(0.02)
    assert ewma.mean == pytest.approx(0.02)
    assert ewma.deviation < 1e-12


def test_mean_converges_to_a_new_level() -> None:
    ewma = Ewma(0.85)
    ewma.observe(1.0)
    for _ in range(100):
        ewma.observe(3.0)
    # The old level's weight is .85**100 ~ 9e-8.
    assert ewma.mean == pytest.approx(3.0, abs=1e-6)
    assert ewma.deviation == pytest.approx(0.0, abs=1e-4)


def test_latency_stream_feeds_every_estimator() -> None:
    state = LatencyState(0.85)
    state.observe_stream(ttfb_s=0.2, max_gap_s=0.05, total_s=2.2, tokens=100)
    assert (state.ttfb.mean, state.gap.mean) == (0.2, 0.05)
    assert state.per_token.mean == pytest.approx(0.02)


def test_latency_stream_without_gap_or_tokens_learns_only_ttfb() -> None:
    state = LatencyState(0.85)
    state.observe_stream(ttfb_s=0.2, max_gap_s=None, total_s=0.2, tokens=None)
    state.observe_stream(ttfb_s=0.2, max_gap_s=None, total_s=0.2, tokens=0)
    assert (state.ttfb.samples, state.gap.samples, state.per_token.samples) == (2, 0, 0)


@pytest.mark.parametrize(
    ("stream_ttfb", "total_s", "tokens", "per_token"),
    [
        (None, 2.0, 100, 0.02),  # no TTFB learned yet: the whole time is charged to the tokens
        (0.5, 2.5, 100, 0.02),  # (2.5 - 0.5) / 100
        (0.5, 0.3, 10, 0.0),  # faster than the predicted TTFB: clamped at 0
    ],
)
def test_latency_whole_response(
    stream_ttfb: float | None, total_s: float, tokens: int, per_token: float
) -> None:
    state = LatencyState(0.85)
    if stream_ttfb is not None:
        state.observe_stream(ttfb_s=stream_ttfb, max_gap_s=None, total_s=stream_ttfb, tokens=None)
    state.observe_whole(total_s, tokens)
    assert state.per_token.mean == pytest.approx(per_token)
    assert state.ttfb.samples == (0 if stream_ttfb is None else 1)


def test_latency_whole_without_tokens_learns_nothing() -> None:
    state = LatencyState(0.85)
    state.observe_whole(3.0, None)
    state.observe_whole(3.0, 0)
    assert state.per_token.samples == 0


def test_failure_rate() -> None:
    state = FailureRateState(0.97)
    assert state.rate == 0.0
    assert state.observe(True) == pytest.approx(0.03)
    assert state.observe(False) == pytest.approx(0.03 * 0.97)
    for _ in range(1000):
        state.observe(True)
    assert state.rate == pytest.approx(1.0)
