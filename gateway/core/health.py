"""What active health checks conclude about an instance, from pass/fail results and `now`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HealthChange:
    healthy: bool
    reason: str


class HealthState:
    """Healthy after `healthy_threshold` passes in a row, unhealthy after `unhealthy_threshold`
    failures in a row. An instance starts *unknown* and takes no traffic until its first
    verdict is healthy: a vLLM pod loading a model for minutes must get nothing.

    An instance that refuses a request's connection is unhealthy at once (`refused`): nothing
    listens on its port, so the next check would say the same, and waiting for the threshold
    would keep a dead instance in rotation. Its checks bring it back as from any other
    unhealthy verdict.

    `first_seen` / `first_healthy` give the cold start (time from first seen to first healthy);
    `healthy_since` tells a return (`back`) from a first pass.
    """

    __slots__ = (
        "_fails",
        "_healthy_threshold",
        "_passes",
        "_unhealthy_threshold",
        "answered",
        "first_healthy",
        "first_seen",
        "healthy",
        "healthy_since",
        "last_reason",
    )

    def __init__(self, now: float, healthy_threshold: int, unhealthy_threshold: int) -> None:
        self.healthy: bool | None = None  # None: not checked yet
        self.first_seen = now
        self.first_healthy: float | None = None
        self.healthy_since: float | None = None
        self.last_reason = "not checked yet"
        # Whether the last check got an HTTP answer at all (any status). An instance that
        # answers, even badly, may still serve when nothing better is left (panic routing);
        # one that refuses connections or says nothing is down.
        self.answered = False
        self._passes = 0
        self._fails = 0
        self._healthy_threshold = healthy_threshold
        self._unhealthy_threshold = unhealthy_threshold

    @classmethod
    def assumed_healthy(cls, now: float) -> HealthState:
        """For a pool without health checks: routable from the start."""
        state = cls(now, 1, 1)
        state.healthy = True
        state.answered = True
        state.first_healthy = state.healthy_since = now
        state.last_reason = "health checks disabled"
        return state

    @property
    def back(self) -> bool:
        """Healthy again after an unhealthy spell, not for the first time (a new instance)."""
        first, since = self.first_healthy, self.healthy_since
        return first is not None and since is not None and first < since

    def set_thresholds(self, healthy_threshold: int, unhealthy_threshold: int) -> None:
        """A reloaded policy's thresholds; the verdict and the current runs are kept."""
        self._healthy_threshold = healthy_threshold
        self._unhealthy_threshold = unhealthy_threshold

    @property
    def in_doubt(self) -> bool:
        """Whether the last checks disagree with the verdict without having overturned it
        yet (a healthy instance failed a check, an unhealthy one passed one): the next check
        should come soon (HAProxy's `fastinter`)."""
        if self.healthy is True:
            return self._fails > 0
        return self._passes > 0

    @property
    def watched(self) -> bool:
        """Whether its next check should come soon (`fast_interval`): the verdict is in doubt,
        or it is down with nothing answering its checks (a refused port, a silence): a
        restarted process listens again within seconds, and found at the next regular round
        it would idle for up to an interval while its peers carry its share (HAProxy's
        `downinter` can be set to the same end)."""
        return self.in_doubt or (self.healthy is False and not self.answered)

    @property
    def cold_start_s(self) -> float | None:
        return None if self.first_healthy is None else self.first_healthy - self.first_seen

    def record(
        self,
        now: float,
        passed: bool,
        reason: str,
        answered: bool | None = None,
    ) -> HealthChange | None:
        """Fold one check result in; returns the change of verdict, if any.

        `answered`: the check got an HTTP answer (default: `passed`)."""
        self.last_reason = reason
        self.answered = passed if answered is None else answered
        if passed:
            self._passes += 1
            self._fails = 0
            if self.healthy is not True and self._passes >= self._healthy_threshold:
                self.healthy = True
                self.healthy_since = now
                if self.first_healthy is None:
                    self.first_healthy = now
                return HealthChange(True, reason)
            return None
        self._fails += 1
        self._passes = 0
        if self.healthy is True and self._fails >= self._unhealthy_threshold:
            self.healthy = False
            self.healthy_since = None
            return HealthChange(False, reason)
        if self.healthy is None and self._fails >= self._unhealthy_threshold:
            self.healthy = False  # known bad rather than unknown: same routing, clearer state
            return HealthChange(False, reason)
        return None

    def refused(self, reason: str) -> HealthChange | None:
        """A request's connection to it was refused: unhealthy now, whatever the threshold
        (the change, or None when it was not healthy). The run of passes starts again."""
        self.last_reason = reason
        self.answered = False
        self._passes = 0
        if self.healthy is not True:
            return None
        self._fails = max(self._fails, self._unhealthy_threshold)
        self.healthy = False
        self.healthy_since = None
        return HealthChange(False, reason)
