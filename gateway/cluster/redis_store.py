"""Isolation decisions shared between replicas through Redis, never on the request path.

The request path only reads breakers in memory and, on a transition, drops a note in an outbox
(`record`). One background session does all the Redis work:

- **publish**: each own transition is written to `{prefix}:decision:{pool}:{instance}` (an
  isolation: SET with a TTL of `decision_ttl`; a restore: DEL) and published on
  `{prefix}:decisions`, as soon as it happens;
- **listen**: messages on the channel from other replicas are applied at once
  (`gateway.core.decision.apply_remote`: capped by the pool's guard, last writer wins);
- **refresh**, every `decision_ttl / 3`: our own isolations are renewed, and every decision key
  of our pools is read back (the backstop when a message was missed, or pub/sub is off). An
  isolation we adopted whose key is gone (restored, or expired: its replica stopped renewing)
  is lifted here;
- **probe lease** (`gateway.cluster.probe_leases`): an isolation that is due is probed by the
  one replica holding its short lease, not by every replica at once.

Every call is bounded by `shared.timeout` and never retried by the client (redis-py's default
retries would turn a dead Redis into seconds per call). Any failure ends the session: the
replica is then "disconnected", decides alone (every breaker may probe on its own again),
logs it once, and reconnects with a capped, jittered backoff (`gateway.cluster.redis_link`
keeps the sessions going); a new session re-writes our own decisions and re-reads everyone's,
so a Redis restarted empty or flushed is whole again within a TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from gateway.cluster.probe_leases import RELEASE_IF_OURS, ProbeLeases
from gateway.cluster.redis_link import RedisLink, new_client, raise_if_cancelled
from gateway.cluster.store import Key, TransitionLog, instance_keys
from gateway.config.models import SharedPolicy
from gateway.core.breaker import ADMITTING, ISOLATED, Transition
from gateway.core.decision import (
    Decision,
    MalformedDecision,
    Marks,
    apply_remote,
    decode,
    withdraw,
)
from gateway.core.decision import from_transition as decision_for
from gateway.upstream.registry import Registry

log = logging.getLogger("gateway.shared")


class RedisDecisions:
    def __init__(
        self,
        policy: SharedPolicy,
        registry: Registry,
        replica: str,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.replica = replica
        self._log = TransitionLog()
        self._policy = policy
        self._ttl_s = policy.decision_ttl
        self._ttl_ms = max(1, round(policy.decision_ttl * 1000))
        self._timeout_s = policy.timeout
        self._refresh_s = policy.decision_ttl / 3
        self._tick_s = min(0.1, policy.decision_ttl / 10)
        self._channel = f"{policy.key_prefix}:decisions"
        self._wall = wall
        self._clock = asyncio.get_running_loop().time
        self._pools = registry.pools
        self._breakers, self._decision_keys = instance_keys(registry, policy.key_prefix, "decision")
        self._marks: dict[Key, Marks] = {key: Marks() for key in self._breakers}
        self._own: dict[Key, bytes] = {}  # our isolations in force, encoded, to renew
        self._outbox: dict[Key, Decision] = {}  # our transitions not yet written
        self._retract: dict[Key, bytes] = {}  # our lifted isolations to delete if still ours
        self._heard: dict[Key, float] = {}  # when we last applied an isolation, per instance
        self._advised: dict[Key, float] = {}  # when we last shared a trip kept admitting
        self._wake = asyncio.Event()
        self._client = new_client(policy)
        self._release = self._client.register_script(RELEASE_IF_OURS)
        self._leases = ProbeLeases(
            self._client,
            registry,
            replica,
            policy.key_prefix,
            lease_s=policy.decision_ttl / 3,
            tick_s=self._tick_s,
            timeout_s=policy.timeout,
        )
        self._link = RedisLink(
            self._client,
            policy,
            self._channel,
            replica,
            self._leases,
            resync=self._resync,
            work=self._work,
            on_message=self._heard_on_channel,
        )
        self.counters = dict.fromkeys(
            (
                "published",
                "received",
                "adopted",
                "lifted",
                "withdrawn",
                "suppressed",
                "stale_or_unchanged",
                "malformed",
                "unknown_instance",
                "refreshes",
            ),
            0,
        )
        self._bad_logged: set[str] = set()

    # -- the request path ------------------------------------------------------------------

    def record(self, pool: str, transition: Transition, operator: bool = False) -> None:
        self._log.write(pool, transition)
        if transition.suppressed:
            self._advise(pool, transition)
            return
        decision = decision_for(
            pool, transition, self.replica, self._wall(), self._clock(), operator
        )
        if decision is None:
            return
        key = (pool, transition.instance)
        if key not in self._marks:
            return
        self._marks[key].own(decision)
        if decision.state == ISOLATED:
            self._own[key] = decision.encode()
        else:
            self._own.pop(key, None)
        self._retract.pop(key, None)
        self._outbox[key] = decision
        self._wake.set()

    def _advise(self, pool: str, transition: Transition) -> None:
        """Share a trip that a pool of one keeps admitting (a sidecar never isolates its only
        instance): the other replicas, with larger pools, may well take it out. Not renewed:
        each further failure shares it again (at most every `decision_ttl / 3`), and once the
        failures stop it fades from every replica within `decision_ttl`."""
        state = self._pools.get(pool)
        key = (pool, transition.instance)
        if state is None or state.breakers.cap != 0 or key not in self._marks:
            return
        now = self._clock()
        if now - self._advised.get(key, -math.inf) < self._refresh_s:
            return
        self._advised[key] = now
        wall = self._wall()
        decision = Decision(
            pool,
            transition.instance,
            ISOLATED,
            transition.reason.replace("(suppressed: cap)", "(the only instance here)"),
            self.replica,
            wall,
            wall + state.policy.breaker.isolation,
        )
        self._marks[key].own(decision)
        self._outbox[key] = decision
        self._wake.set()

    def decided_by(self, pool: str, instance: str) -> str | None:
        marks = self._marks.get((pool, instance))
        breaker = self._breakers.get((pool, instance))
        if marks is None or breaker is None or breaker.state == ADMITTING:
            return None
        return marks.decided_by

    def status(self) -> dict[str, Any]:
        return {
            "configured": True,
            "connected": self._link.connected,
            "url": self._link.url,
            "replica": self.replica,
            "pubsub": self._policy.pubsub,
            "since": self._link.since,
            "last_error": self._link.last_error,
            "own_isolations": sorted(f"{p}/{i}" for p, i in self._own),
            "probe_leases": self._leases.held(),
            "counters": {
                **self.counters,
                "connection_losses": self._link.losses,
                "leases_acquired": self._leases.acquired,
            },
        }

    def follow(self, registry: Registry) -> None:
        """The pools and instances of a reloaded policy (a synchronous step): instances kept
        keep their marks and our isolations of them; new ones start with none (and need the
        probe lease while connected); dropped ones are forgotten (their keys expire)."""
        breakers, keys = instance_keys(registry, self._policy.key_prefix, "decision")
        self._breakers, self._decision_keys = breakers, keys
        self._marks = {key: self._marks.get(key) or Marks() for key in breakers}
        for table in (self._own, self._outbox, self._retract, self._heard, self._advised):
            for key in [key for key in table if key not in breakers]:
                del table[key]
        self._leases.follow(registry, self._link.connected)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether a session with Redis is up: decisions are shared."""
        return self._link.connected

    async def start(self) -> None:
        """Connect in the background; wait (bounded) for the first attempt, so that a replica
        that starts with Redis up knows the others' decisions before it serves."""
        await self._link.start()

    async def close(self) -> None:
        await self._link.close()

    # -- the session (`RedisLink` runs it) ---------------------------------------------------

    async def _resync(self) -> None:
        """A new session: write what we decided (Redis may be new, flushed, or have missed
        our writes), then read what the others decided."""
        pending = dict(self._outbox)
        self._outbox.clear()
        for key, encoded in self._own.items():
            if key not in pending:
                pending[key] = decode(encoded)
        try:
            await self._write(pending)
        except BaseException:
            for key, decision in pending.items():
                self._outbox.setdefault(key, decision)
            raise
        await self._refresh()

    # -- the work ------------------------------------------------------------------------------

    async def _work(self) -> None:
        next_refresh = self._clock() + self._refresh_s
        while True:
            raise_if_cancelled()
            wait_s = max(0.0, min(self._tick_s, next_refresh - self._clock()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._wake.wait()
            self._wake.clear()
            if self._outbox:
                batch, self._outbox = self._outbox, {}
                try:
                    await self._write(batch)
                except BaseException:
                    for key, decision in batch.items():
                        self._outbox.setdefault(key, decision)
                    raise
            if self._retract:
                await self._retract_lifted()
            await self._leases.tend()
            if self._clock() >= next_refresh:
                await self._refresh()
                next_refresh = self._clock() + self._refresh_s

    async def _write(self, batch: dict[Key, Decision]) -> None:
        if not batch:
            return
        pipe = self._client.pipeline(transaction=False)
        for key, decision in batch.items():
            encoded = decision.encode()
            if decision.state == ISOLATED:
                pipe.set(self._decision_keys[key], encoded, px=self._ttl_ms)
            else:
                pipe.delete(self._decision_keys[key])
            if self._policy.pubsub:
                pipe.publish(self._channel, encoded)
        async with asyncio.timeout(self._timeout_s * 2):
            await pipe.execute()
        self.counters["published"] += len(batch)

    async def _retract_lifted(self) -> None:
        """Delete our lifted isolations' keys, if no one has written a newer decision since."""
        batch, self._retract = self._retract, {}
        async with asyncio.timeout(self._timeout_s * 2):
            for key, encoded in batch.items():
                await self._release(keys=[self._decision_keys[key]], args=[encoded])

    async def _refresh(self) -> None:
        """Renew our isolations and read every decision about our instances (the backstop)."""
        started = self._clock()
        pipe = self._client.pipeline(transaction=False)
        own = list(self._own.items())
        for key, encoded in own:
            pipe.set(self._decision_keys[key], encoded, px=self._ttl_ms)
        keys = list(self._decision_keys.items())
        for _, name in keys:
            pipe.get(name)
            pipe.pttl(name)
        async with asyncio.timeout(self._timeout_s * 2):
            results = await pipe.execute()
        self.counters["refreshes"] += 1
        reads = results[len(own) :]
        for index, (key, _) in enumerate(keys):
            raw, pttl = reads[2 * index], reads[2 * index + 1]
            if raw is None:
                if self._heard.get(key, -math.inf) < started:  # not adopted since we read
                    self._withdrawn(key)
                continue
            trusted_s = self._ttl_s if not isinstance(pttl, int) or pttl < 0 else pttl / 1000
            self._take(raw, min(trusted_s, self._ttl_s), expected=key)

    def _heard_on_channel(self, raw: bytes) -> None:
        self.counters["received"] += 1
        self._take(raw, self._ttl_s)

    # -- applying the others' decisions ----------------------------------------------------------

    def _take(self, raw: bytes, trusted_s: float, expected: Key | None = None) -> None:
        try:
            decision = decode(raw)
        except MalformedDecision as exc:
            self._bad("malformed", f"ignoring a malformed shared decision: {exc}")
            return
        if decision.replica == self.replica:
            return
        key = (decision.pool, decision.instance)
        if expected is not None and key != expected:
            self._bad("malformed", f"ignoring a decision about {key} stored under {expected}")
            return
        breaker = self._breakers.get(key)
        if breaker is None:
            self.counters["unknown_instance"] += 1  # another deployment's pool: not ours
            return
        marks = self._marks[key]
        transition = apply_remote(breaker, marks, decision, self._clock(), self._wall(), trusted_s)
        if marks.decided_by is not None:
            self._own.pop(key, None)  # a newer isolation than ours holds it: theirs to renew
            if decision.state == ISOLATED:
                self._heard[key] = self._clock()
        if transition is None:
            self.counters["stale_or_unchanged"] += 1
            return
        self._log.write(decision.pool, transition)
        if transition.suppressed:
            self.counters["suppressed"] += 1
        elif transition.to == ISOLATED:
            self.counters["adopted"] += 1
        else:
            self.counters["lifted"] += 1
            # An operator's restore elsewhere vouches for it: no slow start, as there.
            self._back_in_traffic(key, ramp=not (decision.state == ADMITTING and decision.forced))
            encoded = self._own.pop(key, None)
            if encoded is not None:
                self._retract[key] = encoded
                self._outbox.pop(key, None)
                self._wake.set()

    def _withdrawn(self, key: Key) -> None:
        transition = withdraw(self._breakers[key], self._marks[key], self._clock())
        if transition is not None:
            self._log.write(key[0], transition)
            self.counters["withdrawn"] += 1
            self._back_in_traffic(key)

    def _back_in_traffic(self, key: Key, ramp: bool = True) -> None:
        """Another replica's isolation of it no longer holds: it takes traffic here again."""
        pool = self._pools[key[0]]
        instance = pool.instance_named(key[1])
        if instance is not None:
            pool.rejoined(instance, self._clock(), ramp)
        pool.capacity_changed()

    def _bad(self, counter: str, message: str) -> None:
        self.counters[counter] += 1
        if message not in self._bad_logged and len(self._bad_logged) < 100:
            self._bad_logged.add(message)
            log.warning("shared state: %s", message)
