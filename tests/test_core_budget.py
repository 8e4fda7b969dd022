from __future__ import annotations

from gateway.config.models import BudgetPolicy
from gateway.core.budget import RetryBudget


def spend_all(budget: RetryBudget, now: float, limit: int = 10_000) -> int:
    """How many retries the budget grants at `now` before it says no."""
    granted = 0
    while granted < limit and budget.try_spend(now):
        granted += 1
    return granted


def test_a_burst_is_capped_at_ratio_times_requests_plus_the_floor() -> None:
    budget = RetryBudget.from_policy(BudgetPolicy())  # ratio 0.2, 5/s over 10 s
    for i in range(100):
        budget.record_request(0.5 + i * 0.01)
    assert spend_all(budget, 1.9) == int(0.2 * 100 + 5 * 10)  # 70
    assert not budget.try_spend(1.9)
    assert budget.counts(1.9) == (100, 70)


def test_the_floor_alone_without_traffic() -> None:
    assert spend_all(RetryBudget(0.2, 5.0), 0.0) == 50
    assert spend_all(RetryBudget(0.5, 0.0), 0.0) == 0
    assert spend_all(RetryBudget(0.0, 0.0), 0.0) == 0


def test_every_new_request_earns_its_ratio() -> None:
    budget = RetryBudget(ratio=0.25, min_per_second=0.0)
    granted = []
    for i in range(12):
        budget.record_request(i * 0.05)
        granted.append(budget.try_spend(i * 0.05))
    # One retry per four requests: granted at the 4th, 8th and 12th.
    assert [i + 1 for i, ok in enumerate(granted) if ok] == [4, 8, 12]


def test_ratio_products_that_round_low_still_count() -> None:
    budget = RetryBudget(ratio=0.29, min_per_second=0.0)
    for _ in range(100):
        budget.record_request(0.0)
    assert spend_all(budget, 0.0) == 29  # 0.29 * 100 is 28.999999999999996 in floats


def test_the_window_slides() -> None:
    budget = RetryBudget(ratio=0.5, min_per_second=0.0, window_s=10)
    for _ in range(20):
        budget.record_request(0.2)  # second 0
    for _ in range(20):
        budget.record_request(5.2)  # second 5
    assert spend_all(budget, 5.5) == 20  # 0.5 * 40
    # Second 10: second 0 has left the window; its 20 requests no longer earn anything, and
    # the 20 retries (made in second 5) still count against the remaining 10 allowed.
    assert budget.counts(10.0) == (20, 20)
    assert not budget.try_spend(10.0)
    # Second 15: the retries of second 5 have left too; so have its requests.
    assert budget.counts(15.0) == (0, 0)
    for _ in range(4):
        budget.record_request(15.0)
    assert spend_all(budget, 15.0) == 2


def test_the_window_covers_the_current_second_and_the_nine_before() -> None:
    budget = RetryBudget(ratio=1.0, min_per_second=0.0, window_s=10)
    budget.record_request(3.99)
    assert budget.counts(12.99) == (1, 0)
    assert budget.counts(13.0) == (0, 0)


def test_a_long_idle_gap_resets_cleanly() -> None:
    budget = RetryBudget(ratio=0.2, min_per_second=5.0)
    for _ in range(1000):
        budget.record_request(100.0)
    assert spend_all(budget, 100.0) == 250
    # An hour later, nothing of that is left: only the floor.
    assert budget.counts(3700.0) == (0, 0)
    assert spend_all(budget, 3700.0) == 50
    # Gaps just short of and just past a window.
    budget.record_request(3709.5)
    assert budget.counts(3709.9) == (1, 50)
    assert budget.counts(3718.9) == (1, 0)
    assert budget.counts(3719.0) == (0, 0)


def test_a_clock_going_back_counts_in_the_newest_second() -> None:
    budget = RetryBudget(ratio=1.0, min_per_second=0.0)
    budget.record_request(50.0)
    budget.record_request(42.0)
    assert budget.counts(59.0) == (2, 0)
    assert budget.counts(60.0) == (0, 0)


def test_the_ring_stays_fixed_and_deterministic() -> None:
    def run() -> list[bool]:
        budget = RetryBudget(ratio=0.1, min_per_second=0.5)
        results = []
        for i in range(20_000):
            now = 1000.0 + i * 0.037
            budget.record_request(now)
            if i % 3 == 0:
                results.append(budget.try_spend(now))
        assert len(budget._window._first) == len(budget._window._second) == 10
        return results

    first = run()
    assert first == run()
    assert 0 < sum(first) < len(first)


def test_a_share_leaves_the_rest_of_the_budget_to_others() -> None:
    budget = RetryBudget(0.0, 1.0)  # 10 over the window
    assert spend_all_at_share(budget, 0.5) == 5  # hedges: half
    assert spend_all(budget, 0.0) == 5  # retries: the rest
    assert not budget.try_spend(0.0)


def spend_all_at_share(budget: RetryBudget, share: float) -> int:
    granted = 0
    while granted < 100 and budget.try_spend(0.0, share):
        granted += 1
    return granted


def test_an_answered_retry_is_given_back_and_one_that_fails_again_stays_counted() -> None:
    budget = RetryBudget(ratio=0.0, min_per_second=0.3, window_s=10)  # 3 retries per window
    assert spend_all(budget, 1.2) == 3
    budget.refund(1.2, 2.5)  # answered: it added no load that served no one
    assert budget.counts(2.5) == (0, 2)
    assert budget.try_spend(2.5)  # room again for exactly one
    assert not budget.try_spend(2.5)
    # The refund came out of second 1, where it was spent: when second 1 leaves the window,
    # only its two retries that were not given back leave with it.
    assert budget.counts(11.0) == (0, 1)
    assert budget.counts(11.9) == (0, 1)
    assert budget.counts(12.0) == (0, 0)


def test_a_refund_for_a_retry_the_window_forgot_changes_nothing() -> None:
    budget = RetryBudget(ratio=0.0, min_per_second=0.2, window_s=10)  # 2 per window
    assert budget.try_spend(0.5)
    assert spend_all(budget, 12.0) == 2  # second 0 left the window: the old retry is gone
    budget.refund(0.5, 12.5)  # its bucket was emptied: nothing to take back
    assert budget.counts(12.5) == (0, 2)
    assert not budget.try_spend(12.5)
    budget.refund(7.0, 12.5)  # nothing was spent at 7 either
    assert budget.counts(12.5) == (0, 2)
