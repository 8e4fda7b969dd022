"""The per-instance breaker (ADMITTING → ISOLATED → PROBING → ADMITTING) and the pool's cap.

Words: ADMITTING (traffic flows), ISOLATED (no traffic), PROBING (one probe request at a time).
Pure: `now` (monotonic seconds) and a `random.Random` are arguments; every state change returns
a `Transition` for the async shell to log, count and publish.

The breaker's rules (`BreakerState`):

**ADMITTING** (`try_admit` → True). `record` counts every finished attempt the caller
classified (a client's 4xx is not recorded at all; `timeout` implies `failed`) in `counts`,
whose `FailureCounts` rules say when it trips: only ever on a failure.

**Trip.** If the pool's guard (`may_isolate`, see `PoolBreakers`) refuses, the breaker stays
ADMITTING with its counters untouched, `suppressed_isolations` rises and `record` returns a
Transition with `suppressed=True`; the next failure checks again, so the instance is
isolated as soon as there is room and it still fails. Otherwise it becomes **ISOLATED**
until `isolated_until = now +` the length `backoff` gives (`IsolationBackoff`: `streak`
rises by one, the length doubles with it up to `max_isolation`, jittered).

**ISOLATED** (`try_admit` → False before `isolated_until`). At `now ≥ isolated_until`, the
next `try_admit` turns the breaker to **PROBING** and returns True: that caller holds the
probe (it can tell: `state == "PROBING"` right after a True). Every other `try_admit` gets
False until the probe's result, `record(..., probe=True)`:

- success → ADMITTING, window and `consecutive_timeouts` cleared, `streak = max(0, n - 1)`;
- failure → ISOLATED again with streak n + 1 (the next, longer isolation).

An isolation for failures the instance answered (errors, OOMs: it is up) may end early:
`try_admit(now, early=True)`, which the caller asks only while every instance still
admitting is full, probes it before `isolated_until`, at most once per `EARLY_PROBE_GAP_S`.
So may any isolation but an operator's with `try_admit(now, spare=True)`, which the caller
asks only while nothing in the pool admits and a fallback pool answers meanwhile: a failed
spare probe leaves the isolation as it was (same end, not counted again).

A probe that never reports (its request was cancelled) must not wedge the breaker:
`release_probe(now)` puts it back to ISOLATED as it was (an ordinary probe's `isolated_until`
already passed, so the next `try_admit` probes again; an early or spare one's isolation goes
on); and a probe outstanding longer than `max_isolation` lets one more probe through (the
later of the two that reports decides, whichever it is).

Results recorded without `probe=True` while ISOLATED or PROBING are ignored: they come from
requests admitted before the isolation, and describe the instance before the pause.

**Operator.** `isolate(now, rng, reason)` holds it ISOLATED, whatever the pool's cap, until
`restore(now)` clears its record; `isolate(..., forced=False)` is an automatic trip from
outside the request path (the rules in their docstrings).

**Shared decisions.** `adopt` and `lift` apply what another replica decided (see their
docstrings). `lease_until` gates the ISOLATED → PROBING step: a probe starts only while
`now < lease_until` (default `inf`, always). Replicas sharing decisions set it to 0 and let
the replica holding the instance's probe lease through, so a recovering instance is probed
by one replica, not by all of them at once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

from gateway.config.models import BreakerPolicy
from gateway.core.failure_counts import FailureCounts, Trip

StateName = Literal["ADMITTING", "ISOLATED", "PROBING"]
ADMITTING: Final = "ADMITTING"
ISOLATED: Final = "ISOLATED"
PROBING: Final = "PROBING"

# Isolations last their nominal length times a factor drawn from [1 - JITTER, 1 + JITTER], so
# instances isolated together (one bad switch, one shared cause) do not all probe at once.
JITTER = 0.1
_INF = math.inf
# Products such as 0.29 * 100 land a hair under the integer they mean.
_EPSILON = 1e-9
# 2**62 * any sane isolation is far past max_isolation; the cap keeps the power finite.
_MAX_DOUBLINGS = 62
# At most one early probe (`try_admit(early=True)`) per instance this often: each one is a real
# request, retried elsewhere when it fails.
EARLY_PROBE_GAP_S = 1.0
PROBE_RELEASED: Final = "probe released"


@dataclass(frozen=True, slots=True)
class Transition:
    """A breaker's change of state, or a trip the pool's cap refused (`suppressed`).

    `until` is the monotonic time the isolation ends when `to` is ISOLATED (`inf` for an
    operator's isolation), else None. A suppressed trip has `state_from == to == "ADMITTING"`:
    nothing changed, but the shell should log and count it (Envoy's `ejections_overflow`).
    """

    instance: str
    state_from: StateName
    to: StateName
    reason: str
    until: float | None = None
    suppressed: bool = False
    # An isolation that took another one's place: that one's lift, to apply and share first.
    displaced: Transition | None = None
    # An isolation for timeouts: the instance stopped answering, so its open streams may
    # have stopped too. One for failures it answered (errors, out of memory, refusals) says
    # nothing of the streams it is still sending.
    silent: bool = False


def isolation_cap(fraction: float, size: int) -> int:
    """How many of a pool's `size` instances may be out at once: `max(1, ⌊fraction·size⌋)`,
    and 0 in a pool of one.

    At least one in a pool of two or more, so a single bad instance can always be taken out;
    none in a pool of one (a sidecar): isolating its only instance would turn a partial
    failure into a total one, so it is retried instead.
    """
    if size <= 1:
        return 0
    return max(1, math.floor(fraction * size + _EPSILON))


class IsolationBackoff:
    """How long a breaker's isolations last, and the streak that lengthens them.

    Each isolation adds one to `streak` and, with n the new streak, lasts
    `min(isolation · 2^(n-1), max_isolation) * f`, f drawn uniformly from `[1 - jitter,
    1 + jitter]` with the rng passed in (so up to `1.1 * max_isolation` with the default jitter).
    A return to ADMITTING after a probe takes one off (`readmitted`); an operator clears it
    (`forget`).

    The streak also decays with time, as Envoy's ejection multiplier does: at a trip, one step
    is forgiven per whole `max_isolation` spent ADMITTING since the last return to ADMITTING
    (`streak = max(0, streak - ⌊admitting time / max_isolation⌋)` before adding 1). Without it
    the streak could only go up by one per trip and down by one per probe, so an instance that
    tripped a few times a week would keep long isolations forever. `streak` as read is the
    value before that forgiveness.
    """

    __slots__ = ("_admitting_since", "_isolation_s", "_jitter", "max_isolation_s", "streak")

    def __init__(self, policy: BreakerPolicy, jitter: float = JITTER) -> None:
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        self.streak = 0
        self._admitting_since = -_INF
        self._jitter = jitter
        self.configure(policy)

    def configure(self, policy: BreakerPolicy) -> None:
        """Take a reloaded policy's lengths, keeping the streak."""
        self._isolation_s = policy.isolation
        self.max_isolation_s = policy.max_isolation

    def next_isolation_s(self, now: float, rng: random.Random, after_admitting: bool) -> float:
        """How long the isolation starting at `now` lasts, a step longer than the last one;
        `after_admitting` (a trip, not a failed probe): the steps earned by the time spent
        admitting are forgiven first (rules in the class docstring)."""
        if after_admitting and self.streak:
            forgiven = (now - self._admitting_since) // self.max_isolation_s
            if forgiven > 0:
                self.streak -= int(min(forgiven, self.streak))
        self.streak += 1
        nominal = self._isolation_s * 2.0 ** min(self.streak - 1, _MAX_DOUBLINGS)
        duration = min(nominal, self.max_isolation_s)
        jitter = self._jitter
        if jitter:
            duration *= 1.0 + jitter * (2.0 * rng.random() - 1.0)
        return duration

    def readmitted(self, now: float) -> None:
        """Back to ADMITTING at `now` (a probe answered well, here or on another replica): a
        step off the streak, and the time spent admitting counts from now."""
        self.streak = max(0, self.streak - 1)
        self._admitting_since = now

    def forget(self) -> None:
        """An operator vouches for the instance: its next isolation is a first one."""
        self.streak = 0


class BreakerState:
    """One instance's breaker: the rules, exactly, are the module's ("The breaker's rules").
    The ISOLATED → PROBING change happens inside `try_admit`, which returns only a bool so that
    the hot path allocates nothing: the shell sees it as a True with `state == "PROBING"`.
    """

    __slots__ = (
        "_pool",
        "answered_at",
        "backoff",
        "changed_at",
        "counts",
        "early_probe",
        "instance",
        "isolated_until",
        "isolations",
        "lease_until",
        "probe_started_at",
        "spare_until",
        "state",
        "suppressed_isolations",
    )

    def __init__(
        self,
        policy: BreakerPolicy,
        instance: str = "",
        pool: PoolBreakers | None = None,
        jitter: float = JITTER,
    ) -> None:
        self.backoff = IsolationBackoff(policy, jitter)
        self.counts = FailureCounts(policy)
        self.instance = instance
        self.state: StateName = ADMITTING
        self.isolated_until = 0.0
        # Whether the isolation under way may end early for a probe (`try_admit(early=True)`):
        # one for failures the instance answered (errors, OOMs), not a silence, a refusal, a
        # failed health check, another replica's or an operator's decision.
        self.early_probe = False
        self.probe_started_at = 0.0
        # The isolation's end while a spare probe runs (`try_admit(spare=True)`), which its
        # failure goes back to; None: the probe under way, if any, is an ordinary one.
        self.spare_until: float | None = None
        # When the state last changed (monotonic), for the operator's view.
        self.changed_at = -_INF
        # Until when this replica may start a probe. `inf`: no one else to ask (a shared
        # decision store grants a moment at a time: "Shared decisions" above).
        self.lease_until = _INF
        self.isolations = 0
        self.suppressed_isolations = 0
        # When an attempt on it last ended well, in any state (answers while isolated are not
        # counted, but they show which isolated instance works: see PoolBreakers).
        self.answered_at = -_INF
        # The pool whose cap it asks before an automatic trip (None: no cap).
        self._pool = pool

    def reconfigure(self, policy: BreakerPolicy, pool: PoolBreakers | None) -> None:
        """Take a reloaded policy's settings (and the new pool, whose cap it asks), keeping the
        state: ISOLATED stays isolated until its `isolated_until`, the streak and counts stay.
        The window keeps its counts unless its length changed (then it starts empty)."""
        self._pool = pool
        self.counts.configure(policy)
        self.backoff.configure(policy)

    # -- the request path ---------------------------------------------------------------------

    def lease_probes(self, until: float) -> None:
        """Probes may start only before `until` (0: none now, the lease is another replica's
        or not asked for yet; `inf`: always, nobody to coordinate with)."""
        self.lease_until = until

    def try_admit(self, now: float, early: bool = False, spare: bool = False) -> bool:
        """May this instance take a new request at `now`? (Rules in the class docstring.)

        `early`: the pool's admitting instances are all full: it answered, so it is up, and a
        fault that made it answer errors (a burst, an OOM spell) is often over well before
        the isolation is, while its share queues on the others. `spare`: nothing in the pool
        admits and the request has a fallback pool if the probe fails: it costs that request a
        refused attempt at worst, and finds the instance back within a second of its return,
        where an isolation grown by failed probes would hold it out for minutes after."""
        state = self.state
        if state == ADMITTING:
            return True
        if state == ISOLATED:
            if now >= self.lease_until:
                return False
            ahead = now < self.isolated_until
            if ahead and not (
                ((early and self.early_probe) or (spare and not self.forced))
                and now - self.probe_started_at >= EARLY_PROBE_GAP_S
            ):
                return False
            self.spare_until = self.isolated_until if ahead and spare else None
            self.state = PROBING
            self.probe_started_at = now
            self.changed_at = now
            return True
        # PROBING: one probe at a time, unless the outstanding one looks lost.
        if now - self.probe_started_at > self.backoff.max_isolation_s:
            self.probe_started_at = now
            return True
        return False

    def record(
        self,
        now: float,
        failed: bool,
        timeout: bool,
        rng: random.Random,
        probe: bool = False,
    ) -> Transition | None:
        """Count one finished attempt; the Transition when it changes the state (or is refused).

        `failed`: the instance is to blame; `timeout`: that failure was a timeout (implies
        `failed`); `probe`: this attempt was the probe `try_admit` let through.
        """
        if not (failed or timeout):
            self.answered_at = now
        if self.state != ADMITTING:
            if probe and self.state == PROBING:
                return self._probe_result(now, failed or timeout, timeout, rng)
            return None
        trip = self.counts.count(now, failed, timeout)
        if trip is None:
            return None
        return self._trip(now, rng, trip)

    def release_probe(self, now: float) -> Transition | None:
        """The probe ended without a result (cancelled): back to ISOLATED, as it was.

        An ordinary probe's isolation had run out: the next `try_admit` sends a new probe. An
        early or spare one's goes on to its end, as when it fails: ended here, a cancelled
        early probe would have lifted the rest of the isolation, and the conditions early
        probes wait for (every instance admitting full, a second between two) with it.
        No-op (None) unless PROBING.
        """
        if self.state != PROBING:
            return None
        self.state = ISOLATED
        self.changed_at = now
        self.spare_until = None
        return Transition(self.instance, PROBING, ISOLATED, PROBE_RELEASED, self.isolated_until)

    # -- operator and out-of-band actions -------------------------------------------------

    def isolate(
        self,
        now: float,
        rng: random.Random,
        reason: str = "operator",
        forced: bool = True,
        capped: bool = True,
    ) -> Transition | None:
        """Isolate now. Forced (the operator): from any state, ignoring the pool's cap, with
        `isolated_until = inf` until `restore`; None if already so. Not forced (from outside
        the request path: a health check, a decision shared by another replica): an automatic
        trip (streak, backoff, jitter) from ADMITTING, within the pool's cap unless `capped`
        is False (the instance is known down, not suspected: see `PoolBreakers`); None from
        the other states.
        """
        if not forced:
            if self.state != ADMITTING:
                return None
            if not capped:
                return self._isolate(now, rng, Trip(reason), ADMITTING)
            return self._trip(now, rng, Trip(reason))
        if self.state == ISOLATED and self.isolated_until == _INF:
            return None
        state_from = self.state
        self._enter_isolation(now, _INF)
        return Transition(self.instance, state_from, ISOLATED, reason, _INF)

    def restore(self, now: float, reason: str = "operator") -> Transition | None:
        """Back to ADMITTING with the window, `consecutive_timeouts` and `streak` cleared.

        From ADMITTING it only clears those (None): the operator vouches for the instance.
        """
        self.counts.clear()
        self.backoff.forget()
        if self.state == ADMITTING:
            return None
        state_from = self.state
        self._readmit(now)
        return Transition(self.instance, state_from, ADMITTING, reason)

    # -- decisions shared by other replicas ---------------------------------------------------

    def adopt(self, now: float, until: float, reason: str) -> Transition | None:
        """Another replica isolated this instance until `until` (already converted to this
        clock and bounded by how long the decision may be trusted).

        From ADMITTING: a trip capped by the pool's guard, ending at `until` (the streak is
        left alone: it measures this replica's own experience of the instance); refused, it
        returns a `suppressed` Transition and counts it. From ISOLATED (not forced): the
        isolation is extended to `until` if that is later (None). PROBING: our probe's result
        will decide (None). `until <= now`: nothing to adopt (None).
        """
        if until <= now:
            return None
        state = self.state
        if state == ISOLATED:
            if until > self.isolated_until:
                self.isolated_until = until
            return None
        if state != ADMITTING:
            return None
        pool = self._pool
        if pool is not None and not pool.may_isolate(now, self.instance):
            return self._suppressed(reason)
        self._enter_isolation(now, until)
        return Transition(self.instance, ADMITTING, ISOLATED, reason, until)

    def back_up(self, now: float) -> bool:
        """Its health checks pass again after they failed: an isolation under way (not an
        operator's) ends now, for a probe. The failures behind it were most likely its going
        down (refused connections, streams cut by a crash), which the checks have seen end;
        held out for the rest of an isolation (5 s or more, longer at each trip), a restarted
        instance idled while its peers carried its share. The probe, a real request, still
        says whether it answers well. Whether it was isolated."""
        if self.state != ISOLATED or self.forced:
            return False
        self.isolated_until = min(self.isolated_until, now)
        return True

    def lift(self, now: float, reason: str, operator: bool = False) -> Transition | None:
        """Another replica found the instance good again (its probe succeeded, or an operator
        restored it there): back to ADMITTING as after a successful probe of our own.

        An operator's isolation here is lifted only by an operator's restore (`operator`),
        which also clears the streak. None when already ADMITTING or not lifted.
        """
        if self.state == ADMITTING or (self.forced and not operator):
            return None
        state_from = self.state
        self.counts.clear()
        if operator:
            self.backoff.forget()
        self._readmit(now)
        return Transition(self.instance, state_from, ADMITTING, reason)

    # -- introspection (for /admin/state and metrics) ----------------------------------------

    def failure_share(self, now: float) -> float:
        """The share of its attempts it fails now (`FailureCounts.failure_share`)."""
        return self.counts.failure_share(now)

    def remaining_s(self, now: float) -> float:
        """Seconds of isolation left: `max(0, isolated_until - now)` when ISOLATED (inf when
        forced), else 0."""
        if self.state != ISOLATED:
            return 0.0
        return max(0.0, self.isolated_until - now)

    @property
    def forced(self) -> bool:
        """Whether an operator's isolation holds it (only `restore` ends it)."""
        return self.state == ISOLATED and self.isolated_until == _INF

    def __repr__(self) -> str:
        return (
            f"BreakerState({self.instance!r}, {self.state}, streak={self.backoff.streak}, "
            f"until={self.isolated_until:.6g})"
        )

    # -- internals ----------------------------------------------------------------------------

    def _trip(self, now: float, rng: random.Random, trip: Trip) -> Transition:
        pool = self._pool
        if pool is not None and not pool.may_isolate(now, self.instance):
            if trip.in_a_row:
                displaced = pool.make_room(now, self)
                if displaced is not None and pool.may_isolate(now, self.instance):
                    isolated = self._isolate(now, rng, trip, ADMITTING)
                    return replace(isolated, displaced=displaced)
            # Counters stay: the next failure asks again, and isolates once there is room.
            return self._suppressed(trip.reason)
        return self._isolate(now, rng, trip, ADMITTING)

    def _suppressed(self, reason: str) -> Transition:
        """A trip the pool's cap refused: nothing changes, but the shell logs and counts it."""
        self.suppressed_isolations += 1
        return Transition(
            self.instance, ADMITTING, ADMITTING, f"{reason} (suppressed: cap)", None, True
        )

    def _isolate(
        self, now: float, rng: random.Random, trip: Trip, state_from: StateName
    ) -> Transition:
        until = now + self.backoff.next_isolation_s(now, rng, state_from == ADMITTING)
        self._enter_isolation(now, until, trip.answered)
        reason = trip.reason
        return Transition(self.instance, state_from, ISOLATED, reason, until, silent=trip.silent)

    def _enter_isolation(self, now: float, until: float, early_probe: bool = False) -> None:
        self.spare_until = None
        self.state = ISOLATED
        self.early_probe = early_probe
        self.changed_at = now
        self.isolated_until = until
        self.isolations += 1

    def _readmit(self, now: float) -> None:
        """Back to ADMITTING for a decision taken elsewhere (an operator, another replica): an
        isolation under way ends now."""
        self.backoff.readmitted(now)
        self.state = ADMITTING
        self.changed_at = now
        self.isolated_until = min(self.isolated_until, now)

    def _probe_result(
        self, now: float, failed: bool, timeout: bool, rng: random.Random
    ) -> Transition | None:
        spare_until, self.spare_until = self.spare_until, None
        if failed and spare_until is not None:
            # A spare probe asked ahead of the isolation's end: it found the instance still
            # out, which the isolation under way already says. It goes on as it was, neither
            # longer nor counted again: spare probes come every second, and each doubling
            # the isolation would hold the instance out for minutes once it is back. Nothing
            # to tell either (no log line, no shared decision a second).
            self.state = ISOLATED
            self.changed_at = now
            return None
        if failed:
            reason = "probe timed out" if timeout else "probe failed"
            trip = Trip(reason, silent=timeout, answered=not timeout)
            return self._isolate(now, rng, trip, PROBING)
        self.counts.clear()
        self.backoff.readmitted(now)
        self.state = ADMITTING
        self.changed_at = now
        return Transition(self.instance, PROBING, ADMITTING, "probe succeeded")


class PoolBreakers:
    """A pool's breakers and its guard rail, Envoy's ejection cap, counted over availability.

    At most `cap = isolation_cap(policy.max_isolated_fraction, n)` of the pool's n instances are
    out at once, whatever put them out: an isolation (ISOLATED or PROBING, operator isolations
    included) or anything else the shell reports through `unavailable(now, instance, back)`,
    the number of other instances whose breakers admit (or that is `back`, one that would be
    let back) but that cannot take traffic (unhealthy, paused by a Retry-After, saturated).
    Each breaker asks `may_isolate(now, instance)` before an automatic trip: `isolated +
    unavailable < cap`. So with one instance dead, a second one failing a third of its
    requests is not isolated as well: the pool keeps what still works.
    A refused trip is not an error: the breaker stays ADMITTING, its `suppressed_isolations`
    rises and `record` returns a `suppressed` Transition. Operator isolations ignore the cap
    (but count toward it).

    **The worse one goes out.** The first instance to trip takes the room, and it need not be
    the worst: with one instance 50x slow and another frozen, the slow one may run out of time
    first and the frozen one is then kept. So a trip on consecutive failures or timeouts that
    the cap refuses may take the place of an automatic isolation (`make_room`): of the ISOLATED
    instances (not an operator's, not one being probed) that answered well later than the
    tripping instance last did (`answered_at`, before their isolation or since, through a retry
    or a panic request sent there), the one that answered last is let back (`lift`, its
    Transition in `displaced`) and the tripping one isolated, if the pool is then within its
    cap (an instance let back that cannot take traffic for another reason, say unhealthy, would
    still count: then nothing changes). Of two bad instances, the one out is the one that has
    answered nothing for longer. An error-rate trip never takes a place: such an instance still
    answers between failures.

    Counting the out instances walks the pool: trips are rare, and a count kept by hand could
    drift from the states it mirrors.
    """

    __slots__ = ("breakers", "cap", "unavailable")

    def __init__(
        self,
        policy: BreakerPolicy,
        instances: Sequence[str],
        jitter: float = JITTER,
        existing: Mapping[str, BreakerState] | None = None,
        unavailable: Callable[[float, str, str], int] | None = None,
    ) -> None:
        """`existing`: breakers to keep (a policy reload), by instance name; they take the
        new policy's settings and this pool's guard. `unavailable(now, name, back)`: how many
        instances other than `name` that admit, or that are `back` ("": none), cannot take
        traffic for other reasons (None: none ever)."""
        if len(set(instances)) != len(instances):
            raise ValueError("instance names must be unique within a pool")
        self.cap = isolation_cap(policy.max_isolated_fraction, len(instances))
        self.unavailable = unavailable
        self.breakers: dict[str, BreakerState] = {}
        for name in instances:
            kept = existing.get(name) if existing is not None else None
            if kept is None:
                self.breakers[name] = BreakerState(policy, name, self, jitter)
            else:
                kept.reconfigure(policy, self)
                self.breakers[name] = kept

    def __getitem__(self, instance: str) -> BreakerState:
        return self.breakers[instance]

    def __iter__(self) -> Iterator[BreakerState]:
        return iter(self.breakers.values())

    def __len__(self) -> int:
        return len(self.breakers)

    def isolated_count(self) -> int:
        """How many instances are out (ISOLATED or PROBING)."""
        return sum(1 for breaker in self.breakers.values() if breaker.state != ADMITTING)

    def may_isolate(self, now: float, instance: str = "", back: str = "") -> bool:
        """Whether `instance` may be isolated at `now`, on top of what is out already:
        `isolated_count() + unavailable(now, instance, back) < cap`; with the isolated `back`
        counted as admitting, when it would be let back (`make_room`)."""
        out = self.isolated_count() - (1 if back else 0)
        if out >= self.cap:
            return False
        unavailable = self.unavailable
        return unavailable is None or out + unavailable(now, instance, back) < self.cap

    def make_room(self, now: float, tripping: BreakerState) -> Transition | None:
        """Let back the isolated instance that `tripping` is worse than (see the class
        docstring), if releasing it makes room for `tripping`; its lift, or None."""
        best: BreakerState | None = None
        for breaker in self.breakers.values():
            if (
                breaker is tripping
                or breaker.state != ISOLATED
                or breaker.forced
                or breaker.answered_at <= tripping.answered_at
            ):
                continue
            if best is None or breaker.answered_at > best.answered_at:
                best = breaker
        if best is None:
            return None
        # Would the pool have room with `best` back? Counted as admitting: unavailable for
        # another reason (unhealthy, say), it would be out all the same.
        if not self.may_isolate(now, tripping.instance, back=best.instance):
            return None
        return best.lift(now, f"let back: {tripping.instance} is worse")

    @property
    def suppressed_isolations(self) -> int:
        """Trips refused by the cap, over the pool's instances."""
        return sum(breaker.suppressed_isolations for breaker in self.breakers.values())
