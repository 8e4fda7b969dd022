from __future__ import annotations

import math

import pytest

from gateway.core.concurrency import (
    REFUSAL_HOLD_S,
    FixedLimiter,
    GradientLimiter,
    Limiter,
    TokenBudget,
    estimate_tokens,
    vllm_saturated,
)

# Samples 10 ms apart: with a 600 s half-life the baseline barely moves over a few hundred.
STEP = 0.01


def feed(
    limiter: GradientLimiter,
    start: float,
    count: int,
    latency_s: float,
    in_flight: int | None = None,
    step: float = STEP,
) -> tuple[float, list[int]]:
    """`count` samples from `start`, `step` apart, busy (in flight = the limit) unless told;
    returns the next `now` and the limit after each sample."""
    limits = []
    now = start
    for _ in range(count):
        busy = limiter.limit if in_flight is None else in_flight
        limiter.record(now, latency_s, busy)
        limits.append(limiter.limit)
        now += step
    return now, limits


# -- GradientLimiter: growth and shrinkage -------------------------------------------------------


def test_the_first_busy_healthy_sample_adds_smoothed_headroom() -> None:
    limiter = GradientLimiter(initial_limit=32)
    limiter.record(0.0, 0.1, in_flight=32)
    assert (limiter.recent, limiter.baseline) == (0.1, 0.1)
    # gradient 1: target = 32 + sqrt(32); estimate = 32 + 0.2 * sqrt(32)
    assert limiter.estimate == pytest.approx(32 + 0.2 * math.sqrt(32))
    assert limiter.limit == 33


@pytest.mark.parametrize(
    ("factor", "grows"),
    [
        (1.0, True),  # steady latency
        (1.4, True),  # within tolerance (1.5): gradient 1
        (2.0, False),  # gradient 0.75 < 1 - 1/sqrt(64)
        (4.0, False),  # gradient clamped at 0.5
    ],
)
def test_recent_latency_against_the_baseline(factor: float, grows: bool) -> None:
    limiter = GradientLimiter(initial_limit=64, max_limit=1000)
    now, _ = feed(limiter, 0.0, 1, 0.1)
    before = limiter.limit
    _, limits = feed(limiter, now, 60, 0.1 * factor)
    assert limiter.baseline == pytest.approx(0.1, rel=1e-2)
    if grows:
        assert limits == sorted(limits)
        assert limits[-1] > before + 20
    else:
        assert limits[-1] < before
        assert limiter.recent == pytest.approx(0.1 * factor, rel=1e-3)


def test_shrinking_settles_where_the_headroom_balances_the_gradient() -> None:
    limiter = GradientLimiter(initial_limit=200, max_limit=1000)
    now, _ = feed(limiter, 0.0, 1, 0.1)
    feed(limiter, now, 400, 0.4)  # gradient 0.5: estimate * 0.5 = sqrt(estimate) at 4
    assert limiter.limit == 4
    assert limiter.estimate == pytest.approx(4.0, rel=1e-3)


@pytest.mark.parametrize(
    ("in_flight", "grows"),
    [
        (0, False),
        (15, False),  # 2 * 15 < 32
        (16, True),  # exactly half the limit: busy
        (32, True),
    ],
)
def test_only_a_busy_instance_grows(in_flight: int, grows: bool) -> None:
    limiter = GradientLimiter(initial_limit=32)
    limiter.record(0.0, 0.1, in_flight)
    assert (limiter.limit > 32) is grows
    assert (limiter.recent, limiter.baseline) == (0.1, 0.1)  # latency is learned either way


def test_an_app_limited_instance_keeps_its_limit_but_may_still_shrink() -> None:
    limiter = GradientLimiter(initial_limit=64)
    now, limits = feed(limiter, 0.0, 200, 0.1, in_flight=2)
    assert set(limits) == {64}
    _, limits = feed(limiter, now, 60, 0.4, in_flight=2)
    assert limits[-1] < 64


def test_congestion_that_lasts_starts_the_cut_from_twice_the_load() -> None:
    limiter = GradientLimiter(initial_limit=1024, max_limit=1024)
    limiter.record(0.0, 0.1, in_flight=30)
    # Recent latency over 1.5 times the baseline, three samples in a row: cut as ever, from
    # the estimate (a long prompt or three would not show congestion).
    estimates = []
    for second in (1.0, 2.0, 3.0):
        limiter.record(second, 0.6, in_flight=30)
        estimates.append(limiter.estimate)
    assert 700 < estimates[-1] < estimates[0] < 1024
    # The fourth: the cut starts from twice the load, 60, not from what is left of 1024.
    before = limiter.estimate
    limiter.record(4.0, 0.6, in_flight=30)
    gradient = max(0.5, 1.5 * limiter.baseline / limiter.recent)
    target = 60 * gradient + math.sqrt(60)
    assert limiter.estimate == pytest.approx(60 + 0.2 * (target - 60))
    assert before > 700
    # A sample back within tolerance ends the run (though the recent latency is still high):
    # the next slow one cuts from the estimate.
    calm = GradientLimiter(initial_limit=1024, max_limit=1024)
    calm.record(0.0, 0.1, in_flight=30)
    for second in (1.0, 2.0, 3.0):
        calm.record(second, 0.6, in_flight=30)
    calm.record(4.0, 0.1, in_flight=30)
    assert calm.recent > 1.5 * calm.baseline
    calm.record(5.0, 0.6, in_flight=30)
    assert calm.estimate > 500


# -- GradientLimiter: a whole answer's time per output token ------------------------------------


def test_whole_answers_teach_the_limit_by_their_time_per_token() -> None:
    limiter = GradientLimiter(initial_limit=32, per_token_tolerance=2.0)
    now = 0.0
    for _ in range(50):  # steady: 4 ms a token, busy, so the limit grows
        limiter.record(now, None, limiter.limit, per_token_s=0.004)
        now += STEP
    grown = limiter.estimate
    assert grown > 32 and limiter.per_token.baseline == pytest.approx(0.004, rel=1e-2)
    assert limiter.first_token.samples == 0  # no first token was seen
    # A fuller batch decodes each token 1.9x slower: within the tolerance, no cut.
    for _ in range(50):
        limiter.record(now, None, limiter.limit, per_token_s=0.0076)
        now += STEP
    assert limiter.estimate > grown
    # Requests queue in the engine: 4x the baseline. The limit comes down.
    for _ in range(100):
        limiter.record(now, None, limiter.limit, per_token_s=0.016)
        now += STEP
    assert limiter.estimate < grown


def test_each_signal_has_its_own_baseline_and_the_more_congested_one_wins() -> None:
    limiter = GradientLimiter(initial_limit=32, max_limit=1000)
    now = 0.0
    for _ in range(20):  # streams at 50 ms to first token, whole answers at 4 ms a token
        limiter.record(now, 0.05, limiter.limit)
        limiter.record(now, None, limiter.limit, per_token_s=0.004)
        now += STEP
    assert (limiter.first_token.baseline, limiter.per_token.baseline) == pytest.approx(
        (0.05, 0.004), rel=1e-2
    )
    high = limiter.estimate
    # First tokens stay fast while whole answers slow down 4x: the whole answers pull the
    # shared estimate down although every stream's gradient is 1.
    for _ in range(200):
        limiter.record(now, 0.05, limiter.limit)
        limiter.record(now, None, limiter.limit, per_token_s=0.016)
        now += STEP
    assert limiter.estimate < high
    # A request carrying both takes the smaller gradient: one congested signal is enough.
    both = GradientLimiter(initial_limit=64, max_limit=1000)
    both.record(0.0, 0.05, 64, per_token_s=0.004)
    before = both.estimate
    both.record(STEP, 0.05, 64, per_token_s=0.04)  # per token 10x: gradient 0.5 (floor)
    assert both.estimate < before


def test_a_success_without_latency_figures_heals_overload_cuts() -> None:
    limiter = GradientLimiter(initial_limit=64, min_limit=2, backoff_interval=1.0)
    for second in range(12):  # timeouts and 503s, once a second: cut to 64 x 0.8^12
        limiter.record(float(second), 1.0, 64, overloaded=True)
    cut = limiter.estimate
    assert cut < 5
    # Embeddings (no first token, no output tokens) keep succeeding while busy: no latency is
    # learned, yet the limit grows back as after any success without congestion.
    for n in range(200):
        limiter.record(20.0 + n * STEP, None, limiter.limit, per_token_s=None)
    assert limiter.samples == 0
    assert limiter.estimate > 8 * cut
    # Unusable figures are ignored the same way (not learned), and never shrink the limit.
    before = limiter.estimate
    for latency, per_token in ((0.0, None), (None, math.inf), (-1.0, math.nan)):
        limiter.record(30.0, latency, 1, per_token_s=per_token)
    assert limiter.samples == 0 and limiter.estimate == before


# -- GradientLimiter: overload -------------------------------------------------------------------


def test_overload_cuts_multiplicatively_at_most_once_per_interval() -> None:
    limiter = GradientLimiter(initial_limit=100, backoff_ratio=0.8, backoff_interval=1.0)
    table = [
        # (now, estimate after an overloaded result at now)
        (10.0, 80.0),
        (10.5, 80.0),  # within the interval of the cut at 10.0
        (10.999, 80.0),
        (11.0, 64.0),  # exactly one interval later
        (11.2, 64.0),
        (15.0, 51.2),
    ]
    for now, estimate in table:
        limiter.record(now, 99.0, in_flight=100, overloaded=True)
        assert limiter.estimate == pytest.approx(estimate), now
    assert limiter.cuts == 3
    assert limiter.samples == 0  # an overloaded result teaches no latency
    assert limiter.limit == 51


def test_an_engine_refusal_cuts_from_the_load_it_refused_at_once() -> None:
    # An open limit (1024) over an engine that fails past 40 at once: a timeout cuts from the
    # estimate, a dozen seconds of cuts from where the engine copes; the engine's own refusal
    # (out of memory, 429, 503, 529) cuts from the load it refused in one step.
    timed_out = GradientLimiter(initial_limit=1024, max_limit=1024, min_limit=2)
    timed_out.record(10.0, 1.0, in_flight=41, overloaded=True)
    assert timed_out.estimate == pytest.approx(1024 * 0.8)
    assert not timed_out.refused_lately(10.0)
    refused = GradientLimiter(initial_limit=1024, max_limit=1024, min_limit=2)
    refused.record(10.0, 0.01, in_flight=41, overloaded=True, refused=True)
    assert refused.estimate == pytest.approx(41 * 0.8)
    assert refused.cuts == 1
    # Refusals of the same burst are one signal: no second cut within the interval ...
    refused.record(10.5, 0.01, in_flight=20, overloaded=True, refused=True)
    assert refused.estimate == pytest.approx(41 * 0.8)
    # ... but each one renews how long the limit is the engine's word.
    assert refused.refused_lately(10.5 + REFUSAL_HOLD_S - 0.01)
    assert not refused.refused_lately(10.5 + REFUSAL_HOLD_S)
    # A load above the estimate cuts from the estimate, as any overload.
    refused.record(12.0, 0.01, in_flight=500, overloaded=True, refused=True)
    assert refused.estimate == pytest.approx(41 * 0.8 * 0.8)
    assert refused.cuts == 2


def test_after_a_refusal_the_limit_grows_back_by_one_a_round_trip() -> None:
    limiter = GradientLimiter(initial_limit=1024, max_limit=1024, min_limit=2)
    limiter.record(0.0, None, in_flight=41, overloaded=True, refused=True)
    cut = limiter.estimate
    # 32 successes at full load (one limit's worth: a round trip) with steady latency.
    now = 0.01
    for _ in range(32):
        limiter.record(now, 0.1, limiter.limit)
        now += STEP
    assert cut < limiter.estimate <= cut + 1.05
    # Once the engine has refused nothing for REFUSAL_HOLD_S, growth is Gradient2's again:
    # the square root of the estimate per sample, smoothed.
    later = REFUSAL_HOLD_S + 1.0
    before = limiter.estimate
    limiter.record(later, 0.1, limiter.limit)
    assert limiter.estimate == pytest.approx(before + 0.2 * math.sqrt(before))


# -- GradientLimiter: bounds -------------------------------------------------------------------


def test_growth_stops_at_max_limit() -> None:
    limiter = GradientLimiter(initial_limit=10, min_limit=2, max_limit=40)
    _, limits = feed(limiter, 0.0, 200, 0.1)
    assert limits[-1] == 40
    assert max(limits) == 40
    assert limiter.estimate == 40.0
    assert limiter.admits(39)
    assert not limiter.admits(40)


def test_cuts_stop_at_min_limit() -> None:
    limiter = GradientLimiter(initial_limit=10, min_limit=3, max_limit=40)
    for i in range(20):
        limiter.record(float(i), 0.0, in_flight=10, overloaded=True)
    assert limiter.cuts == 20
    assert limiter.estimate == 3.0
    assert limiter.limit == 3
    assert [limiter.admits(n) for n in range(5)] == [True, True, True, False, False]


def test_a_gradient_never_takes_the_limit_below_min_limit() -> None:
    limiter = GradientLimiter(initial_limit=20, min_limit=10, max_limit=40)
    now, _ = feed(limiter, 0.0, 1, 0.1)
    _, limits = feed(limiter, now, 300, 1.0)
    assert min(limits) == 10
    assert limiter.estimate == pytest.approx(10.0)


# -- GradientLimiter: the baseline ---------------------------------------------------------------


def test_a_permanently_slower_instance_is_relearned() -> None:
    limiter = GradientLimiter(initial_limit=64, max_limit=1000, baseline_half_life=60.0)
    now, _ = feed(limiter, 0.0, 60, 0.1, step=1.0)
    healthy = limiter.limit
    # Three times slower for good: the limit drops at first, then the baseline follows (half
    # the way per minute) and the limit grows back.
    now, limits = feed(limiter, now, 20, 0.3, step=1.0)
    assert min(limits) < healthy
    dip = limits[-1]
    _, limits = feed(limiter, now, 900, 0.3, step=1.0)
    assert limiter.baseline == pytest.approx(0.3, rel=1e-3)
    assert limiter.recent == pytest.approx(0.3)
    assert limits[-1] > max(healthy, dip)


@pytest.mark.parametrize(
    ("elapsed", "moved"),
    [
        (0.0, 0.0),  # a burst at one instant moves nothing
        (600.0, 0.5),  # one half-life: halfway
        (1200.0, 0.75),
        (-5.0, 0.0),  # a clock that went back counts as no time
    ],
)
def test_the_baseline_moves_by_elapsed_time_not_by_sample_count(
    elapsed: float, moved: float
) -> None:
    limiter = GradientLimiter(recent_weight=1.0, baseline_half_life=600.0)
    limiter.record(100.0, 0.1, in_flight=0)
    limiter.record(100.0 + elapsed, 0.5, in_flight=0)
    assert limiter.recent == 0.5
    assert limiter.baseline == pytest.approx(0.1 + moved * 0.4)


@pytest.mark.parametrize("latency_s", [0.0, -1.0, math.nan, math.inf])
def test_unusable_latencies_are_not_learned(latency_s: float) -> None:
    limiter = GradientLimiter(initial_limit=32)
    limiter.record(0.0, 0.1, in_flight=32)
    estimate = limiter.estimate
    limiter.record(1.0, latency_s, in_flight=1)  # not busy: a plain success changes nothing
    assert (limiter.samples, limiter.recent, limiter.estimate) == (1, 0.1, estimate)
    limiter.record(2.0, latency_s, in_flight=32)  # busy: a success with no sign of congestion
    assert (limiter.samples, limiter.recent) == (1, 0.1) and limiter.estimate > estimate


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_limit": 0},
        {"initial_limit": 2, "min_limit": 4},
        {"initial_limit": 300, "max_limit": 256},
        {"tolerance": 0.9},
        {"smoothing": 0.0},
        {"recent_weight": 1.5},
        {"baseline_half_life": 0.0},
        {"backoff_ratio": 1.0},
        {"backoff_interval": -1.0},
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GradientLimiter(**kwargs)  # type: ignore[arg-type]


# -- FixedLimiter --------------------------------------------------------------------------------


def test_fixed_limiter_never_moves() -> None:
    fixed = FixedLimiter(8)
    for i, (latency_s, overloaded) in enumerate([(0.1, False), (9.0, False), (0.1, True)]):
        fixed.record(float(i), latency_s, in_flight=8, overloaded=overloaded)
    assert fixed.limit == 8
    assert [fixed.admits(n) for n in (0, 7, 8, 9)] == [True, True, False, False]
    with pytest.raises(ValueError):
        FixedLimiter(0)


def test_both_limiters_share_the_api() -> None:
    limiters: list[Limiter] = [FixedLimiter(4), GradientLimiter(initial_limit=4, min_limit=4)]
    for limiter in limiters:
        limiter.record(0.0, 0.1, in_flight=0)
        assert limiter.limit == 4
        assert limiter.admits(3)
        assert not limiter.admits(4)
        assert not limiter.refused_lately(0.0)


# -- TokenBudget ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "overcommit", "requests", "admitted", "used"),
    [
        # budget ⌊1000 * 1.3⌋ = 1300
        (1000, 1.3, [600, 600, 100], [True, True, True], 1300),  # exactly the budget
        (1000, 1.3, [600, 600, 101], [True, True, False], 1200),
        (1000, 1.0, [500, 500, 1], [True, True, False], 1000),
        (1000, 1.3, [5000], [True], 5000),  # oversized, alone: admitted
        (1000, 1.3, [1, 5000], [True, False], 1),  # oversized, not alone: refused
        (1000, 1.3, [5000, 1], [True, False], 5000),  # nothing fits beside it
        (100, 0.29, [29, 1], [True, False], 29),  # 0.29 * 100 is a hair under 29
    ],
)
def test_token_budget_admission(
    capacity: int, overcommit: float, requests: list[int], admitted: list[bool], used: int
) -> None:
    budget = TokenBudget(capacity, overcommit)
    assert [budget.try_acquire(tokens) for tokens in requests] == admitted
    assert budget.used == used
    assert budget.available == max(0, budget.budget - used)


def test_fits_asks_without_taking_and_acquire_can_over_commit() -> None:
    budget = TokenBudget(1000, 1.0)
    assert budget.fits(1000) and budget.used == 0
    budget.acquire(800)
    assert not budget.fits(201) and budget.fits(200)
    budget.acquire(500)  # the caller chose to over-commit
    assert budget.used == 1300 and budget.available == 0
    budget.release(1300)
    assert budget.fits(5000)  # nothing in use: even an oversized request


def test_release_restores_room() -> None:
    budget = TokenBudget(1000)
    assert budget.budget == 1300
    assert budget.try_acquire(1000)
    assert not budget.try_acquire(400)
    budget.release(1000)
    assert (budget.used, budget.available) == (0, 1300)
    assert budget.try_acquire(400)
    budget.release(900)  # more than is held: clamped
    assert (budget.used, budget.available) == (0, 1300)
    # An oversized request holds everything until it is released.
    assert budget.try_acquire(2000)
    assert budget.available == 0
    assert not budget.try_acquire(1)
    budget.release(2000)
    assert budget.try_acquire(1300)


@pytest.mark.parametrize(
    ("capacity", "overcommit", "tokens"),
    [(0, 1.3, 0), (1000, 0.0, 0), (1000, math.inf, 0), (1000, 1.3, -1)],
)
def test_token_budget_refuses_nonsense(capacity: int, overcommit: float, tokens: int) -> None:
    with pytest.raises(ValueError):
        TokenBudget(capacity, overcommit).try_acquire(tokens)


@pytest.mark.parametrize(
    ("prompt_bytes", "max_tokens", "assumed", "expected"),
    [
        (0, None, 256, 256),
        (1, None, 256, 257),  # ⌈1/4⌉ = 1
        (4, None, 256, 257),
        (5, None, 256, 258),
        (4000, 100, 256, 1100),  # the request's own max_tokens wins
        (4000, 0, 256, 1000),
        (-8, -3, 256, 0),  # negatives count as 0
    ],
)
def test_estimate_tokens(
    prompt_bytes: int, max_tokens: int | None, assumed: int, expected: int
) -> None:
    assert estimate_tokens(prompt_bytes, max_tokens, assumed) == expected


# -- vllm_saturated ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("waiting", "cache_usage", "saturated"),
    [
        (None, None, False),  # nothing known
        (0.0, 0.5, False),
        (4.0, 0.9, False),  # at the thresholds: not above
        (5.0, None, True),
        (5.0, 0.1, True),
        (None, 0.91, True),
        (0.0, 0.95, True),
        (math.nan, math.nan, False),
        (None, 1.0, True),
    ],
)
def test_vllm_saturated(waiting: float | None, cache_usage: float | None, saturated: bool) -> None:
    assert vllm_saturated(waiting, cache_usage, max_waiting=4.0, max_cache_usage=0.9) is saturated


def test_vllm_saturated_thresholds_that_disable_a_signal() -> None:
    assert not vllm_saturated(1e9, 1.0, max_waiting=math.inf, max_cache_usage=1.0)
    assert vllm_saturated(1.0, None, max_waiting=0.0, max_cache_usage=1.0)


def test_limiter_for_a_policy() -> None:
    from gateway.config.models import ConcurrencyPolicy
    from gateway.core.concurrency import limiter_for

    fixed = limiter_for(ConcurrencyPolicy(mode="fixed", limit=7))
    assert isinstance(fixed, FixedLimiter) and fixed.limit == 7
    adaptive = limiter_for(ConcurrencyPolicy(initial=100, min=3, limit=40))
    assert isinstance(adaptive, GradientLimiter) and adaptive.limit == 40  # initial clamped
