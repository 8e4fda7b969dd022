"""The rate-limited summary lines (a fake clock, no sleeping): at most one line per key per
interval, carrying the count of what was held back; the ingress refusals count every one."""

from __future__ import annotations

import logging

import pytest

from gateway.ingress.refusals import REASONS, SUMMARY_INTERVAL_S, IngressRefusals
from gateway.telemetry.logs import LogThrottle


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_one_line_per_key_per_interval_with_the_count_held_back() -> None:
    clock = FakeClock()
    throttle = LogThrottle(10.0, clock)
    assert throttle.admit("a") == 0  # the first: at once
    assert [throttle.admit("a") for _ in range(5)] == [None] * 5
    assert throttle.admit("b") == 0  # another key: its own interval
    clock.now = 1009.5
    assert throttle.admit("a") is None
    clock.now = 1010.0  # the interval since a's last line is over
    assert throttle.admit("a") == 6
    assert throttle.admit("a") is None
    clock.now += 60  # a quiet minute: the next one is logged, with what the last held back
    assert throttle.admit("a") == 1
    assert throttle.admit("b", now=clock.now) == 0  # an explicit time wins over the clock
    throttle.clear()
    assert throttle.admit("a") == 0


def summaries(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "gateway.ingress"
    ]


def test_refusals_are_counted_each_and_summarised_per_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    refusals = IngressRefusals("data", clock)
    assert refusals.counts == dict.fromkeys(REASONS, 0)  # every reason from the start
    with caplog.at_level(logging.DEBUG, logger="gateway.ingress"):
        for i in range(500):  # an attack: 500 slow heads in a second
            clock.now = 1000.0 + i / 500
            refusals.count("header_timeout", "192.0.2.1")
        refusals.count("unauthorized", "192.0.2.2")
        clock.now = 1000.0 + SUMMARY_INTERVAL_S
        refusals.count("header_timeout", "192.0.2.3")
    assert refusals.counts["header_timeout"] == 501 and refusals.counts["unauthorized"] == 1
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 502  # each at debug
    assert summaries(caplog) == [
        {
            "plane": "data",
            "reason": "header_timeout",
            "refused": 1,
            "total": 1,
            "last_client": "192.0.2.1",
        },
        {
            "plane": "data",
            "reason": "unauthorized",
            "refused": 1,
            "total": 1,
            "last_client": "192.0.2.2",
        },
        {
            "plane": "data",
            "reason": "header_timeout",
            "refused": 500,  # the 499 held back, and this one
            "total": 501,
            "last_client": "192.0.2.3",
        },
    ]
