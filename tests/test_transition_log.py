"""Breaker transitions are logged; a suppressed trip, which repeats on every failure while the
isolation cap holds, at most once per instance per interval, with the count of the rest."""

from __future__ import annotations

import logging

import pytest

from gateway.cluster import store
from gateway.core.breaker import ADMITTING, ISOLATED, Transition


def suppressed(instance: str) -> Transition:
    return Transition(instance, ADMITTING, ADMITTING, "error rate (suppressed: cap)", None, True)


def test_suppressed_trips_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    log = store.TransitionLog()
    interval = store.SUPPRESSED_LOG_INTERVAL_S
    with caplog.at_level(logging.WARNING, logger="gateway.breaker"):
        for i in range(100):  # a hundred failures in one second
            log.write("p", suppressed("a"), now=1000.0 + i / 100)
        log.write("p", suppressed("b"), now=1000.5)  # another instance: its own
        log.write("p", suppressed("a"), now=1000.0 + interval)
        real = Transition("a", ADMITTING, ISOLATED, "5 consecutive failures", 1.0)
        log.write("p", real, now=1000.0 + interval)  # never held back
    lines = [(r.fields["instance"], r.fields.get("repeats_not_logged")) for r in caplog.records]  # type: ignore[attr-defined]
    assert lines == [("a", 0), ("b", 0), ("a", 99), ("a", None)]
