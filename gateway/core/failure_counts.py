"""What a breaker counts while it admits, and when those counts call for an isolation.

Pure: `now` (monotonic seconds) is an argument. The breaker (`gateway.core.breaker`) owns one
`FailureCounts` and decides what a `Trip` leads to (the pool's cap, the isolation's length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.config.models import BreakerPolicy
from gateway.core.window import WindowPair


@dataclass(frozen=True, slots=True)
class Trip:
    """Why an instance is to be isolated: what its counts showed, a failed probe, or a cause
    from outside the request path (a health check, another replica).

    `in_a_row`: consecutive failures or timeouts, which may take an isolated instance's place
    (`PoolBreakers.make_room`); an error-rate trip never does: such an instance still answers
    between failures. `silent`: the instance stopped answering (timeouts), so its open streams
    may have stopped too. `answered`: the failure behind it was one the instance answered (an
    error, not a timeout), so the isolation may end early for a probe.
    """

    reason: str
    in_a_row: bool = False
    silent: bool = False
    answered: bool = False


class FailureCounts:
    """One instance's results while its breaker admits. The rules, exactly:

    `count` takes every finished attempt the caller classified (a client's 4xx is not counted
    at all; `timeout` implies `failed`):

    - `consecutive_timeouts` rises on a timeout and drops to 0 on any other result, failure or
      success; `consecutive_failures` rises on any failure and drops to 0 on a success (a
      dead instance refusing connections is isolated after a few attempts, not once its
      window's error rate catches up with minutes of past successes);
    - a sliding window of `ceil(policy.window)` one-second buckets (a fixed ring keyed by
      `floor(now)`: the current second and the ones before it) counts results and failures.

    The trip is checked when a failure is counted, never on a success (a success that brings
    the window to `min_requests` must not isolate an instance that just answered well):
    it trips when `consecutive_timeouts ≥ policy.consecutive_timeouts`, or when
    `consecutive_failures ≥ policy.consecutive_failures`, else when the window
    holds `≥ policy.min_requests` results and `failures / results > policy.error_rate`
    (strictly above: exactly 15 % with a 15 % threshold does not trip).

    A trip the pool's cap refuses leaves the counts as they are: the next failure asks again.
    """

    __slots__ = (
        "_error_rate",
        "_failure_limit",
        "_min_requests",
        "_timeout_limit",
        "_window",
        "_window_s",
        "consecutive_failures",
        "consecutive_timeouts",
    )

    def __init__(self, policy: BreakerPolicy) -> None:
        self.consecutive_timeouts = 0
        self.consecutive_failures = 0
        self._window_s = policy.window
        # first: results, second: failures
        self._window = WindowPair(max(1, math.ceil(policy.window)))
        self._limits(policy)

    def configure(self, policy: BreakerPolicy) -> None:
        """Take a reloaded policy's limits, keeping the counts. The window keeps its counts
        unless its length changed (then it starts empty)."""
        self._limits(policy)
        if max(1, math.ceil(policy.window)) != max(1, math.ceil(self._window_s)):
            self._window = WindowPair(max(1, math.ceil(policy.window)))
        self._window_s = policy.window

    def _limits(self, policy: BreakerPolicy) -> None:
        self._timeout_limit = policy.consecutive_timeouts
        self._failure_limit = policy.consecutive_failures
        self._error_rate = policy.error_rate
        self._min_requests = policy.min_requests

    def count(self, now: float, failed: bool, timeout: bool) -> Trip | None:
        """Count one finished attempt (rules in the class docstring); the Trip when it calls
        for an isolation."""
        window = self._window
        slot = window.advance(now)
        window.add_first(slot)
        if not (failed or timeout):
            self.consecutive_timeouts = 0
            self.consecutive_failures = 0
            return None
        window.add_second(slot)
        self.consecutive_failures += 1
        if timeout:
            self.consecutive_timeouts += 1
            if self.consecutive_timeouts >= self._timeout_limit:
                return Trip(
                    f"{self.consecutive_timeouts} consecutive timeouts", in_a_row=True, silent=True
                )
        else:
            self.consecutive_timeouts = 0
        if self.consecutive_failures >= self._failure_limit:
            return Trip(
                f"{self.consecutive_failures} consecutive failures",
                in_a_row=True,
                answered=not timeout,
            )
        results = window.first_total
        if results >= self._min_requests:
            failures = window.second_total
            # A division, not `failures > rate * results`: the quotient is correctly rounded,
            # so an exact 3/20 equals 0.15 while 0.15 * 20 need not equal 3.
            rate = failures / results
            if rate > self._error_rate:
                return Trip(
                    f"error rate {rate:.2f} over {self._window_s:g} s ({failures}/{results})",
                    answered=not timeout,
                )
        return None

    def clear(self) -> None:
        """Forget every result: the instance starts afresh (a probe answered, an operator
        vouched for it)."""
        self.consecutive_timeouts = 0
        self.consecutive_failures = 0
        self._window.clear()

    def window_counts(self, now: float) -> tuple[int, int]:
        """`(results, failures)` in the window that ends at `now`."""
        window = self._window
        window.advance(now)
        return window.first_total, window.second_total

    def failure_share(self, now: float) -> float:
        """The share of its attempts it fails now: its window's failure rate, and at least
        `n / (n + 1)` after n failures in a row (a window long in successes says little of an
        instance failing everything since). 1 with nothing in the window."""
        window = self._window
        window.advance(now)
        results = window.first_total
        rate = window.second_total / results if results else 1.0
        streak = self.consecutive_failures
        return max(rate, streak / (streak + 1))
