"""A pool's retry budget: retries stay a bounded fraction of the traffic, as in Finagle and gRPC."""

from __future__ import annotations

from gateway.config.models import BudgetPolicy
from gateway.core.window import WindowPair

WINDOW_S = 10
# Products such as 0.29 * 100 land a hair under the integer they mean.
_EPSILON = 1e-9


class RetryBudget:
    """Retries allowed: `ratio * requests + min_per_second * window_s`, both over the window.

    The window is `window_s` one-second buckets in a fixed ring, keyed by `floor(now)`: it
    covers the current second and the `window_s - 1` before it. `record_request` is called once
    per client request (not per attempt); `try_spend` once per retry it would like to make.
    Without retries capped this way, a struggling pool gets up to `1 + max_retries` times its
    load exactly when it can least take it.

    A retry that is answered is given back (`refund`): what the budget holds back is retries
    that fail again.

    Every call is O(1): a call that moves the window clears at most `window_s` buckets, and a
    jump of a whole window or more clears them all at once. A `now` earlier than the newest
    bucket (a clock that went back) counts in the newest bucket.
    """

    __slots__ = ("_allowance", "_ratio", "_window")

    def __init__(self, ratio: float, min_per_second: float, window_s: int = WINDOW_S) -> None:
        if window_s < 1:
            raise ValueError(f"the window must be at least 1 s, got {window_s}")
        self._ratio = ratio
        self._allowance = min_per_second * window_s + _EPSILON
        self._window = WindowPair(window_s)  # first: requests, second: retries

    @classmethod
    def from_policy(cls, policy: BudgetPolicy, window_s: int = WINDOW_S) -> RetryBudget:
        """The budget of `retries.budget`."""
        return cls(policy.ratio, policy.min_per_second, window_s)

    def record_request(self, now: float) -> None:
        """Count one client request at `now`."""
        window = self._window
        window.add_first(window.advance(now))

    def try_spend(self, now: float, share: float = 1.0) -> bool:
        """Whether one more retry fits at `now`; when it does, it is counted.

        Allowed when `retries + 1 ≤ share * (ratio * requests + min_per_second * window_s)`,
        counting the requests and retries of the window that ends at `now`. A `share` below 1
        leaves the rest of the budget to other spenders: hedges, which bet on latency, take at
        most part of it, so retries, which rescue failures, always find the rest.
        """
        window = self._window
        slot = window.advance(now)
        limit = self._ratio * window.first_total + self._allowance
        if window.second_total + 1 > share * limit:
            return False
        window.add_second(slot)
        return True

    def refund(self, spent_at: float, now: float) -> None:
        """Give back a retry spent at `spent_at` whose attempt succeeded.

        The budget bounds the work retries add that serves no one: a retry that is answered
        replaces its request's failed attempt with the one answer that request needed, where
        one that fails again is pure extra load. Counting only retries that fail again keeps a
        retry storm on a failing pool as bounded as ever, and lets a pool whose one instance
        fails fast (OOM refusals, 503s) while its others answer send every such request on.
        """
        self._window.advance(now)
        self._window.remove_second(spent_at)

    def counts(self, now: float) -> tuple[int, int]:
        """`(requests, retries)` in the window that ends at `now` (for metrics and admin)."""
        self._window.advance(now)
        return self._window.first_total, self._window.second_total
