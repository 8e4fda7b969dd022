from __future__ import annotations

import pytest

from gateway.config.models import RetriesPolicy
from gateway.core.outcome import ErrorKind, Outcome, Phase

DEFAULT_ON = frozenset(RetriesPolicy().on)  # connect_failure reset timeout 429 500 502 503 504
OOM_BODY = b'{"error": {"message": "CUDA out of memory. Tried to allocate 2.00 GiB", "code": 500}}'


@pytest.mark.parametrize(
    ("status", "body_head", "headers", "expected"),
    [
        (200, None, None, Outcome("ok", 200)),
        (204, None, None, Outcome("ok", 204)),
        (304, None, None, Outcome("ok", 304)),
        (400, None, None, Outcome("status", 400)),
        (429, None, {"retry-after": "1"}, Outcome("status", 429)),
        (500, b'{"error": "boom"}', {}, Outcome("status", 500)),
        (500, OOM_BODY, {}, Outcome("oom", 500)),
        (500, b"torch.OutOfMemoryError: Out Of Memory", None, Outcome("oom", 500)),
        (500, b"{}", {"x-oom-count": "3"}, Outcome("oom", 500)),
        (503, OOM_BODY, None, Outcome("status", 503)),  # only a 500 is read as an OOM
        (200, b"out of memory", {"x-oom-count": "1"}, Outcome("ok", 200)),
        (504, None, None, Outcome("status", 504)),
        (700, None, None, Outcome("status", 700)),  # outside the table: still classified
    ],
)
def test_from_status(
    status: int, body_head: bytes | None, headers: dict[str, str] | None, expected: Outcome
) -> None:
    assert Outcome.from_status(status, body_head, headers) == expected


def test_common_outcomes_are_shared() -> None:
    assert Outcome.from_status(200) is Outcome.from_status(200)
    assert Outcome.from_error("timeout", "idle") is Outcome.from_error("timeout", "idle")


@pytest.mark.parametrize(
    ("kind", "phase"),
    [("connect_failure", None), ("reset", "first_byte"), ("timeout", "connect")],
)
def test_from_error(kind: ErrorKind, phase: Phase | None) -> None:
    outcome = Outcome.from_error(kind, phase)
    assert (outcome.kind, outcome.status, outcome.phase) == (kind, None, phase)


@pytest.mark.parametrize(
    ("kind", "phase"), [("timeout", None), ("nonsense", None), ("reset", "sometime")]
)
def test_from_error_refuses_unknowns(kind: ErrorKind, phase: Phase | None) -> None:
    with pytest.raises(ValueError):
        Outcome.from_error(kind, phase)


OK = Outcome.from_status(200)
TIMEOUT = Outcome.from_error("timeout", "first_byte")
OOM = Outcome.from_status(500, OOM_BODY)


# outcome, counts as the instance's failure, retryable with the default `on`
@pytest.mark.parametrize(
    ("outcome", "failure", "retryable"),
    [
        (OK, False, False),
        (Outcome.from_status(302), False, False),
        (Outcome.from_error("connect_failure"), True, True),
        (Outcome.from_error("reset", "idle"), True, True),
        (TIMEOUT, True, True),
        (Outcome.from_error("timeout", "connect"), True, True),
        (Outcome.from_error("protocol", "first_byte"), True, False),  # cannot be listed in `on`
        (OOM, True, True),  # retryable through 500
        (Outcome.from_status(429), True, True),  # overloaded: the instance's state, not the ask
        (Outcome.from_status(500), True, True),
        (Outcome.from_status(501), True, False),  # a 5xx not listed
        (Outcome.from_status(503), True, True),
        (Outcome.from_status(400), False, False),  # the client's fault
        (Outcome.from_status(404), False, False),
        (Outcome.from_status(408), False, False),
        (Outcome.from_status(413), False, False),
        (Outcome.from_status(422), False, False),
    ],
)
def test_failure_and_retry_truth_table(outcome: Outcome, failure: bool, retryable: bool) -> None:
    assert outcome.counts_as_failure is failure
    assert outcome.retryable(DEFAULT_ON) is retryable


@pytest.mark.parametrize(
    ("on", "outcome", "retryable"),
    [
        (frozenset({"oom"}), OOM, True),
        (frozenset({500}), OOM, True),
        (frozenset({502, 503}), OOM, False),
        (frozenset({"oom"}), Outcome.from_status(500), False),  # "oom" does not imply 500
        (frozenset({404}), Outcome.from_status(404), True),  # listed: retried, yet no failure
        (frozenset({"timeout"}), Outcome.from_error("reset"), False),
        (frozenset(), TIMEOUT, False),
        (frozenset({200, "ok"}), OK, False),  # success is never retried
    ],
)
def test_retryable_against_custom_conditions(
    on: frozenset[str | int], outcome: Outcome, retryable: bool
) -> None:
    assert outcome.retryable(on) is retryable
