"""The pipeline's terminal: sends an attempt to its instance through the upstream client
(`gateway.upstream.clients`) and reads it up to the commit point.

Timeouts: the client enforces only `connect` (DNS, TCP and the TLS handshake of a new
connection). Every later phase is a `Deadline` of the process-wide `Watchdog`, moved forward as
the attempt progresses: no timer per request or per chunk.

Per pool, precomputed by the registry: the TLS context of its https:// instances (one object
per pool so connections are pooled per origin and context), and its credential header, which
replaces the clients' own keys (`strip_headers`).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from functools import partial
from typing import Final, Protocol

from yarl import URL

from gateway.core.outcome import Phase
from gateway.core.sse import event_boundary
from gateway.core.timeouts import AttemptTimeouts
from gateway.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    map_upstream_exception,
)
from gateway.pipeline.call import Call
from gateway.runtime import Clock
from gateway.upstream.instance import InstanceState
from gateway.upstream.response import ResponseHead, UpstreamResponse
from gateway.upstream.watchdog import Deadline, Watchdog, expired

# Bodies up to this size are read whole before the commit point (so a backend dying mid-body
# is still retryable); longer ones are relayed as they arrive.
WHOLE_BODY_LIMIT = 1024 * 1024
# How often a queued attempt whose first-byte wait ran out asks again whether to wait on.
PATIENCE_RECHECK_S = 0.25
# The routes whose answers are always a JSON object (a whole one: a 200 that is not one is
# broken); an audio route may answer plain text, subtitles, an unknown route anything.
_JSON_KINDS: Final = frozenset(("generation", "pooling", "utility"))
# How an event stream may begin: a field (an event's data or name, its id, a reconnection
# time), a comment (a keep-alive), a blank line, or the byte order mark the spec allows.
# The most of a stream's first event read before it is committed to (as the relay holds one).
MAX_FIRST_EVENT_BYTES: Final = 1024 * 1024
SSE_STARTS: Final = (b"data:", b"event:", b":", b"id:", b"retry:", b"\n", b"\r", b"\xef\xbb\xbf")


class UpstreamClient(Protocol):
    """What sends an attempt's request and hands back its head: the data plane's HTTP/1.1
    client (`upstream.h1.H1Client`), or a test's in-memory one. It bounds the wait for a
    free connection and the connect by `connect_s` each, and calls `on_sent` as the request
    is written; every later wait is the transport's deadline."""

    async def post(
        self,
        url: URL,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        query: str = "",
        connect_s: float,
        tls: ssl.SSLContext | bool,
        max_connections: int | None = None,
        max_idle: int | None = None,
        on_sent: Callable[[], None] | None = None,
        resend: bool = True,
        remember: bool = True,
    ) -> ResponseHead: ...


class _Progress:
    """An attempt's deadline as the attempt moves on: armed for the connect as it starts, moved
    to the first byte once the request is written (`sent`, the client's `on_sent`), waited on
    past that while the attempt is queued at a working engine (`_patient`). And the hold a long
    prompt puts on its instance's streams from then on (`held`: released when the attempt
    ends)."""

    __slots__ = ("call", "clock", "deadline", "held", "holds", "instance", "limit_s", "wait_s")

    def __init__(
        self,
        call: Call,
        instance: InstanceState,
        timeouts: AttemptTimeouts,
        connect_s: float,
        watchdog: Watchdog,
        clock: Clock,
        started_at: float,
    ) -> None:
        self.call = call
        self.instance = instance
        self.clock = clock
        wait_s = self.wait_s = timeouts.first_byte_s
        self.limit_s = timeouts.limit_s  # `timeouts.first_token_max`, when it bounds the wait
        # Until the request is written: the client bounds the wait for a free connection and
        # the connect by `connect_s` each; this only backs them up. The first byte's time
        # starts once the request is out (a wait for our own connection limit is not the
        # instance's slowness).
        self.deadline = watchdog.arm(
            call.cancellation,
            min(started_at + 2 * connect_s + wait_s, call.deadline),
            Phase.CONNECT,
            instance,
            started_at,
        )
        # A prompt whose prefill will pause the instance's streams longer than they tolerate:
        # their deadlines wait until its first byte (or its own deadline).
        self.holds = timeouts.pause_s > 0.0
        self.held = False

    def sent(self) -> None:
        """The request is written: its first byte's time starts now."""
        now = self.clock()
        deadline = self.deadline
        deadline.move(min(now + self.wait_s, self.call.deadline), Phase.FIRST_BYTE)
        deadline.waiting_since = now
        deadline.patience = partial(_patient, self.call, self.instance, now, self.wait_s)
        limit_s = self.limit_s
        if limit_s is not None:
            deadline.limit_at = now + limit_s
        if self.holds and not self.held:
            self.held = True
            self.instance.hold(now, deadline.at)
            deadline.holding = True


def _patient(
    call: Call, instance: InstanceState, sent_at: float, wait_s: float, now: float
) -> float | None:
    """Until when an attempt whose first-byte wait ran out waits on (`Deadline.patience`), or
    None. Queued is not stalled: the first-byte wait ran out while the attempt waits its turn
    at an engine that works through its queue, and no other instance could start it sooner.
    Leaving would only queue it again at the back elsewhere: it waits on (within the request's
    deadline), until another has room (then it moves there) or the engine goes quiet."""
    if (
        now < call.deadline
        and instance.serving_a_queue(now, sent_at, wait_s)
        and not call.pool.has_room(instance, now, call.avoid)
    ):
        return min(now + PATIENCE_RECHECK_S, call.deadline)
    return None


def _timed_out(deadline: Deadline, timeouts: AttemptTimeouts) -> UpstreamTimeout:
    """The error of an attempt whose `deadline` ran out. One cut by the pool's limit on the
    first byte (`timeouts.first_token_max`) names it, so that an operator tells the limit
    from a learned timeout (and from the request's own deadline, when that came first)."""
    phase = deadline.phase
    limit_s = timeouts.limit_s
    if phase == Phase.FIRST_BYTE and limit_s is not None and deadline.at >= deadline.limit_at:
        return UpstreamTimeout(
            f"no first token within timeouts.first_token_max ({limit_s:g}s)", phase=phase
        )
    return UpstreamTimeout(f"the upstream timed out ({phase})", phase=phase)


class Transport:
    """Sends one attempt and reads it up to the commit point."""

    def __init__(self, client: UpstreamClient, watchdog: Watchdog, clock: Clock) -> None:
        self._client = client
        self._watchdog = watchdog
        self._loop_time = clock

    async def __call__(self, call: Call) -> UpstreamResponse:
        instance = call.attempt.instance
        assert instance is not None, "the pick layer runs before the transport"
        timeouts = call.attempt.timeouts
        assert timeouts is not None, "the deadline layer runs before the transport"
        started_at = self._loop_time()
        pool = call.pool
        connect_s = pool.policy.timeouts.connect
        progress = _Progress(
            call, instance, timeouts, connect_s, self._watchdog, self._loop_time, started_at
        )
        deadline = progress.deadline
        sent = call.headers
        if pool.strip_headers:  # the pool's credential in place of the client's keys
            strip = pool.strip_headers
            sent = [h for h in sent if h[0] not in strip]
            sent += pool.credential_headers
        raw: ResponseHead | None = None
        translation = call.translation
        if translation is not None:
            sent = translation.headers(sent)
        try:
            raw = await self._client.post(
                instance.url_of(call.path if translation is None else translation.path),
                sent,
                call.body,
                query=call.query,  # as the client sent it
                connect_s=connect_s,
                tls=pool.ssl,
                max_connections=pool.policy.connections.max,
                max_idle=pool.policy.connections.max_idle,
                on_sent=progress.sent,
                # What could act twice is not sent again on a fresh connection after a kept
                # one dropped it (the stale keep-alive race: it may have been received).
                resend=not call.acts,
                # A route the gateway does not know: a path the client chose, not remembered.
                remember=call.route.kind != "other",
            )
            if translation is not None:  # read back in the client's API family
                raw = translation.wrap(raw)
            body, first, is_sse = await self._to_commit_point(raw, call, deadline)
            response = UpstreamResponse(
                instance,
                raw,
                body=body,
                first_chunk=first,
                is_sse=is_sse,
                deadline=deadline,
                watchdog=self._watchdog,
                started_at=started_at,
                clock=self._loop_time,
                route=call.route,
            )
            response.idle_guessed = timeouts.idle_guessed
            return response
        except asyncio.CancelledError:
            self._abandon(raw, deadline)
            if expired(deadline):
                raise _timed_out(deadline, timeouts) from None
            raise
        except UpstreamError:
            self._abandon(raw, deadline)
            raise  # the client's own, as it is (`from` itself would make a cycle)
        except Exception as exc:
            self._abandon(raw, deadline)
            raise map_upstream_exception(exc, phase=deadline.phase) from exc
        finally:
            if progress.held:
                instance.release_hold(self._loop_time())

    async def _to_commit_point(
        self, raw: ResponseHead, call: Call, deadline: Deadline
    ) -> tuple[bytes | None, bytes, bool]:
        """The answer read up to the commit point: a whole body up to `WHOLE_BODY_LIMIT`
        (then `first` is empty), else its first piece (a 200 event stream's: up to its first
        whole event); and whether it is an event stream the gateway may read and append to
        (uncompressed). Raises UpstreamProtocolError for a 200 the client would take for a
        success while it is broken (`refuse_unlike_json`, `first_event`)."""
        headers = raw.headers
        content_type = headers.get("content-type", "").lower()
        is_sse = content_type.startswith("text/event-stream")
        # Bytes the gateway can read: a compressed body is relayed as it comes, unchecked.
        plain = headers.get("content-encoding", "identity").lower() == "identity"
        is_sse = is_sse and plain
        length = raw.content_length
        # What the client would take for a success is checked before it is committed to
        # (in line: the answers that pass cost no call).
        checked = raw.status == 200 and call.route.protocol != "opaque" and plain
        if not is_sse and length is not None and length <= WHOLE_BODY_LIMIT:
            # A non-streamed answer's first byte is its whole body: same deadline.
            body = await raw.read()
            first = b""
            self._watchdog.disarm(deadline)
            if (
                checked
                and call.route.kind in _JSON_KINDS
                and not ("json" in content_type and body[:1] == b"{" and body[-1:] == b"}")
            ):
                refuse_unlike_json(body, content_type)
        else:
            body = None
            first = await raw.readany()
            if checked and is_sse and not (first.startswith(SSE_STARTS) and b"\n\n" in first):
                first = await first_event(raw, first)
        return body, first, is_sse

    def _abandon(self, raw: ResponseHead | None, deadline: Deadline) -> None:
        """Undo an attempt that failed before reaching the client."""
        self._watchdog.disarm(deadline)
        if raw is not None:
            raw.close()


def refuse_unlike_json(body: bytes, content_type: str) -> None:
    """A 200 whole answer of a JSON route that does not look like the JSON it must be: cut
    short, empty, or something else (a proxy's HTML error page). Raised as the upstream's
    protocol failure, before the client takes it for a success: the pool's retry policy and
    its fallbacks handle it as any broken attempt. Only its type and its ends are read (a
    parse would cost more than the rest of the answer's way through the gateway); whitespace
    around it is allowed, and so is an array (some servers answer a rerank or a tokenize
    with one)."""
    if "json" not in content_type:
        raise UpstreamProtocolError(
            f"the upstream answered 200 with {content_type or 'no content type'!r}, not JSON"
        )
    stripped = body.strip()
    if not (
        (stripped.startswith(b"{") and stripped.endswith(b"}"))
        or (stripped.startswith(b"[") and stripped.endswith(b"]"))
    ):
        what = "an empty body" if not stripped else "a body that is not a whole JSON object"
        raise UpstreamProtocolError(f"the upstream answered 200 with {what}")


async def first_event(raw: ResponseHead, first: bytes) -> bytes:
    """A 200 event stream's bytes up to its first whole event (`first`: its first piece), read
    within the attempt's first-byte deadline, which they are part of: a stream is committed to
    only once it got going. One that drips in a byte at a time runs out of that time and is
    retried or handed over, like one that sent nothing; one that does not begin as an event
    stream is the upstream's protocol failure. An upstream that ends (or sends more than an
    event may hold) before a whole event is left to the relay, which treats it as a stream cut
    short."""
    held = bytearray(first)
    while not event_boundary(held, max(0, len(held) - len(first) - 3)):
        if len(held) > MAX_FIRST_EVENT_BYTES:
            break
        first = await raw.readany()
        if not first:
            break
        held += first
    if held and not held.startswith(SSE_STARTS):
        raise UpstreamProtocolError("the upstream's 200 event stream does not begin with an event")
    return bytes(held)
