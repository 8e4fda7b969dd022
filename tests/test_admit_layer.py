"""The admission shell in-process: slots, waiting, hand-over, queue timeouts, cancellation."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import pytest

from gateway.config import parse_policy
from gateway.config.models import TenantsPolicy
from gateway.config.routes import KNOWN_ROUTES
from gateway.core.admission import ArrivalRate
from gateway.errors import Shed
from gateway.pipeline.admission_snapshot import admission_snapshot
from gateway.pipeline.admit import (
    Admit,
    PoolAdmission,
    TenantCounts,
    parse_priority,
    tenant_of,
    unreserve,
)
from gateway.pipeline.call import Call, RequestFacts
from gateway.runtime import Cancellation
from gateway.upstream.registry import Registry
from gateway.upstream.response import UpstreamResponse


def one_pool(admission: str, instances: int = 1) -> str:
    """A policy of one pool, `chat`, of `instances` instances (a, b) that nothing health-checks,
    with the given `admission` section (YAML, its lines unindented)."""
    names = "ab"[:instances]
    listed = ", ".join(
        f'{{name: {n}, url: "http://127.0.0.1:{9 + i}"}}' for i, n in enumerate(names)
    )
    section = "".join(f"      {line}\n" for line in admission.strip().splitlines())
    return (
        "pools:\n  chat:\n    models: [m]\n"
        f"    instances: [{listed}]\n    health: {{enabled: false}}\n    admission:\n{section}"
    )


def pool_admission(policy_text: str) -> PoolAdmission:
    """The admission of the policy's pool `chat`, its instances built with it."""
    pool = Registry(parse_policy(policy_text), now=asyncio.get_running_loop().time()).pools["chat"]
    assert pool.policy.admission is not None
    assert all(inst.limiter is not None for inst in pool.instances)  # built with the pool
    return PoolAdmission(pool, pool.policy.admission)


POLICY = one_pool(
    """
concurrency: {mode: fixed, limit: 1}
interactive: {queue_timeout: 50ms}
batch: {max_queue: 1}
"""
)


def admission() -> PoolAdmission:
    return pool_admission(POLICY)


async def test_a_freed_slot_goes_to_the_waiting_request() -> None:
    adm = admission()
    await adm.enter("standard")
    assert adm.running == 1
    waiting = asyncio.ensure_future(adm.enter("standard"))
    await asyncio.sleep(0)
    assert not waiting.done() and len(adm.queues) == 1
    adm.leave()
    await waiting
    assert adm.running == 1 and len(adm.queues) == 0


async def test_a_request_waiting_past_its_queue_timeout_is_shed() -> None:
    adm = admission()
    await adm.enter("standard")
    with pytest.raises(Shed) as shed:
        await asyncio.wait_for(adm.enter("interactive"), 5)
    assert "waited" in shed.value.message and shed.value.retry_after_s is not None
    assert adm.queues.shed["interactive"] == 1


async def test_a_full_queue_sheds_at_once() -> None:
    adm = admission()
    await adm.enter("standard")
    first = asyncio.ensure_future(adm.enter("batch"))
    await asyncio.sleep(0)
    with pytest.raises(Shed, match="batch queue is full"):
        await adm.enter("batch")
    first.cancel()


async def test_a_client_that_leaves_while_waiting_frees_its_place() -> None:
    adm = admission()
    await adm.enter("standard")
    gone = asyncio.ensure_future(adm.enter("standard"))
    await asyncio.sleep(0)
    gone.cancel()
    nxt = asyncio.ensure_future(adm.enter("standard"))
    await asyncio.sleep(0)
    adm.leave()
    await asyncio.wait_for(nxt, 5)
    assert adm.running == 1


async def test_no_room_at_all_goes_straight_on() -> None:
    adm = admission()
    adm.pool.instances[0].breaker.isolate(0.0, adm.pool.rng)  # nothing takes traffic
    await adm.enter("batch")  # the pick layer will answer 503 at once
    assert adm.running == 1


TOKENS_POLICY = one_pool(
    """
concurrency: {mode: fixed, limit: 8}
tokens: {capacity: 1000, overcommit: 1.0}
""",
    instances=2,
)


def token_admission() -> PoolAdmission:
    return pool_admission(TOKENS_POLICY)


async def test_tokens_are_reserved_on_the_roomiest_instance_at_admission() -> None:
    adm = token_admission()
    a, b = adm.pool.instances
    first = (await adm.enter("standard", 600)).reserved
    second = (await adm.enter("standard", 600)).reserved
    # Let through back to back, before any attempt: each holds its own instance's tokens.
    assert {first, second} == {a, b}
    assert a.budget is not None and b.budget is not None
    assert a.budget.used == b.budget.used == 600
    # A third large one waits although slots are free; a small one fits beside and goes.
    third = asyncio.ensure_future(adm.enter("standard", 600))
    small = (await asyncio.wait_for(adm.enter("interactive", 300), 5)).reserved
    assert small in (a, b) and not third.done()
    assert adm.running == 3
    # The first finishes: its tokens come back and the third is let through.
    unreserve(first, 600)
    adm.leave()
    assert (await asyncio.wait_for(third, 5)).reserved is first


async def test_a_saturated_instance_gives_only_its_engines_room_until_it_clears() -> None:
    adm = token_admission()
    a, b = adm.pool.instances
    for inst in (a, b):
        inst.engine.saturated = True
        inst.engine.slots = 1  # what the engine read left room for
    # Never none: a queue that other clients keep full still takes this gateway's requests.
    assert adm.room() == 2
    assert (await adm.enter("standard", 10)).reserved is not None
    assert (await adm.enter("standard", 10)).reserved is not None
    waiting = asyncio.ensure_future(adm.enter("standard", 10))
    await asyncio.sleep(0)
    assert not waiting.done() and len(adm.queues) == 1
    b.engine.saturated = False
    adm.pool.capacity_changed()  # what the engine scraper says when it clears
    assert (await asyncio.wait_for(waiting, 5)).reserved is b  # where the engine has room
    assert adm.room() == 1 + 8


async def test_attempts_past_a_room_that_shrank_keep_no_other_instances_room_idle() -> None:
    """`a` holds four attempts when its engine's gauges read it full and its room shrinks to
    one: three of them sit past its room. They hold slots of the pool's count, but none of
    b's room: once three of b's four finish, three waiting requests go on to b at once, not
    after a's four have finished (seen on llama.cpp engines after one was frozen)."""
    adm = pool_admission(one_pool("concurrency: {mode: fixed, limit: 4}", instances=2))
    a, b = adm.pool.instances
    for _ in range(8):
        await adm.enter("standard")
    a.in_flight = b.in_flight = 4  # placed by the pick layer: four on each
    a.engine.saturated = True
    a.engine.slots = 1  # what its engine's read leaves room for
    assert adm.room() == 1 + 4
    waiting = [asyncio.ensure_future(adm.enter("standard")) for _ in range(4)]
    await asyncio.sleep(0)
    assert len(adm.queues) == 4
    for _ in range(3):  # three of b's answers end
        b.in_flight -= 1
        adm.leave()
    await asyncio.sleep(0)
    assert sum(w.done() for w in waiting) == 3 and len(adm.queues) == 1
    assert adm.free(asyncio.get_running_loop().time()) == 0  # those three hold b's room now
    b.in_flight += 3  # where they go: the pick layer's fresh instance
    for _ in range(3):  # a's attempts past its room end: they free nothing of b's
        a.in_flight -= 1
        adm.leave()
    await asyncio.sleep(0)
    assert len(adm.queues) == 1  # a at its one-request room, b at its four
    a.in_flight -= 1
    adm.leave()
    await asyncio.wait_for(waiting[3], 5)  # a's own room came free
    # The others' free room bounds what attempts past a room give back: with b full, a
    # request let through now would only be placed past a room too, and free one more slot.
    a.in_flight = 4
    assert adm.free(asyncio.get_running_loop().time()) == 0
    late = asyncio.ensure_future(adm.enter("standard"))
    await asyncio.sleep(0)
    assert not late.done() and len(adm.queues) == 1
    b.in_flight = 3  # one of b's ends: its room is free, but b asked for a pause
    b.not_before = asyncio.get_running_loop().time() + 5.0
    adm.pool.capacity_changed()
    await asyncio.sleep(0)
    assert not late.done()
    late.cancel()


def test_priorities() -> None:
    assert parse_priority(None) is None
    assert parse_priority(b" Interactive ") == "interactive"
    with pytest.raises(ValueError):
        parse_priority(b"urgent")


# -- tenants -------------------------------------------------------------------------------------


def test_a_tenant_is_the_api_keys_digest_or_the_named_header() -> None:
    by_key = TenantsPolicy()
    digest = "key-" + hashlib.sha256(b"sk-one").hexdigest()[:12]
    assert tenant_of([("Authorization", "Bearer sk-one")], by_key) == digest
    assert tenant_of([("x-api-key", "sk-one")], by_key) == digest
    assert tenant_of([("authorization", "Basic abc"), ("x-api-key", "sk-one")], by_key) == digest
    # The bearer key wins, wherever it comes, as authentication reads it.
    assert tenant_of([("x-api-key", "made-up"), ("authorization", "Bearer sk-one")], by_key) == (
        digest
    )
    assert tenant_of([("content-type", "application/json")], by_key) == ""
    by_header = TenantsPolicy(header="X-Team")
    headers = [("authorization", "Bearer sk-one"), ("x-team", " research " + "x" * 100)]
    assert tenant_of(headers, by_header) == ("research " + "x" * 100)[:64]
    assert tenant_of([("authorization", "Bearer sk-one")], by_header) == ""
    with pytest.raises(ValueError):
        TenantsPolicy(header="x-gateway-tenant")


def test_tenant_counts_stay_bounded() -> None:
    counts = TenantCounts(size=2)
    for tenant in ("a", "b", "a", "", "c"):
        counts.add(tenant)
    # b, then a (the least recently counted) were folded into `other`.
    assert counts.items() == [("(anonymous)", 1), ("c", 1), ("(other)", 3)]


def test_a_tenant_named_like_a_placeholder_shares_its_label() -> None:
    """A tenant header that says `(anonymous)` or `(other)` adds to that label rather than
    giving it twice: a label given twice in one metric makes Prometheus reject the scrape."""
    counts = TenantCounts(size=2)
    for tenant in ("(other)", "(anonymous)", "", "a"):
        counts.add(tenant)
    assert counts.items() == [("(anonymous)", 2), ("a", 1), ("(other)", 1)]
    counts.add("b")  # `(anonymous)`, the least recently counted, is folded into `other`...
    assert counts.items() == [("a", 1), ("b", 1), ("(other)", 3)]  # ...and no count fell


async def test_a_tenant_named_like_a_placeholder_waits_under_its_label() -> None:
    adm = pool_admission(TENANTS_POLICY)
    await adm.enter("batch")  # the one slot

    def named(tenant: str) -> Callable[[], str]:
        return lambda: tenant

    waiting = [
        asyncio.ensure_future(adm.enter("batch", tenant=named(t)))
        for t in ("(other)", "(anonymous)", "", "x")
    ]
    await asyncio.sleep(0)
    queued = admission_snapshot(adm, 0.0).tenants_queued["batch"]
    assert queued == {"(anonymous)": 2, "x": 1, "(other)": 1}
    assert list(queued)[-1] == "(other)"
    for _ in waiting:
        adm.leave()
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)


TENANTS_POLICY = one_pool(
    """
concurrency: {mode: fixed, limit: 1}
batch: {max_queue: 4}
tenants: {header: x-team, weights: {gold: 3}}
"""
)


async def test_waiting_tenants_are_served_by_weight_and_a_flood_drops_its_own() -> None:
    adm = pool_admission(TENANTS_POLICY)
    await adm.enter("batch")  # the one slot
    order: list[str] = []

    async def wait(tenant: str) -> None:
        try:
            await adm.enter("batch", tenant=lambda: tenant)
        except Shed:
            order.append(f"shed {tenant}")
            return
        order.append(tenant)

    tasks = [asyncio.ensure_future(wait("flood")) for _ in range(4)]
    await asyncio.sleep(0)
    tasks += [asyncio.ensure_future(wait("gold")) for _ in range(2)]  # the queue is full
    for _ in range(3):
        await asyncio.sleep(0)
    assert order == ["shed flood", "shed flood"]  # the flood gave up its newest two
    assert admission_snapshot(adm, 0.0).tenants_queued["batch"] == {
        "flood": 2,
        "gold": 2,
        "(other)": 0,
    }
    for _ in range(4):
        adm.leave()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    # Even at first (flood started waiting first); then gold, of weight 3, three turns to one.
    assert order[2:] == ["flood", "gold", "gold", "flood"]
    assert dict(adm.tenant_shed.items()) == {"flood": 2, "(other)": 0}


# -- a learned limit is a guess: it holds back and sheds only a flood ------------------------------

GUESS_POLICY = one_pool(
    """
vllm_signals: false
concurrency: {limit: 64, initial: 1, min: 1}
interactive: {queue_timeout: 50ms}
standard: {queue_timeout: 50ms}
batch: {max_queue: 1}
"""
)


def guess_admission() -> PoolAdmission:
    adm = pool_admission(GUESS_POLICY)
    assert adm.room() == 1 and adm.pool.instances[0].room_guessed
    return adm


async def served(adm: PoolAdmission, requests: int) -> None:
    """`requests` answered one after another: the pool has been seen completing them."""
    for _ in range(requests):
        await adm.enter("standard")
        adm.leave()


async def test_without_a_flood_a_learned_limit_holds_nothing_back() -> None:
    adm = guess_admission()
    await served(adm, 10)  # at the rate about to arrive: no flood
    await adm.enter("standard")  # the one slot the limit allows
    await asyncio.wait_for(adm.enter("batch"), 5)  # past it, at once
    slot = await asyncio.wait_for(adm.enter("interactive"), 5)
    assert slot.over and slot.reserved is None
    # They hold none of the room's slots.
    assert (adm.running, adm.over, len(adm.queues)) == (1, 2, 0)
    seen = admission_snapshot(adm, 0.0)
    assert seen.running == 3 and seen.over == 2
    assert adm.queues.overflow == {"interactive": 1, "standard": 0, "batch": 1}
    assert admission_snapshot(adm, 0.0).overflow == adm.queues.overflow
    assert adm.queues.shed == {"interactive": 0, "standard": 0, "batch": 0}


async def test_a_learned_limit_holds_back_a_flood_and_sheds_its_standard_and_batch() -> None:
    adm = guess_admission()
    await served(adm, 1)
    await adm.enter("standard")
    queued = [asyncio.ensure_future(adm.enter("batch")) for _ in range(3)]
    await asyncio.sleep(0)
    # Arrivals more than twice what the pool completed: a flood, held back and shed as ever.
    now = adm.clock()
    assert adm.flood_watch.arrivals.qps(now) > 2 * adm.flood_watch.served.peak(now)
    assert not queued[0].done()  # the one place in the batch queue
    assert all(isinstance(task.exception(), Shed) for task in queued[1:])
    with pytest.raises(Shed, match="standard queue would take"):
        await asyncio.wait_for(adm.enter("standard"), 5)
    assert adm.queues.shed == {"interactive": 0, "standard": 1, "batch": 2}
    # An interactive one is never shed on a guess: out of queue time, it goes on.
    assert (await asyncio.wait_for(adm.enter("interactive"), 5)).over
    assert adm.queues.shed["interactive"] == 0 and adm.queues.overflow["interactive"] == 1
    # It holds no slot of the room: the queued one goes as soon as the one slot frees.
    adm.leave(over=True)
    await asyncio.sleep(0)
    assert not queued[0].done()
    adm.leave()
    assert not (await asyncio.wait_for(queued[0], 5)).over
    assert (adm.running, adm.over) == (1, 0)


async def test_once_the_flood_is_over_what_waits_keeps_its_place_then_goes_on() -> None:
    adm = guess_admission()
    await adm.enter("standard")  # nothing completed yet: any arrival is a flood
    waiting = [asyncio.ensure_future(adm.enter("standard")) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(task.done() for task in waiting)  # a flood: they queue
    for _ in range(100):  # the pool seen completing far more than arrives
        adm.flood_watch.served.arrive(adm.clock())
    adm.dispatch()  # a completion: they keep their places in the queue
    await asyncio.sleep(0)
    assert not any(task.done() for task in waiting)
    # Out of queue time: sent on, not shed.
    await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert all(task.result().over for task in waiting)
    assert adm.queues.overflow["standard"] == 3 and adm.queues.shed["standard"] == 0
    assert (adm.running, adm.over) == (1, 3)


async def test_a_flood_starts_at_twice_the_peak_and_lasts_until_arrivals_are_back_to_it() -> None:
    adm = guess_admission()
    now = adm.clock()
    for _ in range(10):
        adm.flood_watch.served.arrive(now)  # completed at 5 a second (over 2 s): the peak
    # (seconds later, arrivals then, flood): arrival rates over the last 2 s of 10, 10.5,
    # 5.5, 4.5, 7 and 10 a second (the peak, 5, decays a hair in those seconds).
    steps = ((0, 20, False), (0, 1, True), (2, 11, True), (4, 9, False), (4, 5, False))
    for later, arrivals, flood in (*steps, (4, 6, True)):
        for _ in range(arrivals):
            adm.flood_watch.arrivals.arrive(now + later)
        assert adm.flood_watch.flooded(now + later) is flood, (
            later,
            adm.flood_watch.arrivals.qps(now + later),
        )
    assert admission_snapshot(adm, now + 4).flood is True
    # Not asked about for longer than two windows: a new rate is judged as a start.
    for _ in range(12):
        adm.flood_watch.arrivals.arrive(now + 10)
    assert not adm.flood_watch.flooded(now + 10)  # 6 a second: over the peak, under twice it


async def test_once_the_engine_refuses_for_load_a_learned_limit_holds_without_a_flood() -> None:
    adm = guess_admission()
    await served(adm, 10)  # at the rate about to arrive: no flood
    await adm.enter("standard")  # the one slot the limit allows
    assert (await adm.enter("standard")).over  # past it: nothing says the engine is full
    inst = adm.pool.instances[0]
    limiter = inst.limiter
    assert limiter is not None
    now = adm.clock()
    # The engine answers one out of memory (or 429, 503, 529): its own word that it is full.
    limiter.record(now, None, in_flight=2, overloaded=True, refused=True)
    assert inst.room_guessed and adm.room() == 1
    assert admission_snapshot(adm, now).engine_refused and not adm.flood_watch.flooded(now)
    # Now a request waits for room, and the one sent past before counts against that room;
    # one that would wait longer than its class's queue time is shed with a time to come back.
    waiting = asyncio.ensure_future(adm.enter("batch"))
    await asyncio.sleep(0)
    assert not waiting.done()
    with pytest.raises(Shed, match="standard queue would take") as shed:
        await adm.enter("standard")
    assert shed.value.retry_after_s >= 1
    adm.leave()  # the slot frees, but the one sent past still runs there
    await asyncio.sleep(0)
    assert not waiting.done()
    adm.leave(over=True)
    assert not (await asyncio.wait_for(waiting, 5)).over
    # Interactive, out of queue time, still goes on rather than fail.
    assert (await asyncio.wait_for(adm.enter("interactive"), 5)).over
    assert adm.queues.shed == {"interactive": 0, "standard": 1, "batch": 0}


MIXED_POLICY = one_pool("concurrency: {limit: 64, initial: 1, min: 1}", instances=2)


async def test_requests_sent_past_a_guess_hold_no_slot_an_engine_has_room_for() -> None:
    adm = pool_admission(MIXED_POLICY)
    a, b = adm.pool.instances
    a.engine.paced, a.engine.batch = True, 8  # its engine's gauges: room for 10
    assert adm.room() == 10 + 1 and b.room_guessed and not a.room_guessed
    await served(adm, 40)
    for _ in range(11):
        assert not (await adm.enter("standard")).over
    assert (await adm.enter("standard")).over  # no flood: past b's guess
    adm.flood_watch.served = ArrivalRate(
        window_s=2
    )  # the pool's history gone: any arrival is a flood
    adm.leave()  # a slot at a frees
    # Its slot goes to the next request: the one sent past b does not hold it.
    assert not (await asyncio.wait_for(adm.enter("standard"), 5)).over
    assert (adm.running, adm.over) == (11, 1)


@pytest.mark.parametrize("held_by", ["engine", "saturated"])
async def test_an_engines_own_account_still_sheds(held_by: str) -> None:
    adm = guess_admission()
    await served(adm, 10)
    inst = adm.pool.instances[0]
    if held_by == "engine":
        inst.engine.paced, inst.engine.batch = True, 1  # room: its batch plus 2
    else:
        inst.engine.saturated, inst.engine.slots = True, 1
    assert not inst.room_guessed
    for _ in range(adm.room()):
        await adm.enter("standard")
    queued = asyncio.ensure_future(adm.enter("batch"))
    await asyncio.sleep(0)
    with pytest.raises(Shed, match="batch queue is full"):
        await adm.enter("batch")
    with pytest.raises(Shed, match="interactive queue would take"):
        await asyncio.wait_for(adm.enter("interactive"), 5)
    assert adm.queues.overflow == {"interactive": 0, "standard": 0, "batch": 0}
    queued.cancel()


async def test_a_fixed_limit_is_not_a_guess() -> None:
    adm = admission()  # `mode: fixed`
    assert not adm.pool.instances[0].room_guessed
    await adm.enter("standard")
    with pytest.raises(Shed):
        await asyncio.wait_for(adm.enter("interactive"), 5)


async def test_a_tokenize_takes_no_slot_and_waits_behind_nothing() -> None:
    gate = pool_admission(one_pool("concurrency: {mode: fixed, limit: 1}\nbatch: {max_queue: 0}\n"))
    layer = Admit({"chat": gate})
    held = await gate.enter("interactive", 0, lambda: None)  # the one slot, taken
    task = asyncio.current_task()
    assert task is not None

    def call(path: str) -> Call:
        return Call(
            pool=gate.pool,
            route=KNOWN_ROUTES[path],
            query="",
            body=b"{}",
            headers=[],
            facts=RequestFacts("m", False, None),
            deadline=asyncio.get_running_loop().time() + 5,
            cancellation=Cancellation(task),
            priority="batch",
        )

    class Answered:
        body = b"{}"

    async def answer(_: Call) -> UpstreamResponse:
        return Answered()  # type: ignore[return-value]

    # Answered by the engine's server, not its scheduler: straight through, as direct.
    assert isinstance(await layer(call("/tokenize"), answer), Answered)
    with pytest.raises(Shed):  # a generation waits for the slot (here: no queue for it)
        await layer(call("/v1/chat/completions"), answer)
    gate.leave(over=held.over)
