"""An instance's last engine-wide stall, and what it took of an attempt's time, for the price.

Owned by one `InstanceState` (its `stall`), which tells it when a piece of a stream ended a
silence of every stream it runs (`heard`); only this module assigns its fields. A new request's
first byte ends none: a silence it ends may be its own prefill's pause, or an engine that
turned slower, which is the engine's pace.
"""

from __future__ import annotations

from gateway.core.ewma import Ewma

# A silence of every stream an instance runs (two or more) longer than this, and than
# `STALL_GAPS` times the largest gap its streams usually have (once learned), is a stall of the
# engine (frozen, paused, swapped out, another prompt's long prefill), not the pace of the
# streams that lived through it.
STALL_FLOOR_S = 0.5
STALL_GAPS = 4.0


class Stall:
    """From the instance's last byte before its last stall to the piece of a stream that ended
    it (both -1 while there was none)."""

    __slots__ = ("since", "until")

    def __init__(self) -> None:
        self.since = self.until = -1.0

    def heard(self, quiet_from: float, at: float, gap: Ewma) -> None:
        """Its streams were all silent from `quiet_from` to `at`, longer than the floor: a
        stall if longer than `STALL_GAPS` of the largest gap its streams usually have (`gap`).
        Not before that gap is learned: on a slow engine, a usual step may outlast the floor.
        Only the last stall is kept: an attempt that lived through two is priced with the
        earlier one in (it errs dear)."""
        if gap.samples and at - quiet_from > STALL_GAPS * gap.mean:
            self.since = quiet_from
            self.until = at

    def active_s(self, start: float, end: float) -> float:
        """How much of `[start, end]` (an attempt's time) was not the last stall. A stall of
        the whole engine (a freeze, a pause) that an attempt lived through is not the engine's
        pace: priced on it, an engine that thawed was priced at the stall for the tens of
        seconds a peak fades in, as the streams sent into it ended one by one (each priced on
        its first byte, which waited out the stall), and its share went to the others
        meanwhile (seen under chaos-mix: 42 attempts in flight on the thawed instance against
        138 on its peer, for 10 s)."""
        until = self.until
        if until <= start:  # the usual case: no stall since it was sent
            return end - start
        since = self.since
        overlap = (end if end < until else until) - (start if start > since else since)
        return end - start - overlap if overlap > 0.0 else end - start

    def unstalled_wait_s(self, start: float, end: float, usual_s: float) -> float:
        """A wait over `[start, end]` for a first byte (or a whole answer), as the balancer
        prices it: without what the last stall took (`active_s`), but no less than a usual wait
        there (`usual_s`, nor more than the wait): at none, an engine would look free for
        having stalled."""
        waited = end - start
        if self.until <= start:  # the usual case: no stall since it was sent
            return waited
        active = self.active_s(start, end)
        if active >= waited:
            return waited
        floor = usual_s if usual_s < waited else waited
        return active if active > floor else floor
