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
logs it once, and reconnects with a capped, jittered backoff; a new session re-writes our own
decisions and re-reads everyone's, so a Redis restarted empty or flushed is whole again within
a TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff, NoBackoff
from redis.exceptions import RedisError

from gateway.cluster.probe_leases import RELEASE_IF_OURS, ProbeLeases
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


_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 1.0
_LISTEN_POLL_S = 1.0  # how long one pub/sub read waits before looping (no cost when idle)
_FAILURES = (RedisError, OSError, TimeoutError, ConnectionError)


def _raise_if_cancelled() -> None:
    """Stop a loop whose cancellation a library call swallowed (redis-py's pub/sub read can
    return normally when cancelled at the wrong moment): otherwise closing could wait forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def redact(url: str) -> str:
    """The Redis URL without its password, for logs and /admin/state."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


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
        self._url = redact(policy.redis_url)
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
        self._first_attempt = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Typed in some redis releases, untyped in others: a typed name for both.
        no_backoff: Callable[[], AbstractBackoff] = NoBackoff
        self._client = Redis.from_url(
            policy.redis_url,
            socket_timeout=policy.timeout,
            socket_connect_timeout=policy.timeout,
            retry=Retry(no_backoff(), 0),
            retry_on_error=[],
            health_check_interval=0,
        )
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
        self.connected = False
        self._changed_at: float | None = None
        self._last_error: str | None = None
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
                "connection_losses",
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
            "connected": self.connected,
            "url": self._url,
            "replica": self.replica,
            "pubsub": self._policy.pubsub,
            "since": self._changed_at,
            "last_error": self._last_error,
            "own_isolations": sorted(f"{p}/{i}" for p, i in self._own),
            "probe_leases": self._leases.held(),
            "counters": {**self.counters, "leases_acquired": self._leases.acquired},
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
        self._leases.follow(registry, self.connected)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect in the background; wait (bounded) for the first attempt, so that a replica
        that starts with Redis up knows the others' decisions before it serves."""
        self._task = asyncio.get_running_loop().create_task(self._run())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.5, 10 * self._timeout_s)):
                await self._first_attempt.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.connected:
            # Hand back our probe leases so another replica need not wait for them to lapse.
            with contextlib.suppress(*_FAILURES):
                async with asyncio.timeout(self._timeout_s * 2):
                    await self._leases.release_all()
        with contextlib.suppress(*_FAILURES):
            async with asyncio.timeout(self._timeout_s * 2):
                await self._client.aclose()

    # -- the session -------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: decide alone, reconnect
                if self._disconnected(exc):
                    backoff = _BACKOFF_MIN_S  # a working session ended: try again soon
            self._first_attempt.set()
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _session(self) -> None:
        pubsub: PubSub | None = None
        try:
            async with asyncio.timeout(self._timeout_s * 4):
                await self._client.ping()
                if self._policy.pubsub:
                    pubsub = self._client.pubsub()
                    await pubsub.subscribe(self._channel)
            await self._resync()
            self._connected()
            self._first_attempt.set()
            tasks = [asyncio.ensure_future(self._work())]
            if pubsub is not None:
                tasks.append(asyncio.ensure_future(self._listen(pubsub)))
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in done:
                task.result()  # re-raise what ended the session
        finally:
            if pubsub is not None:
                with contextlib.suppress(*_FAILURES):
                    async with asyncio.timeout(self._timeout_s):
                        # Typed from redis 8.2 on, untyped before: a typed name for both.
                        close: Callable[[], Awaitable[None]] = pubsub.aclose
                        await close()

    def _connected(self) -> None:
        self.connected = True
        self._changed_at = self._clock()
        self._last_error = None
        self._leases.coordinate()
        log.warning(
            "shared state: connected to %s as %s (pub/sub %s)",
            self._url,
            self.replica,
            "on" if self._policy.pubsub else "off",
        )

    def _disconnected(self, exc: BaseException) -> bool:
        """Decide alone from now on; whether we had been connected."""
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        was = self.connected
        self.connected = False
        self._leases.alone()
        if was or self._changed_at is None:
            self.counters["connection_losses"] += int(was)
            self._changed_at = self._clock()
            log.warning(
                "shared state: %s %s (%s); deciding locally, reconnecting in the background",
                "lost" if was else "cannot reach",
                self._url,
                error,
            )
        self._last_error = error
        return was

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
            _raise_if_cancelled()
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

    async def _listen(self, pubsub: PubSub) -> None:
        while True:
            _raise_if_cancelled()
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=_LISTEN_POLL_S
            )
            if message is not None and message.get("type") == "message":
                self.counters["received"] += 1
                self._take(message["data"], self._ttl_s)

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
