"""The in-process store: decisions are logged and stay in this replica."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.cluster.store import TransitionLog
from gateway.core.breaker import Transition

if TYPE_CHECKING:
    from gateway.upstream.registry import Registry


class LocalDecisions:
    def __init__(self) -> None:
        self._log = TransitionLog()

    def record(self, pool: str, transition: Transition, operator: bool = False) -> None:
        self._log.write(pool, transition)

    def decided_by(self, pool: str, instance: str) -> str | None:
        return None

    def status(self) -> dict[str, Any]:
        return {"configured": False, "connected": False}

    def follow(self, registry: Registry) -> None:
        return None

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None
