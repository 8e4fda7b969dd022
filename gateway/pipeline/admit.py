"""The admission layer: requests wait in their class's queue until the pool has room.

Outermost layer, for pools with an `admission` section. The pool's room is the sum of the
concurrency limits of its instances that take traffic (healthy, ADMITTING); a request holds one
slot from admission to the end of its answer (a stream's last byte), retries included (one sent
past a learned limit holds none; below). A request arriving while there is room and nobody waits
goes straight on; otherwise it waits in its class's queue (`gateway.core.admission`: burst-aware
weights, FIFO within a class) or is shed at once with 429 + Retry-After. When a slot frees, the
next request by weight is let through; one whose queue timeout passes is answered 429. A pool
with no instance taking traffic is not queued for: the pick layer answers 503 at once, as
without admission.

**A guess holds back only a flood, or an engine that refuses work.** Where an instance's room
is only the adaptive limiter's estimate (its engine exports no load gauges, the policy fixes no
limit, and no token budget or saturation holds it), the limit holds requests back only while
requests flood the pool: from when they arrive at more than `FLOOD_RATIO` times the fastest the
pool has been seen to complete them until they arrive at no more than `FLOOD_END_RATIO` times
that; and while such an engine refuses requests for load (`Limiter.refused_lately`: out of
memory, 429, 503, 529), which it says before two seconds of arrivals can show a flood. Then the
requests sent past the limits before count against them (`_over_held`) until they finish.
Otherwise a request that finds the queues empty goes on past that room at once, and one that would
be answered 429 (refused, evicted, or out of queue time) is sent on instead: each to a backend whose
own queue takes it as it would without the gateway. Those still queued when a flood ends keep their
places and go as slots free or at their queue time (a backlog sent on at once would only wait in the
engines' queues instead, where later interactive requests would wait behind it). Requests sent on
hold none of the room's slots (`Slot.over`, counted in `over`), so an instance whose engine has room
is not kept idle for them. The limiter learns from latency and failures, which also rise when an
instance is faulty or its host is busy rather than when its queue is long: at a rate the pool has
served before, a cut limit says the pool got slower, not that more is asked of it than it can do,
and holding back or shedding would delay or fail requests it serves directly. In a flood, standard
and batch requests are queued and shed as ever; interactive ones are never shed on a guess (a limit
cut late, while the engines' queues grew, leaves more in flight than it allows for seconds: one that
waited out its short queue time then is sent on, not failed). The engine's own account, a limit the
policy sets, or a token budget hold back and shed as always.
Counted as `overflow`, not `shed`.

Within a class, tenants (`admission.tenants`: the client's API key, or a header the policy
names) share the service by weight (`gateway.core.fair_queue`). What is kept per tenant is
bounded: the queues hold only tenants with requests waiting, and the shed counts keep the
`TENANTS_COUNTED` tenants shed most recently, the others added up under `other`.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

from gateway.config.models import AdmissionPolicy, TenantsPolicy
from gateway.core.admission import CLASSES, AdmissionQueues, ArrivalRate, Priority
from gateway.core.breaker import ADMITTING
from gateway.core.concurrency import estimate_tokens
from gateway.core.fair_queue import Entry
from gateway.core.histogram import Histogram
from gateway.errors import Shed
from gateway.pipeline.call import Call, Handler
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.response import UpstreamResponse

PRIORITIES: Final = frozenset(CLASSES)


# Tenants whose shed requests are counted apart (metrics, /admin/state); the rest are `other`.
TENANTS_COUNTED: Final = 100
# In parentheses: no tenant header's value is taken for them by accident.
OTHER_TENANTS: Final = "(other)"
ANONYMOUS: Final = "(anonymous)"
_LABEL_BYTES: Final = 64  # of a tenant header's value
# How fast the mean time a request holds its slot follows new ones.
_HOLD_WEIGHT: Final = 0.05
# Arrivals over the pool's fastest completions (rates over `FLOOD_WINDOW_S`; the peak halves
# every 5 minutes) beyond which a learned limit holds requests back: a flood. Not 1:
# completions trail arrivals by what is in flight while traffic ramps up, and a rate a little
# above the best yet may still be served. A short window, so a flood is known within seconds of
# its start. It lasts until arrivals are back to `FLOOD_END_RATIO` times that peak (the peak of
# noisy two-second counts rises as a flood goes on: without the margin, one quiet count would
# end it and the next begin it again).
FLOOD_RATIO: Final = 2.0
FLOOD_END_RATIO: Final = 1.0
FLOOD_WINDOW_S: Final = 2

QUEUE_WAIT_BUCKETS_S: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class Slot:
    """What `enter` gives a request: the instance its KV-cache tokens are reserved on (None:
    no reservation), and whether it was sent on past the pool's room (`over`: it holds none of
    the room's slots, and gives it back as such to `leave`)."""

    __slots__ = ("over", "reserved")

    def __init__(self, reserved: InstanceState | None = None, over: bool = False) -> None:
        self.reserved = reserved
        self.over = over


class _Waiter:
    """A queued request: what lets it through, the KV-cache tokens it will need, and the slot
    it got when it was let through."""

    __slots__ = ("future", "slot", "tokens")

    def __init__(self, future: asyncio.Future[None], tokens: int) -> None:
        self.future = future
        self.tokens = tokens
        self.slot = Slot()


def tenant_of(headers: Sequence[tuple[str, str]], policy: TenantsPolicy) -> str:
    """The request's tenant: the named header's value (its first `_LABEL_BYTES` characters),
    else `key-` and 12 hex digits of the SHA-256 of the API key the client presented (its
    `Authorization: Bearer` first, else `x-api-key`, as authentication reads them; the key
    itself is kept nowhere); "" when the request has neither."""
    wanted = policy.header
    if wanted is not None:
        for name, value in headers:
            if name.lower() == wanted:
                return value.strip()[:_LABEL_BYTES]
        return ""
    api_key = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == "authorization":
            scheme, _, key = value.partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                api_key = key
                break
        elif lowered == "x-api-key" and api_key is None:
            api_key = value
    if not api_key or not api_key.strip():
        return ""
    return "key-" + hashlib.sha256(api_key.strip().encode()).hexdigest()[:12]


class TenantCounts:
    """Counts by tenant for at most `size` tenants, the least recently counted folded into
    `other` when a new one comes: bounded memory, and bounded label sets in metrics."""

    __slots__ = ("_counts", "_size", "other")

    def __init__(self, size: int = TENANTS_COUNTED) -> None:
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._size = size
        self.other = 0

    def add(self, tenant: str) -> None:
        # Counted under its label from the start: merged only when read, a tenant named as
        # a placeholder made the label's count go down when the other was folded away (a
        # counter reset to Prometheus).
        if tenant == OTHER_TENANTS:
            self.other += 1
            return
        tenant = tenant or ANONYMOUS
        counts = self._counts
        if tenant in counts:
            counts[tenant] += 1
            counts.move_to_end(tenant)
            return
        if len(counts) >= self._size:
            self.other += counts.popitem(last=False)[1]
        counts[tenant] = 1

    def items(self) -> list[tuple[str, int]]:
        """(tenant label, count), each once, `other` last (0 while nothing was folded in)."""
        return [*self._counts.items(), (OTHER_TENANTS, self.other)]


def tenant_labels(counts: Iterable[tuple[str, int]], other: int) -> list[tuple[str, int]]:
    """Counts by tenant as metric labels: the requests with no tenant under `ANONYMOUS`, and
    the tenants not shown added up under `OTHER_TENANTS` (`other`), last. A tenant header may
    say either name itself: its count is added to the label's, for a label given twice in
    one metric makes Prometheus reject the whole scrape (any client could break the
    gateway's metrics so). For counts of what waits now (a gauge); `TenantCounts` keeps its
    counters under their labels from the start."""
    labelled: dict[str, int] = {}
    for tenant, count in counts:
        label = tenant or ANONYMOUS
        labelled[label] = labelled.get(label, 0) + count
    other += labelled.pop(OTHER_TENANTS, 0)
    return [*labelled.items(), (OTHER_TENANTS, other)]


class FloodWatch:
    """Whether requests flood a pool (see the module docstring): its arrivals, and its
    completions (`served`), over a short window, against the fastest it was seen to complete
    them."""

    __slots__ = ("_seen_at", "arrivals", "flooding", "served")

    def __init__(self) -> None:
        self.arrivals = ArrivalRate(window_s=FLOOD_WINDOW_S)
        self.served = ArrivalRate(window_s=FLOOD_WINDOW_S)
        self.flooding = False
        self._seen_at = 0.0  # when `flooded` last found a flood

    def flooded(self, now: float) -> bool:
        """Whether requests flood the pool: a flood starts when they arrive at more than
        `FLOOD_RATIO` times the fastest the pool was seen to complete them, and lasts until
        they arrive at no more than `FLOOD_END_RATIO` times that."""
        if self.flooding and now - self._seen_at > 2 * FLOOD_WINDOW_S:
            self.flooding = False  # not asked about for a while: judged afresh, as a start
        ratio = FLOOD_END_RATIO if self.flooding else FLOOD_RATIO
        self.flooding = self.arrivals.qps(now) > ratio * self.served.peak(now)
        if self.flooding:
            self._seen_at = now
        return self.flooding


class PoolAdmission:
    """One pool's queues and slots."""

    def __init__(self, pool: PoolState, policy: AdmissionPolicy) -> None:
        self.pool = pool
        self.policy = policy
        self.queues: AdmissionQueues[_Waiter] = AdmissionQueues(
            *_queue_settings(policy), tenant_weight=_weights(policy.tenants)
        )
        self.running = 0  # requests holding a slot of the room
        self.over = 0  # requests sent on past the room (a learned limit's, without a flood)
        self.completions = ArrivalRate(window_s=10)
        self.flood_watch = FloodWatch()
        # The mean time a request holds its slot: with the room, the pool's rate of service
        # while it is full, before 10 s of completions can tell it.
        self.hold_s = 0.0
        self.tenant_shed = TenantCounts()
        self.waits = {name: Histogram(QUEUE_WAIT_BUCKETS_S) for name in CLASSES}
        # Its clock is the loop it sets its queue timers on (`call_at`): the same as the
        # layers' (`gateway.request_path`), read from there so the two can never disagree.
        self._loop = asyncio.get_running_loop()
        self.clock = self._loop.time
        self._timer: asyncio.TimerHandle | None = None
        pool.capacity_listeners.append(self.dispatch)

    def reconfigure(self, policy: AdmissionPolicy) -> None:
        """A reloaded pool's new admission settings, in place: the running count, the queues
        and their waiters carry over, so the pool's slots are never counted twice."""
        self.policy = policy
        self.queues.reconfigure(*_queue_settings(policy))
        self.queues.set_tenant_weight(_weights(policy.tenants))
        self.dispatch()  # the new weights or bounds may let someone through

    def room(self) -> int:
        """Slots in the pool: the concurrency limits of the instances taking new work, held
        to their engines' room while saturated."""
        return sum(
            inst.room()
            for inst in self.pool.routable
            if inst.limiter is not None and inst.breaker.state == ADMITTING
        )

    def free(self, now: float) -> int:
        """Slots free now: the room less the requests holding slots (and those sent past a
        guess that count against it, `_over_held`); and, when some instances hold attempts
        past their own room, at least the slots the others have idle, up to those attempts.

        A room can shrink under what an instance already runs (its engine's gauges read
        saturated, work it took while a peer was out). Its attempts past that room hold slots
        of the pool's count but none of the other instances' room, which would otherwise idle
        while requests wait here (seen on llama.cpp engines after one was frozen: 3 to 13
        requests queued for 8 s, the thawed engine running 1 of its 4). The credit is bounded
        by the slots the others have idle now (what each was seen serving at once, within its
        room), less the requests let through that have no attempt on an instance yet (let
        through together, their attempts are placed only once their tasks run). So a request
        let through on it and placed past a room somewhere (the pick layer's last resort)
        frees no further slot, and neither does an instance the pick layer would not use now
        (paused by its Retry-After). A guessed room is left out: what is sent past a guess is
        counted apart (`over`)."""
        room = beyond = open_ = placed = 0
        for inst in self.pool.routable:
            placed += inst.in_flight
            if inst.limiter is None or inst.breaker.state != ADMITTING:
                continue
            own = inst.room()
            room += own
            if inst.room_guessed:
                continue
            if inst.in_flight > own:
                beyond += inst.in_flight - own
            elif not inst.paused(now):  # paused by a Retry-After: the pick layer waits too
                # Its idle slots only, not the headroom of its room past them (requests
                # that would wait in its engine's own queue, where none can move to a slot
                # that frees elsewhere first, as they can from the gateway's queue).
                slots = inst.capacity_seen or own
                if slots > own:
                    slots = own
                if slots > inst.in_flight:
                    open_ += slots - inst.in_flight
        busy = self.running + self._over_held(now) if self.over else self.running
        free = room - busy
        if beyond and open_ > free:
            unplaced = self.running + self.over - placed
            free = max(free, min(free + beyond, open_ - max(0, unplaced)))
        return free

    def _place(self, tokens: int) -> InstanceState | None:
        """An instance taking new work that has room for `tokens` in its KV-token budget (the
        one with the most room left), one its engine does not say is saturated first (as the
        pick layer chooses), or None."""
        best: InstanceState | None = None
        most = (-1, -1)
        for inst in self.pool.routable:
            if inst.breaker.state != ADMITTING:
                continue
            if inst.engine.saturated and inst.in_flight >= inst.engine.slots:
                continue  # its engine has no room: this one's tokens would wait there
            budget = inst.budget
            if budget is None:
                if not inst.engine.saturated:
                    return inst  # nothing to rank it by: no budget, and room in its engine
            elif not budget.fits(tokens):
                continue
            rank = (
                0 if inst.engine.saturated else 1,
                budget.available if budget is not None else 0,
            )
            if rank > most:
                best, most = inst, rank
        return best

    def _reserve(self, tokens: int) -> InstanceState | None:
        """Hold the request's tokens on an instance until its first attempt is placed, so
        requests let through together cannot all count on the same free tokens."""
        inst = self._place(tokens)
        if inst is None or inst.budget is None:
            return None
        inst.budget.acquire(tokens)
        return inst

    async def enter(
        self, priority: Priority, tokens: int = 0, tenant: Callable[[], str] = str
    ) -> Slot:
        """Return once the request may go on, with its `Slot`; raises Shed when it is refused.
        `tenant` says whose request it is, asked only when it has to wait."""
        now = self._loop.time()
        queues = self.queues
        queues.arrived(priority, now)
        self.flood_watch.arrivals.arrive(now)
        if not len(queues):
            if self.free(now) > 0 and self._place(tokens) is not None:
                self.running += 1
                self.waits[priority].observe(0.0)
                return Slot(self._reserve(tokens))
            if self._held_by_guess(tokens) and not self._holding(now):
                queues.sent_over(priority)
                return self._go_over(priority, tokens)
        if not any(i.breaker.state == ADMITTING for i in self.pool.routable):
            self.running += 1  # nothing takes traffic: the pick layer answers 503 straight away
            return Slot()
        self.pool.engines_wanted.set()  # full: what do the engines say now?
        waiter = _Waiter(self._loop.create_future(), tokens)
        whose = tenant()
        offer = queues.offer(waiter, priority, now, self._service_rate(now), whose)
        for entry in offer.evicted:
            if self._send_anyway(entry):
                continue
            self.tenant_shed.add(entry.tenant)
            why = (
                "the queue is full: dropped for a tenant with fewer requests waiting"
                if entry.priority == priority
                else "evicted by a more urgent request"
            )
            _refuse(entry.item.future, why, self._retry_after_s())
        if not offer.queued:
            if self._guessing(priority, tokens):
                queues.sent_anyway(priority)
                return self._go_over(priority, tokens)
            self.tenant_shed.add(whose)
            raise Shed(
                f"pool {self.pool.name!r} is overloaded: {offer.reason}",
                retry_after_s=self._retry_after_s(),
            )
        if self.free(now) > 0:
            self.dispatch()  # slots free, yet others wait for tokens: this one may fit now
        else:
            self._arm()
        future = waiter.future
        try:
            await future  # resolved by `dispatch` (or `_send_anyway`), which took its slot
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                unreserve(waiter.slot.reserved, tokens)  # let through just as the client left
                self.leave(over=waiter.slot.over)
            raise
        self.waits[priority].observe(self._loop.time() - now)
        return waiter.slot

    def _go_over(self, priority: Priority, tokens: int) -> Slot:
        """Send the request on past the room, now."""
        self.over += 1
        self.waits[priority].observe(0.0)
        self.pool.engines_wanted.set()  # an engine whose gauges were not read yet may have some
        return Slot(self._reserve(tokens), over=True)

    def leave(self, held_s: float | None = None, over: bool = False) -> None:
        """A request gives its slot back (`over`: it was sent on past the room), after holding
        it `held_s` (None: not counted)."""
        if over:
            self.over -= 1
        else:
            self.running -= 1
        now = self._loop.time()
        self.completions.arrive(now)
        self.flood_watch.served.arrive(now)
        if held_s is not None:
            self.hold_s += (held_s - self.hold_s) * (_HOLD_WEIGHT if self.hold_s else 1.0)
        self.dispatch()

    def _service_rate(self, now: float) -> float:
        """Requests a second the pool completes while full: the completions of the last 10 s,
        or the room over the mean slot hold when that is more (a burst after a quiet spell
        would otherwise be judged by the quiet spell's completions)."""
        completed = self.completions.qps(now)
        if self.hold_s <= 0:
            return completed
        return max(completed, self.room() / self.hold_s)

    def dispatch(self) -> None:
        """Let waiting requests through while there is room."""
        if not len(self.queues):
            return
        now = self._loop.time()
        queues = self.queues
        free = self.free(now)  # worked out once: each request let through takes one
        while free > 0:
            entry = queues.pop(now, lambda waiter: self._place(waiter.tokens) is not None)
            if entry is None:
                break
            if self._let_through(entry.item):
                free -= 1
        self._arm()

    def _let_through(self, waiter: _Waiter, over: bool = False) -> bool:
        """Give a waiting request its slot; False when its client left while it waited."""
        if waiter.future.done():
            return False
        if over:
            self.over += 1
        else:
            self.running += 1
        waiter.slot = Slot(self._reserve(waiter.tokens), over)
        waiter.future.set_result(None)
        return True

    def _held_by_guess(self, tokens: int) -> bool:
        """Whether an instance that would take the request is held back only by its adaptive
        limit's guess (see the module docstring)."""
        return any(
            inst.breaker.state == ADMITTING
            and inst.room_guessed
            and (inst.budget is None or inst.budget.fits(tokens))
            for inst in self.pool.routable
        )

    def refused_lately(self, now: float) -> bool:
        """Whether an engine of the pool whose room is a learned limit refused a request for
        load lately (`Limiter.refused_lately`): that limit is then the engine's word."""
        return any(
            inst.room_guessed and inst.limiter is not None and inst.limiter.refused_lately(now)
            for inst in self.pool.routable
        )

    def _over_held(self, now: float) -> int:
        """The requests sent on past the room that count against it now: while an engine
        refuses requests for load, as many as the learned limits allow (sent before the
        refusals showed, they are still in those engines and part of why), none otherwise. Never
        against the room of an engine whose own account paces it: it has room whatever was sent
        past a guess elsewhere. (A flood alone does not count them: what a learned limit let
        past was served at the pool's usual rate, and the flood's own queue holds the rest.)"""
        if not self.refused_lately(now):
            return 0
        guessed = sum(
            inst.room()
            for inst in self.pool.routable
            if inst.room_guessed and inst.breaker.state == ADMITTING
        )
        return min(self.over, guessed)

    def _holding(self, now: float) -> bool:
        """Whether learned limits hold requests back now: in a flood, or while an engine says
        it is full by refusing requests (an out-of-memory error, 429, 503, 529)."""
        return self.refused_lately(now) or self.flood_watch.flooded(now)

    def _guessing(self, priority: Priority, tokens: int) -> bool:
        """Whether a request about to be answered 429 is sent on instead: an instance that would
        take it is held back only by a guess, and it is interactive or the limits do not hold
        now."""
        if not self._held_by_guess(tokens):
            return False
        return priority == CLASSES[0] or not self._holding(self._loop.time())

    def _send_anyway(self, entry: Entry[_Waiter]) -> bool:
        """Send a queued request on, past the room, instead of refusing it, where only a guess
        holds it (one whose client left is refused: nothing to send)."""
        waiter = entry.item
        if waiter.future.done() or not self._guessing(entry.priority, waiter.tokens):
            return False
        self.queues.sent_anyway(entry.priority)
        self._let_through(waiter, over=True)
        return True

    def _arm(self) -> None:
        """One timer for the oldest waiting request's queue timeout."""
        expiry = self.queues.next_expiry()
        if self._timer is not None:
            if expiry is not None and self._timer.when() <= expiry:
                return
            self._timer.cancel()
            self._timer = None
        if expiry is not None:
            self._timer = self._loop.call_at(expiry, self._expire)

    def _expire(self) -> None:
        self._timer = None
        now = self._loop.time()
        for entry in self.queues.expire(now):
            if self._send_anyway(entry):
                continue
            self.tenant_shed.add(entry.tenant)
            _refuse(
                entry.item.future,
                f"waited {now - entry.enqueued_at:.2f}s in the {entry.priority} queue",
                self._retry_after_s(),
            )
        self.dispatch()

    def _retry_after_s(self) -> float:
        """When to come back: about the time the queues in front take to drain."""
        rate = self._service_rate(self._loop.time())
        return max(1.0, len(self.queues) / rate) if rate > 0 else 1.0


def _queue_settings(
    policy: AdmissionPolicy,
) -> tuple[dict[Priority, float], dict[Priority, int], dict[Priority, float], int]:
    """The queues' settings from the policy: weights, bounds and timeouts by class, and the
    bound on the total."""
    classes = {name: getattr(policy, name) for name in CLASSES}
    return (
        {name: c.weight for name, c in classes.items()},
        {name: c.max_queue for name, c in classes.items()},
        {name: c.queue_timeout for name, c in classes.items()},
        policy.max_queued,
    )


def _weights(policy: TenantsPolicy) -> Callable[[str], float]:
    weights, default = policy.weights, policy.default_weight
    return lambda tenant: weights.get(tenant, default)


def unreserve(instance: InstanceState | None, tokens: int) -> None:
    """Give back tokens reserved at admission that no attempt took over."""
    if instance is not None and instance.budget is not None:
        instance.budget.release(tokens)


def _refuse(waiter: asyncio.Future[None], reason: str, retry_after_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(Shed(f"shed: {reason}", retry_after_s=retry_after_s))


class Admit:
    """The layer: holds a slot of the pool for the whole exchange."""

    def __init__(self, admissions: Mapping[str, PoolAdmission]) -> None:
        self._admissions = admissions

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        admission = self._admissions.get(call.pool.name)
        if admission is None or call.route.kind == "utility":
            # A tokenize is answered by the engine's server, not its scheduler: it takes no
            # slot and queues behind nothing, as going direct.
            return await next_handler(call)
        priority = call.priority or admission.policy.default_priority
        attempt = call.attempt  # what admission holds, for its first attempt to take over
        if admission.policy.tokens is not None:
            # What it may decode: none on a route that generates nothing (an embedding).
            max_tokens = call.facts.max_tokens if call.route.generates else 0
            attempt.tokens = estimate_tokens(
                call.prompt_bytes(), max_tokens, call.pool.policy.timeouts.assumed_max_tokens
            )
        tenants = admission.policy.tenants
        slot = await admission.enter(
            priority, attempt.tokens, lambda: tenant_of(call.headers, tenants)
        )
        attempt.reserved = slot.reserved
        over = slot.over
        clock = admission.clock
        admitted = clock()
        try:
            response = await next_handler(call)
        except BaseException:
            unreserve(attempt.reserved, attempt.tokens)  # when no attempt was made to take it over
            admission.leave(over=over)
            raise
        if response.body is not None:
            admission.leave(clock() - admitted, over)
            return response
        response.after(lambda r, error: admission.leave(clock() - admitted, over), request=True)
        return response


def parse_priority(raw: bytes | None) -> Priority | None:
    """The `x-gateway-priority` header (None when absent); ValueError when unknown."""
    if raw is None:
        return None
    value = raw.decode("latin-1").strip().lower()
    if value not in PRIORITIES:
        raise ValueError("x-gateway-priority must be interactive, standard or batch")
    return value
