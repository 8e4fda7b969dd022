"""One admission class's waiting requests, shared fairly between tenants.

A tenant is whoever the shell says sent the request (an API key's digest, or a header the
policy names); each has its own FIFO. Tenants are served by stride scheduling over their
weights, as the classes are: each waiting tenant has a `pass`, the one with the lowest is
served (ties: the one that started waiting first) and its pass grows by `1 / weight`. So over
any stretch where several tenants wait, each is served in proportion to its weight, whatever
the number of requests it sent: one tenant's burst waits behind its own requests, not in front
of everyone else's.

**No credit, no starvation.** A tenant that starts waiting starts at the lowest pass among
those waiting, so it banks no credit while idle; but not below the pass its own last request
left it at, so a tenant that keeps one request waiting at a time (served, back at once) cannot
come back ahead of a tenant with a backlog each time and starve it: it waits its turn like any
other. **Bounded state.** A tenant's queue and pass exist only while it has requests waiting;
the pass it leaves with is kept only while it is above the lowest waiting pass (below, it
changes nothing), and everything kept is dropped when nothing waits.

**Fair drop.** When the class is full, `newest_of_largest` gives up the newest request of the
tenant with the most waiting, so a tenant that floods the queue loses its own requests first.

Pure: `now` is an argument; nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

Priority = Literal["interactive", "standard", "batch"]
T = TypeVar("T")


@dataclass(slots=True)
class Entry(Generic[T]):
    item: T
    priority: Priority
    enqueued_at: float
    expires_at: float
    tenant: str = ""


class FairQueue(Generic[T]):
    """Per-tenant FIFOs served by weight (rules in the module docstring)."""

    __slots__ = ("_count", "_left", "_pass", "_tenants", "weight_of")

    def __init__(self, weight_of: Callable[[str], float]) -> None:
        self.weight_of = weight_of  # a tenant's weight (> 0)
        self._tenants: dict[str, deque[Entry[T]]] = {}
        self._pass: dict[str, float] = {}
        # The pass each tenant that stopped waiting left with, while it is above the lowest
        # waiting pass (`_prune`).
        self._left: dict[str, float] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def waiting(self, tenant: str) -> int:
        queue = self._tenants.get(tenant)
        return len(queue) if queue is not None else 0

    def tenants(self) -> dict[str, int]:
        """How many requests each waiting tenant has waiting."""
        return {tenant: len(queue) for tenant, queue in self._tenants.items()}

    def share(self, tenant: str) -> float:
        """The tenant's share of the class's service if it waited now with those waiting."""
        weight = self.weight_of(tenant)
        others = sum(self.weight_of(t) for t in self._tenants if t != tenant)
        return weight / (weight + others)

    def append(self, entry: Entry[T]) -> None:
        queue = self._tenants.get(entry.tenant)
        if queue is None:
            lowest = min(self._pass.values()) if self._pass else 0.0
            left = self._left.pop(entry.tenant, lowest)
            queue = self._tenants[entry.tenant] = deque()
            self._pass[entry.tenant] = max(lowest, left)
        queue.append(entry)
        self._count += 1

    def head(self) -> Entry[T] | None:
        """The entry `popleft` would serve: the head of the tenant with the lowest pass."""
        tenant = self._next_tenant()
        return None if tenant is None else self._tenants[tenant][0]

    def popleft(self) -> Entry[T]:
        """Serve the head (IndexError when nothing waits)."""
        tenant = self._next_tenant()
        if tenant is None:
            raise IndexError("nothing waits")
        self._pass[tenant] += 1.0 / self.weight_of(tenant)
        return self._take(tenant, newest=False)

    def newest_of_largest(self) -> Entry[T] | None:
        """Give up the newest request of the tenant with the most waiting (None if none)."""
        if not self._tenants:
            return None
        tenant = max(self._tenants, key=lambda t: len(self._tenants[t]))
        return self._take(tenant, newest=True)

    def largest(self) -> int:
        """The most requests any one tenant has waiting."""
        return max((len(q) for q in self._tenants.values()), default=0)

    def expire(self, now: float) -> list[Entry[T]]:
        """Remove and return every entry whose deadline is `now` or before."""
        expired: list[Entry[T]] = []
        for tenant in list(self._tenants):
            queue = self._tenants[tenant]
            while queue and queue[0].expires_at <= now:
                expired.append(self._take(tenant, newest=False))
        return expired

    def next_expiry(self) -> float | None:
        heads = [queue[0].expires_at for queue in self._tenants.values()]
        return min(heads) if heads else None

    def __iter__(self) -> Iterator[Entry[T]]:
        for queue in self._tenants.values():
            yield from queue

    def _next_tenant(self) -> str | None:
        passes = self._pass
        return min(passes, key=passes.__getitem__) if passes else None

    def _take(self, tenant: str, newest: bool) -> Entry[T]:
        queue = self._tenants[tenant]
        entry = queue.pop() if newest else queue.popleft()
        self._count -= 1
        if not queue:  # it stops waiting: its pass is kept while it can matter
            del self._tenants[tenant]
            self._left[tenant] = self._pass.pop(tenant)
            self._prune()
        return entry

    def _prune(self) -> None:
        """Forget the passes that cannot matter any more: at or below the lowest waiting pass
        (a tenant coming back starts there anyway), or all of them when nothing waits."""
        if not self._pass:
            self._left.clear()
            return
        lowest = min(self._pass.values())
        if any(p <= lowest for p in self._left.values()):
            self._left = {t: p for t, p in self._left.items() if p > lowest}
