"""What one upstream attempt came to, decided in one place: whose fault, and worth a retry?"""

from __future__ import annotations

from collections.abc import Container, Set
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

OutcomeKind = Literal["ok", "connect_failure", "reset", "timeout", "status", "oom", "protocol"]
ErrorKind = Literal["connect_failure", "reset", "timeout", "protocol"]


class Phase(StrEnum):
    """What an attempt is waiting for: the one vocabulary of timeouts, from the deadline the
    watchdog enforces to the error, the outcome and the metrics' `phase` label."""

    CONNECT = "connect"  # a connection: DNS, TCP, the TLS handshake (or a free one)
    FIRST_BYTE = "first_byte"  # the answer's head and first byte
    BODY = "body"  # the rest of a whole (non-streamed) body
    IDLE = "idle"  # the next chunk of a stream
    TOTAL = "total"  # the request's own deadline, once its answer flows

    @property
    def counted_as(self) -> Phase:
        """How an outcome counts a timeout in this phase: a whole body is part of its first
        byte (one prediction covers both), and the request's own deadline can only run out
        while a stream flows (an idle wait)."""
        return _COUNTED_AS.get(self, self)


_COUNTED_AS = {Phase.BODY: Phase.FIRST_BYTE, Phase.TOTAL: Phase.IDLE}
_ERROR_KINDS: tuple[ErrorKind, ...] = ("connect_failure", "reset", "timeout", "protocol")
# The phases an outcome carries (`Phase.counted_as`).
_PHASES: tuple[Phase | None, ...] = (None, Phase.CONNECT, Phase.FIRST_BYTE, Phase.IDLE)
# vLLM reports a CUDA OOM as a 500 whose message says "CUDA out of memory"; the fake backend
# also marks it with this header.
_OOM_TEXT = b"out of memory"
_OOM_HEADER = "x-oom-count"


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of one attempt.

    `kind` is one of `ok` (a status below 400), `connect_failure`, `reset`, `timeout` (`phase`
    says which wait ran out), `status` (an error status, 400 and up), `oom` (the backend ran out
    of memory; `status` 500) or `protocol` (the backend broke HTTP or the stream format).
    Build them with `from_status` and `from_error`: the common ones are shared, not allocated.
    """

    kind: OutcomeKind
    status: int | None = None
    phase: Phase | None = None

    @property
    def counts_as_failure(self) -> bool:
        """Whether the instance is to blame (the failure rate and the breaker count it).

        True for connect_failure, reset, timeout, protocol, oom, any 5xx and 429 (overloaded);
        False for ok and the other 4xx (the client's request was wrong: 400, 404, 413, 422...).
        """
        kind = self.kind
        if kind == "status":
            status = self.status
            return status is not None and (status >= 500 or status == 429)
        return kind != "ok"

    def retryable(self, on: Set[str | int]) -> bool:
        """Whether `retries.on` (as a set, built once per pool: `frozenset(policy.retries.on)`)
        allows a retry after this outcome.

        status: its code is in `on`; oom: "oom" or 500 is in `on` (an OOM is a 500 to anyone who
        does not look closer); connect_failure, reset, timeout: the kind is in `on`; ok and
        protocol: never ("protocol" cannot be listed in a policy). Whether the response already
        reached the client (the commit point) is the retry loop's business, not this one's.
        """
        kind = self.kind
        if kind == "status":
            return self.status in on
        if kind == "oom":
            return "oom" in on or 500 in on
        return kind != "ok" and kind != "protocol" and kind in on

    @staticmethod
    def from_status(
        status: int, body_head: bytes | None = None, headers: Container[str] | None = None
    ) -> Outcome:
        """Classify a response by its status line, and for a 500 by a look at its body.

        Below 400: ok. A 500 is `oom` when `headers` (lower-case names, or a case-insensitive
        mapping) has `x-oom-count`, or `body_head` (the first bytes of the body) contains
        "out of memory" in any case. Any other status from 400 up: `status`.
        """
        if status == 500 and (
            (headers is not None and _OOM_HEADER in headers)
            or (body_head is not None and _OOM_TEXT in body_head.lower())
        ):
            return _OOM
        outcome = _BY_STATUS.get(status)
        if outcome is None:
            outcome = Outcome("ok" if status < 400 else "status", status)
        return outcome

    @staticmethod
    def from_error(kind: ErrorKind, phase: Phase | None = None) -> Outcome:
        """The outcome of an attempt that got no usable response.

        A `timeout` must say its `phase` (counted as `Phase.counted_as`); the other kinds may
        (for telemetry). Raises ValueError for an unknown kind or phase.
        """
        if phase is not None:
            phase = Phase(phase).counted_as
        outcome = _BY_ERROR.get((kind, phase))
        if outcome is None:
            raise ValueError(f"no outcome {kind!r} in phase {phase!r}")
        return outcome


_OOM = Outcome("oom", 500)
_BY_STATUS = {
    status: Outcome("ok" if status < 400 else "status", status) for status in range(100, 600)
}
_BY_ERROR = {
    (kind, phase): Outcome(kind, None, phase)
    for kind in _ERROR_KINDS
    for phase in _PHASES
    if not (kind == "timeout" and phase is None)
}
