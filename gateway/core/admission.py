"""Admission queues in front of a pool: three classes, weighted fair service, bounded, shed early.

Classes, most to least urgent: `interactive` (burst-sensitive: it should queue for tens of
milliseconds at most), `standard` (steady traffic) and `batch` (backlog: accepts overflow, first
to be shed).

**Weights.** Each class has a base weight (more for the urgent ones) times its burst factor
`max(0.3, 1 - 0.7 * qps / peak_qps)`: `qps` its arrivals over the last `window_s` seconds,
`peak_qps` the highest such rate seen (decaying by half every `peak_half_life_s`). A class in
the middle of a burst is served at no more than 30 % of its usual weight, so its burst cannot
starve the others; a quiet class keeps its whole weight.

**Service order.** Stride scheduling between the classes that have requests waiting: each has a
`pass`; the class with the lowest pass is served and its pass grows by `1 / weight`. A class
that was empty restarts at the lowest active pass (no credit banked while idle). Within a
class, tenants share the service by their weights the same way, FIFO within a tenant
(`gateway.core.fair_queue`). Over any stretch where several classes wait, each gets a share of
the service in proportion to its weight. A class whose first request cannot be placed yet (no
instance has room in its KV-token budget for it) is passed over for the next class in that
order if that class is more urgent: small interactive requests go past a large batch one, but
batch requests never take the room a large interactive one waits for.

**Bounds and shedding** (`offer`), in order:
1. the expected wait, `(ahead + 1) / (service_rate * share)` (`ahead`: the tenant's own
   requests waiting in the class; `share`: the class's share times the tenant's share within
   it), exceeds the class's `queue_timeout`: refused at once (better a fast 429 than a slow
   one), when the service rate is known;
2. the class's own queue is full (`max_queue[class]`): the tenant with the most requests
   waiting gives up its newest one, when it has more waiting than this tenant would; else
   refused;
3. the pool's total (`max_total`) is full: the newest request of the least urgent class below
   this one (of its tenant with the most waiting) is evicted to make room (batch before
   standard), else this one is refused.
`pop` serves the next request; entries whose queue timeout passed are returned by `expire` (and
skipped by `pop`): the shell answers them 429, so everything admitted is eventually answered.
Each refusal, eviction and expiry counts in `shed`; one the shell sends on instead of answering
429 (`sent_anyway`) moves to `overflow`, where requests it sends past the room without queueing
them (`sent_over`) count too.

Pure: `now` is an argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from gateway.core.fair_queue import Entry, FairQueue
from gateway.core.fair_queue import Priority as Priority

CLASSES: Final[tuple[Priority, ...]] = ("interactive", "standard", "batch")
BURST_FLOOR: Final = 0.3
BURST_SLOPE: Final = 0.7

T = TypeVar("T")


def burst_weight(qps: float, peak_qps: float) -> float:
    """`max(0.3, 1 - 0.7 * qps / peak_qps)`; 1 while no peak is known."""
    if peak_qps <= 0:
        return 1.0
    return max(BURST_FLOOR, 1.0 - BURST_SLOPE * qps / peak_qps)


class ArrivalRate:
    """Arrivals per second over the last `window_s` seconds (one-second buckets), and the peak
    of that rate, decaying by half every `half_life_s`."""

    __slots__ = ("_buckets", "_half_life_s", "_last", "_peak", "_peak_at")

    def __init__(self, window_s: int = 10, half_life_s: float = 300.0) -> None:
        if window_s < 1:
            raise ValueError("window_s must be at least 1")
        self._buckets = [0] * window_s
        self._last = -1  # the second the newest bucket counts
        self._half_life_s = half_life_s
        self._peak = 0.0
        self._peak_at = 0.0

    def _advance(self, now: float) -> int:
        second = math.floor(now)
        buckets = self._buckets
        if second != self._last:
            gap = second - self._last
            if self._last < 0 or gap >= len(buckets):
                buckets[:] = [0] * len(buckets)
            else:
                for s in range(self._last + 1, second + 1):
                    buckets[s % len(buckets)] = 0
            self._last = second
        return second % len(buckets)

    def arrive(self, now: float) -> None:
        self._buckets[self._advance(now)] += 1
        rate = self.qps(now)
        if rate >= self.peak(now):
            self._peak, self._peak_at = rate, now

    def qps(self, now: float) -> float:
        self._advance(now)
        return sum(self._buckets) / len(self._buckets)

    def peak(self, now: float) -> float:
        elapsed = max(0.0, now - self._peak_at)
        return float(self._peak * 0.5 ** (elapsed / self._half_life_s))


@dataclass(slots=True)
class Offer(Generic[T]):
    """What `offer` did: queued or not (`reason` says why not), and whom it evicted."""

    queued: bool
    reason: str | None = None
    evicted: list[Entry[T]] = field(default_factory=list)


class AdmissionQueues(Generic[T]):
    """A pool's three class queues (rules in the module docstring)."""

    def __init__(
        self,
        base_weights: Mapping[Priority, float],
        max_queue: Mapping[Priority, int],
        queue_timeout_s: Mapping[Priority, float],
        max_total: int,
        window_s: int = 10,
        peak_half_life_s: float = 300.0,
        tenant_weight: Callable[[str], float] = lambda tenant: 1.0,
    ) -> None:
        self.reconfigure(base_weights, max_queue, queue_timeout_s, max_total)
        self._queues: dict[Priority, FairQueue[T]] = {
            name: FairQueue(tenant_weight) for name in CLASSES
        }
        self._pass: dict[Priority, float] = dict.fromkeys(CLASSES, 0.0)
        self._rates = {name: ArrivalRate(window_s, peak_half_life_s) for name in CLASSES}
        self.shed: dict[Priority, int] = dict.fromkeys(CLASSES, 0)
        self.overflow: dict[Priority, int] = dict.fromkeys(CLASSES, 0)

    def set_tenant_weight(self, tenant_weight: Callable[[str], float]) -> None:
        """New tenant weights (a policy reload): they apply from each tenant's next service."""
        for queue in self._queues.values():
            queue.weight_of = tenant_weight

    def reconfigure(
        self,
        base_weights: Mapping[Priority, float],
        max_queue: Mapping[Priority, int],
        queue_timeout_s: Mapping[Priority, float],
        max_total: int,
    ) -> None:
        """New settings (a policy reload). Waiting entries keep their place and the deadline
        they were given; a bound lowered below what waits applies to new arrivals only."""
        for name in CLASSES:
            if base_weights[name] <= 0 or max_queue[name] < 0 or queue_timeout_s[name] <= 0:
                raise ValueError(f"class {name}: weight and timeout > 0, max_queue >= 0")
        self._base = dict(base_weights)
        self._max_queue = dict(max_queue)
        self._timeout = dict(queue_timeout_s)
        self._max_total = max_total

    # -- introspection -------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def length(self, priority: Priority) -> int:
        return len(self._queues[priority])

    def tenants(self, priority: Priority) -> dict[str, int]:
        """The requests each tenant has waiting in the class."""
        return self._queues[priority].tenants()

    def weights(self, now: float) -> dict[Priority, float]:
        rates = self._rates
        return {
            name: self._base[name] * burst_weight(rates[name].qps(now), rates[name].peak(now))
            for name in CLASSES
        }

    def share(self, priority: Priority, now: float) -> float:
        """The class's share of the service if it waited now alongside the ones waiting."""
        weights = self.weights(now)
        active = [n for n in CLASSES if self._queues[n] or n == priority]
        return weights[priority] / sum(weights[n] for n in active)

    # -- arrivals --------------------------------------------------------------------------

    def arrived(self, priority: Priority, now: float) -> None:
        """Count an arrival of the class (queued or not: the burst is in the arrivals)."""
        self._rates[priority].arrive(now)

    def offer(
        self,
        item: T,
        priority: Priority,
        now: float,
        service_rate: float = 0.0,
        tenant: str = "",
    ) -> Offer[T]:
        """Queue `item` (counted by `arrived` already) for `tenant`, or say why not."""
        queue = self._queues[priority]
        timeout = self._timeout[priority]
        if service_rate > 0:
            share = self.share(priority, now) * queue.share(tenant)
            expected = (queue.waiting(tenant) + 1) / (service_rate * share)
            if expected > timeout:
                return self._refuse(
                    priority, f"the {priority} queue would take {expected:.2f}s (> {timeout:g}s)"
                )
        evicted: list[Entry[T]] = []
        if len(queue) >= self._max_queue[priority]:
            # Full: the tenant with the most waiting gives up its newest, unless it is this one.
            if queue.largest() <= queue.waiting(tenant) + 1:
                return self._refuse(priority, f"the {priority} queue is full")
            victim = queue.newest_of_largest()
            assert victim is not None
            self.shed[priority] += 1
            evicted.append(victim)
        if not evicted and len(self) >= self._max_total:  # (a fair drop made room already)
            victim = self._evict_below(priority)
            if victim is None:
                return self._refuse(priority, "the pool's queues are full")
            evicted.append(victim)
        if not queue:
            self._pass[priority] = self._lowest_active_pass(default=self._pass[priority])
        queue.append(Entry(item, priority, now, now + timeout, tenant))
        return Offer(True, None, evicted)

    def sent_anyway(self, priority: Priority) -> None:
        """A request refused, evicted or expired was sent on instead of being answered 429:
        counted as overflow, not shed."""
        self.shed[priority] -= 1
        self.overflow[priority] += 1

    def sent_over(self, priority: Priority) -> None:
        """A request was sent on past the pool's room without waiting: counted as overflow."""
        self.overflow[priority] += 1

    def _refuse(self, priority: Priority, reason: str) -> Offer[T]:
        self.shed[priority] += 1
        return Offer(False, reason)

    def _evict_below(self, priority: Priority) -> Entry[T] | None:
        for name in reversed(CLASSES):
            if name == priority:
                return None
            victim = self._queues[name].newest_of_largest()  # the newest: it waited least
            if victim is not None:
                self.shed[name] += 1
                return victim
        return None

    def _lowest_active_pass(self, default: float) -> float:
        active = [self._pass[n] for n in CLASSES if self._queues[n]]
        return max(default, min(active)) if active else default

    # -- service ---------------------------------------------------------------------------

    def expire(self, now: float) -> list[Entry[T]]:
        """Remove and return every entry whose queue timeout has passed (answer them 429)."""
        expired: list[Entry[T]] = []
        for name in CLASSES:
            gone = self._queues[name].expire(now)
            self.shed[name] += len(gone)
            expired.extend(gone)
        return expired

    def pop(self, now: float, fits: Callable[[T], bool] | None = None) -> Entry[T] | None:
        """The next entry to serve (expired ones are left for `expire`), or None.

        With `fits`, a class whose first entry does not fit now (say, too many KV-cache tokens)
        keeps it at its head and is passed over, but only for more urgent classes: a less
        urgent one must not take the room that entry waits for.
        """
        heads = {name: self._queues[name].head() for name in CLASSES}
        waiting = [name for name, head in heads.items() if head and head.expires_at > now]
        waiting.sort(key=self._pass.__getitem__)  # stable: ties go to the more urgent class
        blocked = len(CLASSES)  # the most urgent class whose head does not fit, by rank
        for name in waiting:
            rank = CLASSES.index(name)
            if rank > blocked:
                continue
            head = heads[name]
            assert head is not None
            if fits is None or fits(head.item):
                self._pass[name] += 1.0 / self.weights(now)[name]
                return self._queues[name].popleft()
            blocked = rank
        return None

    def next_expiry(self) -> float | None:
        """When the oldest waiting entry times out (for the shell's timer), or None."""
        heads = [q.next_expiry() for q in self._queues.values()]
        return min((h for h in heads if h is not None), default=None)
