"""The decision store's interface, and what every store does with a transition: log it."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import TYPE_CHECKING, Any, Protocol

from gateway.core.breaker import BreakerState, Transition
from gateway.telemetry.logs import LogThrottle
from gateway.upstream.registry import Registry

if TYPE_CHECKING:
    from gateway.upstream.registry import Registry

log = logging.getLogger("gateway.breaker")

Key = tuple[str, str]  # (pool, instance)


def instance_keys(
    registry: Registry, prefix: str, kind: str
) -> tuple[dict[Key, BreakerState], dict[Key, str]]:
    """Every instance's breaker and its Redis key `{prefix}:{kind}:{pool}:{instance}`."""
    breakers: dict[Key, BreakerState] = {}
    keys: dict[Key, str] = {}
    for pool in registry.pools.values():
        for inst in pool.instances:
            key = (pool.name, inst.name)
            breakers[key] = inst.breaker
            keys[key] = f"{prefix}:{kind}:{pool.name}:{inst.name}"
    return breakers, keys


class DecisionStore(Protocol):
    def record(self, pool: str, transition: Transition, operator: bool = False) -> None:
        """One of this replica's own breaker transitions (`operator`: made through the admin
        API). Called on the request path: must not wait or do I/O."""

    def decided_by(self, pool: str, instance: str) -> str | None:
        """The other replica whose isolation holds this instance here, if one does."""

    def status(self) -> dict[str, Any]:
        """The `shared_state` section of /admin/state."""

    def follow(self, registry: Registry) -> None:
        """The registry after a policy reload (instances added or dropped). Synchronous."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


# A trip the isolation cap refuses repeats on every failure while the cap holds (hundreds a
# second under load): one line per instance per interval, with how many were not logged.
SUPPRESSED_LOG_INTERVAL_S = 10.0


class TransitionLog:
    """Writes breaker transitions to the log, a decision store's own (so is its throttle)."""

    def __init__(self) -> None:
        self._suppressed = LogThrottle(SUPPRESSED_LOG_INTERVAL_S)  # by (pool, instance)

    def write(self, pool: str, transition: Transition, now: float | None = None) -> None:
        _write(pool, transition, now, self._suppressed)


def _write(pool: str, transition: Transition, now: float | None, suppressed: LogThrottle) -> None:
    fields: dict[str, object] = {
        "pool": pool,
        "instance": transition.instance,
        "from": transition.state_from,
        "to": transition.to,
        "reason": transition.reason,
        "until_s": transition.until,
        "suppressed": transition.suppressed,
    }
    if transition.suppressed:
        skipped = suppressed.admit((pool, transition.instance), now)
        if skipped is None:
            return
        fields["repeats_not_logged"] = skipped
    log.warning("breaker transition", extra={"fields": fields})


def replica_id() -> str:
    """This process's name in shared decisions: `GATEWAY_REPLICA_ID`, else host/pid/random (a
    restarted process is a new replica: it does not own what its predecessor decided)."""
    configured = os.environ.get("GATEWAY_REPLICA_ID", "").strip()
    if configured:
        return configured
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"
