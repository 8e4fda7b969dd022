"""A replica's connection to Redis for shared decisions, kept up in the background.

Sessions run one after another. Each connects (a PING, and the channel's subscription when
pub/sub is on), lets its owner catch up (`resync`), then runs the owner's work and hands it the
channel's messages until either fails. Any failure ends the session: the replica is then
"disconnected", decides alone (every breaker may probe on its own again), logs it once, and
reconnects with a capped, jittered backoff.

Every call is bounded by `shared.timeout` and never retried by the client (redis-py's default
retries would turn a dead Redis into seconds per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff, NoBackoff
from redis.exceptions import RedisError

from gateway.cluster.probe_leases import ProbeLeases
from gateway.config.models import SharedPolicy

log = logging.getLogger("gateway.shared")

_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 1.0
_LISTEN_POLL_S = 1.0  # how long one pub/sub read waits before looping (no cost when idle)
FAILURES = (RedisError, OSError, TimeoutError, ConnectionError)


def raise_if_cancelled() -> None:
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


def new_client(policy: SharedPolicy) -> Redis:
    """A client whose every call is bounded by `shared.timeout`, with no retries of its own."""
    # Typed in some redis releases, untyped in others: a typed name for both.
    no_backoff: Callable[[], AbstractBackoff] = NoBackoff
    return Redis.from_url(
        policy.redis_url,
        socket_timeout=policy.timeout,
        socket_connect_timeout=policy.timeout,
        retry=Retry(no_backoff(), 0),
        retry_on_error=[],
        health_check_interval=0,
    )


class RedisLink:
    """The sessions with Redis, one after another, and whether one is up (`connected`, since
    when, the last error). `resync`: what a new session does first; `work`: what it runs
    then; `on_message`: a message from the channel. Connected, probes need the lease
    (`ProbeLeases.coordinate`); alone, none does."""

    def __init__(
        self,
        client: Redis,
        policy: SharedPolicy,
        channel: str,
        replica: str,
        leases: ProbeLeases,
        *,
        resync: Callable[[], Awaitable[None]],
        work: Callable[[], Awaitable[None]],
        on_message: Callable[[bytes], None],
    ) -> None:
        self._client = client
        self._policy = policy
        self._timeout_s = policy.timeout
        self._channel = channel
        self._replica = replica
        self._leases = leases
        self._resync = resync
        self._work = work
        self._on_message = on_message
        self._clock = asyncio.get_running_loop().time
        self._first_attempt = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.url = redact(policy.redis_url)
        self.connected = False
        self.since: float | None = None  # when it last connected or lost the connection
        self.last_error: str | None = None
        self.losses = 0  # sessions that were up and ended

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
            with contextlib.suppress(*FAILURES):
                async with asyncio.timeout(self._timeout_s * 2):
                    await self._leases.release_all()
        with contextlib.suppress(*FAILURES):
            async with asyncio.timeout(self._timeout_s * 2):
                await self._client.aclose()

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
                with contextlib.suppress(*FAILURES):
                    async with asyncio.timeout(self._timeout_s):
                        # Typed from redis 8.2 on, untyped before: a typed name for both.
                        close: Callable[[], Awaitable[None]] = pubsub.aclose
                        await close()

    async def _listen(self, pubsub: PubSub) -> None:
        while True:
            raise_if_cancelled()
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=_LISTEN_POLL_S
            )
            if message is not None and message.get("type") == "message":
                self._on_message(message["data"])

    def _connected(self) -> None:
        self.connected = True
        self.since = self._clock()
        self.last_error = None
        self._leases.coordinate()
        log.warning(
            "shared state: connected to %s as %s (pub/sub %s)",
            self.url,
            self._replica,
            "on" if self._policy.pubsub else "off",
        )

    def _disconnected(self, exc: BaseException) -> bool:
        """Decide alone from now on; whether we had been connected."""
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        was = self.connected
        self.connected = False
        self._leases.alone()
        if was or self.since is None:
            self.losses += int(was)
            self.since = self._clock()
            log.warning(
                "shared state: %s %s (%s); deciding locally, reconnecting in the background",
                "lost" if was else "cannot reach",
                self.url,
                error,
            )
        self.last_error = error
        return was
