"""The Redis decision store in-process: two or three replicas' stores on one real redis-server.

These drive the stores directly (no HTTP), so they can look at the breakers they act on.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from gateway.cluster.redis_link import redact
from gateway.cluster.redis_store import RedisDecisions
from gateway.config import parse_policy
from gateway.core.balancer import DEFAULT_RTT_S
from gateway.core.breaker import ADMITTING, ISOLATED, PROBING, BreakerState
from gateway.core.decision import Decision, decode
from gateway.upstream.registry import Registry
from loadtests.redis_server import RedisServer

RNG = random.Random(5)
TTL_S = 1.0


def policy_text(
    redis_url: str, ttl_s: float = TTL_S, pubsub: bool = True, isolation_s: float = 1.0
) -> str:
    return f"""
shared: {{redis_url: "{redis_url}", key_prefix: t, decision_ttl: {ttl_s}s,
          pubsub: {str(pubsub).lower()}}}
pools:
  p:
    models: [m]
    instances:
      - {{name: a, url: "http://127.0.0.1:9"}}
      - {{name: b, url: "http://127.0.0.1:9"}}
      - {{name: c, url: "http://127.0.0.1:9"}}
      - {{name: d, url: "http://127.0.0.1:9"}}
    breaker: {{isolation: {isolation_s}s, max_isolation: {2 * isolation_s}s,
              max_isolated_fraction: 0.5}}
"""


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


class Replica:
    def __init__(self, text: str, name: str) -> None:
        policy = parse_policy(text)
        assert policy.shared is not None
        now = asyncio.get_running_loop().time()
        self.registry = Registry(policy, now=now)
        for inst in self.registry.pools["p"].instances:  # as after the first health checks
            inst.health.record(now, True, "HTTP 200")
        self.registry.pools["p"].refresh_routable()
        self.store = RedisDecisions(policy.shared, self.registry, name)

    def breaker(self, instance: str) -> BreakerState:
        return self.registry.pools["p"].breakers[instance]

    def trip(self, instance: str) -> None:
        now = asyncio.get_running_loop().time()
        transition = self.breaker(instance).isolate(now, RNG, "3 consecutive timeouts", False)
        assert transition is not None
        self.store.record("p", transition)


async def eventually(predicate: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    """Let the stores' background work run until `predicate` holds (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.005)
    return predicate()


async def refreshes_until(replica: Replica, predicate: Callable[[], bool]) -> int:
    """Let the stores run until `predicate` holds (bounded); the replica's count of key reads
    then, which includes the read that made it hold."""
    assert await eventually(predicate, timeout_s=10)
    return replica.store.counters["refreshes"]


@contextlib.asynccontextmanager
async def started_replicas(
    text: str, count: int = 3, idle: tuple[int, ...] = ()
) -> AsyncIterator[list[Replica]]:
    """Started stores; all but the `idle` ones see traffic (only those compete to probe)."""
    started = [Replica(text, f"r{i}") for i in range(count)]
    await asyncio.gather(*(r.store.start() for r in started))
    busy = [r for i, r in enumerate(started) if i not in idle]
    traffic = asyncio.get_running_loop().create_task(serve(busy))
    try:
        yield started
    finally:
        traffic.cancel()
        async with asyncio.timeout(5):
            await asyncio.gather(*(r.store.close() for r in started))


async def serve(replicas: list[Replica]) -> None:
    """Stand-in for requests: the attempt counters move, as they do on a replica in service."""
    while True:
        for replica in replicas:
            replica.registry.pools["p"].instances[-1].requests += 1
        await asyncio.sleep(0.05)


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[list[Replica]]:
    async with started_replicas(policy_text(redis_server.url)) as started:
        # A start that times out on a busy machine decides locally and reconnects in the
        # background; the tests below are about replicas that share, so wait for that.
        assert await eventually(lambda: all(r.store.connected for r in started), timeout_s=15)
        yield started


async def test_an_isolation_and_its_restore_reach_every_replica(
    replicas: list[Replica], redis_server: RedisServer
) -> None:
    r0, r1, r2 = replicas
    r0.trip("a")
    assert await eventually(
        lambda: r1.breaker("a").state == ISOLATED and r2.breaker("a").state == ISOLATED
    )
    assert r1.store.decided_by("p", "a") == "r0"
    stored = redis_server.client().get("t:decision:p:a")
    assert stored is not None
    decision = decode(stored)
    assert (decision.state, decision.replica, decision.forced) == ("ISOLATED", "r0", False)
    assert 0 < redis_server.client().pttl("t:decision:p:a") <= 1000
    # The operator restores it on r0: every replica admits it again, and the key is gone.
    now = asyncio.get_running_loop().time()
    restore = r0.breaker("a").restore(now)
    assert restore is not None
    r0.store.record("p", restore, operator=True)
    assert await eventually(
        lambda: r1.breaker("a").state == ADMITTING and r2.breaker("a").state == ADMITTING
    )
    assert redis_server.client().get("t:decision:p:a") is None


async def test_one_replica_at_a_time_holds_the_probe(replicas: list[Replica]) -> None:
    r0 = replicas[0]
    r0.trip("b")
    assert await eventually(lambda: all(r.breaker("b").state == ISOLATED for r in replicas))
    # The isolation (1 s, ±10 %) falls due everywhere; exactly one replica may probe.
    loop = asyncio.get_running_loop()

    def may_probe(r: Replica) -> bool:
        b = r.breaker("b")
        return b.isolated_until <= loop.time() < b.lease_until

    assert await eventually(lambda: any(may_probe(r) for r in replicas), timeout_s=3)
    now = loop.time()
    admitted = [r for r in replicas if r.breaker("b").try_admit(now)]
    assert len(admitted) == 1
    prober = admitted[0]
    assert prober.breaker("b").state == PROBING
    # The others keep it out while the probe runs, even well past the isolation's end...
    await asyncio.sleep(0.5)
    now = loop.time()
    assert [r.breaker("b").try_admit(now) for r in replicas if r is not prober] == [False, False]
    # ...and the probe's success lifts it everywhere.
    transition = prober.breaker("b").record(now, False, False, RNG, probe=True)
    assert transition is not None and transition.to == ADMITTING
    prober.store.record("p", transition)
    assert await eventually(lambda: all(r.breaker("b").state == ADMITTING for r in replicas))


async def test_a_replica_without_traffic_leaves_the_probe_to_the_others(
    redis_server: RedisServer,
) -> None:
    async with started_replicas(policy_text(redis_server.url), count=2, idle=(0,)) as replicas:
        idle, busy = replicas
        await asyncio.sleep(1.2)  # past the start-up, when every pool counts as busy
        idle.trip("a")
        loop = asyncio.get_running_loop()
        assert await eventually(
            lambda: busy.breaker("a").isolated_until <= loop.time() < busy.breaker("a").lease_until
        )
        assert idle.store.status()["counters"]["leases_acquired"] == 0


async def test_a_failed_probe_isolates_everywhere_again(redis_server: RedisServer) -> None:
    # Isolations of 2 s, then 4 s: longer than the TTL, so the others must keep re-reading.
    async with started_replicas(policy_text(redis_server.url, isolation_s=2.0)) as replicas:
        replicas[0].trip("c")
        loop = asyncio.get_running_loop()
        assert await eventually(
            lambda: any(
                r.breaker("c").isolated_until <= loop.time() < r.breaker("c").lease_until
                for r in replicas
            ),
            timeout_s=5,
        )
        prober = next(r for r in replicas if r.breaker("c").try_admit(loop.time()))
        transition = prober.breaker("c").record(loop.time(), True, True, RNG, probe=True)
        assert transition is not None and transition.to == ISOLATED
        prober.store.record("p", transition)
        until = transition.until
        assert until is not None and until - loop.time() > TTL_S + 0.5
        # The others hold it as long as the prober does, by re-reading its renewed decision.
        await asyncio.sleep(until - loop.time() - 0.3)
        now = loop.time()
        assert all(r.breaker("c").isolated_until > now for r in replicas)
        assert not any(r.breaker("c").try_admit(now) for r in replicas)


async def test_forged_decisions_cannot_isolate_more_than_the_cap(
    replicas: list[Replica], redis_server: RedisServer
) -> None:
    client = redis_server.client()
    wall = __import__("time").time()
    for name in "abcd":
        forged = Decision("p", name, "ISOLATED", "forged", "intruder", wall, wall + 3600)
        client.set(f"t:decision:p:{name}", forged.encode(), px=10_000)
        client.publish("t:decisions", forged.encode())
    client.publish("t:decisions", b"{not json")
    r0 = replicas[0]
    assert await eventually(lambda: r0.store.counters["suppressed"] >= 2)
    states = [r0.breaker(n).state for n in "abcd"]
    assert states.count(ISOLATED) == 2 and states.count(ADMITTING) == 2
    assert r0.store.counters["malformed"] >= 1
    # The backstop re-reads the keys: still capped.
    refreshes = r0.store.counters["refreshes"]
    assert await eventually(lambda: r0.store.counters["refreshes"] > refreshes)
    assert [r0.breaker(n).state for n in "abcd"].count(ISOLATED) == 2


async def test_without_pubsub_the_key_reads_carry_decisions(redis_server: RedisServer) -> None:
    text = policy_text(redis_server.url, pubsub=False)
    r0, r1 = Replica(text, "r0"), Replica(text, "r1")
    await asyncio.gather(r0.store.start(), r1.store.start())
    try:
        loop = asyncio.get_running_loop()
        reads = r1.store.counters["refreshes"]
        r0.trip("a")
        adopted = await refreshes_until(r1, lambda: r1.breaker("a").state == ISOLATED)
        # Read back at r1's next read of the keys (one may have been under way as r0 wrote).
        assert adopted - reads <= 2
        assert r1.store.counters["received"] == 0
        # What r1's balancer remembers of a's slowness goes with the isolation.
        a = r1.registry.pools["p"].instance_named("a")
        assert a is not None
        a.price.peak.observe(loop.time(), 8.0)
        # The restore deletes the key: the next read lifts the isolation.
        restore = r0.breaker("a").restore(loop.time())
        assert restore is not None
        reads = r1.store.counters["refreshes"]
        r0.store.record("p", restore, operator=True)
        lifted = await refreshes_until(r1, lambda: r1.breaker("a").state == ADMITTING)
        assert lifted - reads <= 2
        assert r1.store.counters["withdrawn"] == 1
        # Priced as its peers are (the initial guess, decaying), not at its 8 s.
        assert a.price.peak.peek(loop.time()) < DEFAULT_RTT_S
    finally:
        await asyncio.gather(r0.store.close(), r1.store.close())


async def test_an_isolation_nobody_renews_expires_everywhere(redis_server: RedisServer) -> None:
    text = policy_text(redis_server.url, isolation_s=30.0)
    r0, r1 = Replica(text, "r0"), Replica(text, "r1")
    await asyncio.gather(r0.store.start(), r1.store.start())
    try:
        r0.trip("a")
        assert await eventually(lambda: r1.breaker("a").state == ISOLATED)
        await r0.store.close()  # r0 dies: nobody renews its 30 s isolation
        # Lifted long before those 30 s: the key expired (its TTL) and r1's next read found
        # it gone.
        assert await eventually(lambda: r1.breaker("a").state == ADMITTING, timeout_s=15)
        assert r1.store.counters["withdrawn"] == 1
        assert redis_server.client().get("t:decision:p:a") is None
    finally:
        await asyncio.gather(r0.store.close(), r1.store.close())


async def test_without_redis_every_replica_decides_alone(redis_server: RedisServer) -> None:
    r0 = Replica(policy_text(redis_server.url), "r0")
    await r0.store.start()
    try:
        assert r0.breaker("a").lease_until == 0.0  # connected: probes need the lease
        redis_server.kill()
        assert await eventually(lambda: not r0.store.connected)
        assert r0.breaker("a").lease_until == float("inf")  # alone: probe freely
        status = r0.store.status()
        assert status["connected"] is False and status["last_error"]
        assert status["counters"]["connection_losses"] == 1
        # Decisions made meanwhile are written once Redis is back (empty).
        r0.trip("a")
        redis_server.start()
        assert await eventually(lambda: r0.store.connected, timeout_s=5)
        assert await eventually(lambda: redis_server.client().get("t:decision:p:a") is not None)
    finally:
        await r0.store.close()


async def test_the_store_never_waits_long_for_an_unreachable_redis() -> None:
    text = policy_text("redis://127.0.0.1:9/0")  # discard port: nothing listens
    replica = Replica(text, "r0")
    await replica.store.start()
    try:
        # start() came back with the first attempt failed and known, not waiting for Redis.
        assert not replica.store.connected
        assert replica.store.status()["last_error"]
        replica.trip("a")  # recorded, queued: no error, no wait
        assert replica.breaker("a").lease_until == float("inf")
    finally:
        await replica.store.close()


def test_redis_url_passwords_are_redacted() -> None:
    assert redact("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact("redis://user:s3cret@host/0") == "redis://user:***@host/0"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"
