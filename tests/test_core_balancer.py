from __future__ import annotations

import heapq
import math
import random
from collections import Counter

import pytest

from gateway.core.balancer import (
    MIN_ANSWERED_SHARE,
    PENALTY_TAU_S,
    REFERENCE_TOKENS,
    TIE_MARGIN,
    PeakEwma,
    choose,
    failure_penalty_s,
    load_cost,
    priced_answer_s,
    priced_first_byte_s,
    slow_start_weight,
)

E1 = math.exp(-1.0)


# -- PeakEwma -------------------------------------------------------------------------------------


def test_peak_ewma_starts_at_the_guess_and_decays_toward_zero_when_read() -> None:
    ewma = PeakEwma(0.0)  # 1 s, tau 10 s
    assert ewma.get(0.0) == 1.0
    assert ewma.get(10.0) == pytest.approx(E1)
    # Reading often or once gives the same decay: e^-a * e^-b = e^-(a+b).
    once, often = PeakEwma(0.0), PeakEwma(0.0)
    for t in range(1, 21):
        often.get(float(t))
    assert often.get(20.0) == pytest.approx(once.get(20.0)) == pytest.approx(math.exp(-2.0))


def test_peak_ewma_jumps_to_a_peak_and_decays_toward_lower_samples() -> None:
    ewma = PeakEwma(0.0, initial_s=1.0, tau_s=10.0)
    assert ewma.observe(0.0, 2.0) == 2.0  # above: taken at once
    # 10 s later a 1 s sample: 2 * e^-1 + 1 * (1 - e^-1)
    assert ewma.observe(10.0, 1.0) == pytest.approx(2 * E1 + (1 - E1))  # 1.3679
    assert ewma.observe(10.0, 5.0) == 5.0
    # No time passed: a lower sample weighs 1 - e^0 = 0.
    assert ewma.observe(10.0, 0.5) == 5.0
    # 5 s later a 3 s sample (below 5): w = e^-0.5.
    w = math.exp(-0.5)
    assert ewma.observe(15.0, 3.0) == pytest.approx(5 * w + 3 * (1 - w))  # 4.2131


def test_peak_ewma_compares_against_the_stored_not_the_decayed_value() -> None:
    # As in tower: 1.5 is below the stored 2.0, so it is averaged in, not taken as a peak.
    ewma = PeakEwma(0.0, initial_s=2.0)
    assert ewma.observe(10.0, 1.5) == pytest.approx(2 * E1 + 1.5 * (1 - E1))


def test_peak_ewma_peek_does_not_update() -> None:
    ewma = PeakEwma(0.0, initial_s=2.0)
    assert ewma.peek(10.0) == pytest.approx(2 * E1)
    assert ewma.observe(10.0, 1.5) == pytest.approx(2 * E1 + 1.5 * (1 - E1))


def test_peak_ewma_ignores_a_clock_going_back() -> None:
    ewma = PeakEwma(10.0, initial_s=2.0)
    assert ewma.get(5.0) == 2.0
    assert ewma.observe(5.0, 1.0) == 2.0
    assert ewma.get(20.0) == pytest.approx(2 * E1)


def test_a_guessing_peak_ewma_takes_its_first_sample_whole_then_folds_as_usual() -> None:
    ewma = PeakEwma.guessing(0.0)  # the 1 s guess
    assert not ewma.learned
    assert ewma.get(10.0) == pytest.approx(E1)  # a guess fades as a sample would...
    assert not ewma.learned  # ...and reading it teaches nothing
    # Its first answer replaces it, though far below: a plain estimate would barely move
    # (0.37 * 1 + 0.2 * 0: no time passed since the read).
    assert ewma.observe(10.0, 0.2) == 0.2
    assert ewma.learned
    assert ewma.observe(10.0, 0.1) == 0.2  # from then on, a peak EWMA
    assert ewma.observe(11.0, 0.5) == 0.5


def test_a_lower_bound_raises_a_guess_and_leaves_it_a_guess() -> None:
    ewma = PeakEwma.guessing(0.0, 0.5)
    assert ewma.at_least(0.0, 0.005) == 0.5  # a hedge lost after 5 ms: nothing learned
    assert not ewma.learned
    assert ewma.at_least(0.0, 2.0) == 2.0  # waited 2 s without an answer: dearer than guessed
    assert not ewma.learned
    assert ewma.observe(1.0, 0.1) == 0.1  # its first answer still replaces it
    learned = PeakEwma.guessing(0.0)
    learned.observe(0.0, 0.1)
    assert learned.at_least(0.0, 0.3) == 0.3  # once learned: a bound above raises it...
    # ...and one below says nothing, however long since the last update (as a sample, 10 s
    # later, it would have pulled the estimate to 0.3 e^-1 + 0.005 (1 - e^-1) = 0.11)...
    assert learned.at_least(10.0, 0.005) == pytest.approx(0.3 * E1)
    # ...while one above what it has faded to since raises it, however far below 0.3.
    assert learned.at_least(20.0, 0.2) == 0.2
    assert learned.get(20.0) == 0.2


def test_a_guess_stands_for_an_instance_only_until_it_answers() -> None:
    """Two instances start at the same guess; one answers in 0.1 s, the other in 0.5 s. On
    their first answers the balancer prices them five times apart, not within 1 % of each
    other as a 1 s guess would keep them for ten seconds and more."""
    fast, slow = PeakEwma.guessing(0.0), PeakEwma.guessing(0.0)
    fast.observe(0.1, 0.1)
    slow.observe(0.5, 0.5)
    assert slow.get(1.0) / fast.get(1.0) == pytest.approx(5.0, rel=0.1)
    plain_fast, plain_slow = PeakEwma(0.0), PeakEwma(0.0)
    plain_fast.observe(0.1, 0.1)
    plain_slow.observe(0.5, 0.5)
    assert plain_slow.get(1.0) / plain_fast.get(1.0) < 1.05


def test_peak_ewma_rejects_a_bad_tau() -> None:
    with pytest.raises(ValueError):
        PeakEwma(0.0, tau_s=0.0)


# -- cost and slow start --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("latency", "in_flight", "weight", "cost"),
    [(0.5, 0, 1.0, 0.5), (0.5, 3, 1.0, 2.0), (0.5, 3, 0.5, 4.0), (2.0, 0, 0.1, 20.0)],
)
def test_load_cost(latency: float, in_flight: int, weight: float, cost: float) -> None:
    assert load_cost(latency, in_flight, weight) == pytest.approx(cost)


@pytest.mark.parametrize(
    ("now", "weight"),
    [
        (90.0, 0.1),  # before it became healthy (a clock oddity): the floor
        (100.0, 0.1),
        (115.0, 0.55),  # half way: 0.1 + 0.9 * 0.5
        (127.0, 0.91),
        (130.0, 1.0),
        (1000.0, 1.0),
    ],
)
def test_slow_start_ramp(now: float, weight: float) -> None:
    assert slow_start_weight(now, healthy_since=100.0, window_s=30.0) == pytest.approx(weight)


def test_slow_start_without_a_window_and_with_another_floor() -> None:
    assert slow_start_weight(0.0, 0.0, 0.0) == 1.0
    assert slow_start_weight(5.0, 0.0, 10.0, floor=0.5) == pytest.approx(0.75)


# -- choose (P2C) ---------------------------------------------------------------------------------


def test_choose_with_no_or_one_candidate() -> None:
    rng = random.Random(0)

    def never(_: str) -> float:
        raise AssertionError("cost must not be called")

    assert choose([], never, rng) is None
    assert choose(["a"], never, rng) == "a"


def test_choose_draws_two_distinct_and_keeps_the_cheaper() -> None:
    rng = random.Random(3)
    calls: list[list[str]] = []
    costs = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    for _ in range(1000):
        pair: list[str] = []

        def cost(name: str, pair: list[str] = pair) -> float:
            pair.append(name)
            return costs[name]

        picked = choose(list(costs), cost, rng)
        assert len(pair) == 2 and pair[0] != pair[1]
        assert picked == min(pair, key=costs.__getitem__)
        calls.append(pair)
    # Every ordered pair of distinct candidates turns up (12 of them), roughly evenly.
    seen = Counter((p[0], p[1]) for p in calls)
    assert len(seen) == 12
    assert min(seen.values()) > 50


def test_ties_go_to_the_first_drawn_so_they_spread() -> None:
    rng = random.Random(11)
    picks = Counter(choose(["a", "b"], lambda _: 1.0, rng) for _ in range(10_000))
    assert 4_700 < picks["a"] < 5_300


def test_costs_a_hair_apart_are_a_tie_and_a_clear_difference_is_not() -> None:
    rng = random.Random(11)
    hair = {"a": 1.0, "b": 1.0 - TIE_MARGIN / 2}  # b cheaper, by less than the margin
    picks = Counter(choose(["a", "b"], hair.__getitem__, rng) for _ in range(10_000))
    assert 4_700 < picks["a"] < 5_300
    clear = {"a": 1.0, "b": 1.0 - 2 * TIE_MARGIN}
    picks = Counter(choose(["a", "b"], clear.__getitem__, rng) for _ in range(1_000))
    assert picks == {"b": 1_000}


def test_a_ten_times_costlier_instance_gets_a_clearly_smaller_share() -> None:
    rng = random.Random(2024)
    costs = {"a": 1.0, "b": 1.0, "slow": 10.0}
    picks = Counter(choose(list(costs), costs.__getitem__, rng) for _ in range(10_000))
    assert picks["slow"] == 0  # any pair with it has a cheaper member
    assert 4_700 < picks["a"] < 5_300


def test_an_answer_is_priced_as_a_short_one_whatever_its_length() -> None:
    # 1,000 tokens at 10 ms after a 0.2 s first byte: priced as 64 tokens at that pace.
    assert priced_answer_s(10.2, 0.2, 1000) == pytest.approx(0.2 + 10.0 * REFERENCE_TOKENS / 1000)
    # The same instance's short answer costs the same: length no longer tells instances apart.
    short = 0.2 + 0.01 * REFERENCE_TOKENS
    assert priced_answer_s(short, 0.2, REFERENCE_TOKENS) == pytest.approx(short)
    assert priced_answer_s(10.2, 0.2, 1000) == pytest.approx(short)
    # Unknown length, or shorter than the reference: its whole time.
    assert priced_answer_s(3.0, 0.2, None) == 3.0
    assert priced_answer_s(0.5, 0.2, 20) == 0.5
    # A first byte outside [0, total] (a whole answer priced on the usual one) is clamped.
    assert priced_answer_s(1.0, 5.0, 1000) == 1.0
    assert priced_answer_s(1.0, -1.0, 640) == pytest.approx(0.1)


def test_a_first_byte_is_priced_with_the_usual_pace_after_it() -> None:
    assert priced_first_byte_s(0.25, 0.01) == pytest.approx(0.25 + 0.01 * REFERENCE_TOKENS)
    assert priced_first_byte_s(0.25, 0.0) == 0.25  # no pace learned yet: the wait alone


def test_p2c_with_peak_ewma_and_in_flight_sheds_load_from_a_slow_instance() -> None:
    # A fake clock: a request every 10 ms; "slow" answers in 1 s, the others in 100 ms.
    rng = random.Random(99)
    latency = {"a": 0.1, "b": 0.1, "slow": 1.0}
    names = list(latency)
    ewma = {name: PeakEwma(0.0, initial_s=0.5) for name in names}
    in_flight = dict.fromkeys(names, 0)
    pending: list[tuple[float, str]] = []
    picks: Counter[str] = Counter()
    for i in range(10_000):
        now = i * 0.01
        while pending and pending[0][0] <= now:
            done_at, name = heapq.heappop(pending)
            in_flight[name] -= 1
            ewma[name].observe(done_at, latency[name])

        def cost(name: str, now: float = now) -> float:
            return load_cost(ewma[name].get(now), in_flight[name])

        picked = choose(names, cost, rng)
        assert picked is not None
        picks[picked] += 1
        in_flight[picked] += 1
        heapq.heappush(pending, (now + latency[picked], picked))
    assert picks["slow"] < 0.1 * 10_000
    assert picks["slow"] * 4 < min(picks["a"], picks["b"])
    assert picks["slow"] > 0  # it is not starved: its cost decays between samples


def test_a_failure_the_cap_kept_admitting_is_priced_per_answer_it_gives() -> None:
    # Peers at 0.2 and 0.4 s, 0.3 s on average; answering half its attempts: 0.6 s per answer.
    assert failure_penalty_s(0.001, [0.2, 0.4], 0.5) == pytest.approx(0.6)
    assert failure_penalty_s(3.0, [0.2], 0.5) == pytest.approx(6.0)  # a timeout: its own time
    assert failure_penalty_s(0.001, [0.3], 1.0) == pytest.approx(0.3 / MIN_ANSWERED_SHARE)
    assert failure_penalty_s(0.01, [], 0.5) == 0.01  # nobody else to compare with


def test_an_instance_failing_half_its_requests_fast_keeps_its_share_and_no_more() -> None:
    """A fake clock: a request every 10 ms; a and b answer in 0.5 s; "bad" (kept in by the
    isolation cap) fails half its attempts within 1 ms and answers the rest as they do, and
    each failure prices it (`failure_penalty_s`, fading with `PENALTY_TAU_S`). It keeps
    about its share (its failures, retried elsewhere, cost a millisecond), and neither
    draws more for failing fast nor holds more at once than its peers: priced at twice the
    dearest peer's load instead, it got almost nothing while its peers queued."""
    rng = random.Random(5)
    names = ["a", "b", "bad"]
    ewma = {name: PeakEwma(0.0, initial_s=0.5) for name in names}
    penalty: PeakEwma | None = None
    in_flight = dict.fromkeys(names, 0)
    most = dict.fromkeys(names, 0)
    pending: list[tuple[float, str, bool]] = []
    picks: Counter[str] = Counter()
    requests = 6_000
    for i in range(requests):
        now = i * 0.01
        while pending and pending[0][0] <= now:
            done_at, name, answered = heapq.heappop(pending)
            in_flight[name] -= 1
            if answered:
                ewma[name].observe(done_at, 0.5)
                continue
            peers = [ewma["a"].get(done_at), ewma["b"].get(done_at)]
            price = failure_penalty_s(0.001, peers, 0.5)
            if penalty is None:
                penalty = PeakEwma(done_at, initial_s=price, tau_s=PENALTY_TAU_S)
            else:
                penalty.observe(done_at, price)

        def cost(name: str, now: float = now, penalty: PeakEwma | None = penalty) -> float:
            latency = ewma[name].get(now)
            if name == "bad" and penalty is not None:
                latency = max(latency, penalty.get(now))
            return load_cost(latency, in_flight[name])

        picked = choose(names, cost, rng)
        assert picked is not None
        picks[picked] += 1
        in_flight[picked] += 1
        most[picked] = max(most[picked], in_flight[picked])
        answered = picked != "bad" or rng.random() < 0.5
        heapq.heappush(pending, (now + (0.5 if answered else 0.001), picked, answered))
    assert penalty is not None
    assert 0.2 * requests < picks["bad"] < requests / 3
    assert most["bad"] <= min(most["a"], most["b"])
