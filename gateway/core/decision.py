"""Isolation decisions as replicas share them, and the rules for applying another's decision.

A decision is one breaker transition of one replica, in a form every replica can read: the
instance, its new state (ISOLATED or ADMITTING), why, who decided, when (`at`, wall-clock
seconds), and until when an isolation lasts (`until`, wall clock; None for an operator's
isolation, which lasts until restored). The same JSON is the value of the instance's key and the
message on the channel.

Ordering is last-writer-wins on `at`, per instance, kept in `Marks`: a restore older than the
latest isolation is stale, and so is an isolation older than the latest restore (an operator's
isolation yields only to an operator's restore). Replicas' clocks are assumed synchronised
(NTP) to well under an isolation's length.

Pure: clocks are arguments; nothing here touches Redis.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final, Literal

from gateway.core.breaker import ADMITTING, ISOLATED, PROBE_RELEASED, BreakerState, Transition

DecisionState = Literal["ISOLATED", "ADMITTING"]

# A decision is a few hundred bytes; anything far larger is not ours.
MAX_ENCODED_BYTES: Final = 4096
_FIELDS: Final = ("v", "pool", "instance", "state", "reason", "replica", "at", "until", "forced")
_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Decision:
    pool: str
    instance: str
    state: DecisionState
    reason: str
    replica: str
    at: float
    until: float | None = None
    forced: bool = False

    def encode(self) -> bytes:
        return json.dumps(
            {
                "v": _VERSION,
                "pool": self.pool,
                "instance": self.instance,
                "state": self.state,
                "reason": self.reason,
                "replica": self.replica,
                "at": self.at,
                "until": self.until,
                "forced": self.forced,
            },
            separators=(",", ":"),
        ).encode()


class MalformedDecision(ValueError):
    """What came from the store is not a decision this gateway can trust."""


def decode(raw: bytes | str) -> Decision:
    """Parse and check a decision strictly: anything unexpected raises `MalformedDecision`."""
    if len(raw) > MAX_ENCODED_BYTES:
        raise MalformedDecision(f"{len(raw)} bytes, more than {MAX_ENCODED_BYTES}")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedDecision(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MalformedDecision("not a JSON object")
    if data.get("v") != _VERSION:
        raise MalformedDecision(f"unknown version {data.get('v')!r}")
    unknown = set(data) - set(_FIELDS)
    if unknown:
        raise MalformedDecision(f"unknown fields {sorted(unknown)}")
    state = data.get("state")
    if state not in (ISOLATED, ADMITTING):
        raise MalformedDecision(f"unknown state {state!r}")
    pool, instance, reason, replica = (
        _text(data, name, empty=name == "reason")
        for name in ("pool", "instance", "reason", "replica")
    )
    at = _finite_number(data.get("at"), "at")
    until_raw = data.get("until")
    until = None if until_raw is None else _finite_number(until_raw, "until")
    forced = data.get("forced", False)
    if not isinstance(forced, bool):
        raise MalformedDecision("forced must be true or false")
    if state == ISOLATED and until is None and not forced:
        raise MalformedDecision("an isolation needs an end (until) unless forced")
    return Decision(pool, instance, state, reason, replica, at, until, forced)


def _text(data: dict[str, Any], name: str, empty: bool) -> str:
    value = data.get(name)
    if not isinstance(value, str) or (not value and not empty):
        raise MalformedDecision(f"{name} must be a non-empty string")
    return value


def _finite_number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MalformedDecision(f"{name} must be a finite number")
    return float(value)


def from_transition(
    pool: str,
    transition: Transition,
    replica: str,
    wall_now: float,
    mono_now: float,
    operator: bool = False,
) -> Decision | None:
    """The decision to share for one of our own transitions (`operator`: made through the admin
    API); None for those others need not know: a trip the cap refused, a probe released."""
    if transition.suppressed or transition.reason == PROBE_RELEASED:
        return None
    if transition.to == ISOLATED:
        until = transition.until
        forced = until is None or until == math.inf
        wall_until = None if until is None or forced else wall_now + (until - mono_now)
        state: DecisionState = ISOLATED
    elif transition.to == ADMITTING:
        forced, wall_until, state = operator, None, ADMITTING
    else:
        return None
    return Decision(
        pool, transition.instance, state, transition.reason, replica, wall_now, wall_until, forced
    )


class Marks:
    """One instance's latest decision times (wall clock), our own and others', for ordering."""

    __slots__ = ("decided_by", "isolated_at", "operator_restored_at", "restored_at")

    def __init__(self) -> None:
        self.isolated_at = -math.inf
        self.restored_at = -math.inf
        self.operator_restored_at = -math.inf
        # The replica whose isolation holds the instance here (None: our own, or none).
        self.decided_by: str | None = None

    def own(self, decision: Decision) -> None:
        """Record one of our own decisions."""
        self.note(decision)
        self.decided_by = None

    def note(self, decision: Decision) -> None:
        if decision.state == ISOLATED:
            self.isolated_at = max(self.isolated_at, decision.at)
        else:
            self.restored_at = max(self.restored_at, decision.at)
            if decision.forced:
                self.operator_restored_at = max(self.operator_restored_at, decision.at)

    def is_stale(self, decision: Decision) -> bool:
        if decision.state == ISOLATED:
            newest_restore = self.operator_restored_at if decision.forced else self.restored_at
            return decision.at <= newest_restore
        return decision.at <= self.isolated_at or decision.at <= self.restored_at


def apply_remote(
    breaker: BreakerState,
    marks: Marks,
    decision: Decision,
    mono_now: float,
    wall_now: float,
    trusted_for_s: float,
) -> Transition | None:
    """Apply another replica's decision to our breaker for that instance.

    An isolation is adopted (capped by the pool's guard, see `BreakerState.adopt`) until its
    end or until `trusted_for_s` from now, whichever is sooner: a decision nobody renews fades
    within that time. A fresh read of a decision already held extends it the same way. The
    replica of the newest isolation becomes `marks.decided_by` (an older one of ours is then
    superseded: the caller stops renewing it). A
    restore lifts the isolation here (`BreakerState.lift`). Stale decisions are ignored.
    Returns the Transition to log, or None.
    """
    if marks.is_stale(decision):
        return None
    if decision.state == ISOLATED:
        end = mono_now + trusted_for_s
        if decision.until is not None and not decision.forced:
            end = min(end, mono_now + (decision.until - wall_now))
        reason = f"shared by {decision.replica}: {decision.reason}"
        transition = breaker.adopt(mono_now, end, reason)
        if breaker.state == ISOLATED and end > mono_now:
            if decision.at > marks.isolated_at:
                # The newest isolation holds the instance (ours, if any, is superseded).
                marks.decided_by = decision.replica
            marks.note(decision)
        return transition
    marks.note(decision)
    transition = breaker.lift(
        mono_now, f"restored by {decision.replica}: {decision.reason}", operator=decision.forced
    )
    if transition is not None:
        marks.decided_by = None
    return transition


def withdraw(breaker: BreakerState, marks: Marks, mono_now: float) -> Transition | None:
    """The store no longer holds the isolation we adopted: its replica restored it (and we
    missed the message) or stopped renewing it (it expired). Lift it here, unless a probe of
    ours is running (its result decides) or the isolation is our own."""
    holder = marks.decided_by
    if holder is None or breaker.state != ISOLATED:
        return None
    transition = breaker.lift(mono_now, f"decision of {holder} withdrawn or expired")
    if transition is not None:
        marks.decided_by = None
    return transition
