"""Sending responses to the client: the gateway's own, and upstream ones past the commit point."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.core.continuation import Rewriter, Transcript
from gateway.core.sse import event_boundary, split_events
from gateway.errors import (
    GatewayError,
    MethodNotAllowed,
    UpstreamError,
    UpstreamLeft,
    UpstreamProtocolError,
    UpstreamStreamCut,
    UpstreamStreamError,
    shutting_down,
)
from gateway.ingress.dialect import OPENAI, Dialect
from gateway.ingress.headers import response_headers
from gateway.ingress.resume import PACE_WINDOW, SLOW_WINDOWS, Continue, StreamResume
from gateway.ingress.streams import OpenStream, OpenStreams, ended_by_drain
from gateway.ingress.writer import BodyWriter
from gateway.runtime import Cancellation
from gateway.upstream.response import Owned, UpstreamResponse

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

JSON_HEADERS = ((b"content-type", b"application/json"),)
# The most of one SSE event held back while its end has not arrived: a stream that never ends
# an event (or whose events are this large: a model's delta is a few bytes) is broken.
MAX_EVENT_BYTES = 1024 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})


class ResponseAborted(Exception):
    """A body broke after the commit point with no ending its protocol could be given (any
    body but an SSE stream of a known protocol): the client connection must be dropped."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    extra_headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    headers = [
        *JSON_HEADERS,
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send,
    error: GatewayError,
    attempts: int = 0,
    dialect: Dialect = OPENAI,
    routed: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """The gateway's own error answer, marked `x-gateway-error: <code>` whatever the dialect:
    a backend's error relayed by `relay` never carries it. `routed`: the headers naming the
    pool that answered (`Exchange.routed`), for a request that was routed."""
    extra: list[tuple[bytes, bytes]] = [error.header, *routed]
    if error.retry_after_s is not None:
        extra.append((b"retry-after", str(max(1, round(error.retry_after_s))).encode()))
    if attempts:
        extra.append((b"x-gateway-attempts", str(attempts).encode()))
    if isinstance(error, MethodNotAllowed):
        extra.append((b"allow", error.allow.encode()))
    if error.status == 413:
        # The rest of the body was never read: the connection cannot be reused.
        extra.append((b"connection", b"close"))
    await send_json(send, error.status, dialect.body(error), tuple(extra))


def sse_error_event(error: GatewayError, dialect: Dialect = OPENAI, last: bytes = b"") -> bytes:
    """The end of a stream the gateway has to break: an error event in the client's protocol
    (for OpenAI clients followed by `[DONE]`); ResponseAborted when its protocol has none.
    `last`: the stream's last events so far."""
    ending = dialect.stream_ending(error, last)
    if ending is None:
        raise ResponseAborted(error)
    return ending


async def relay(
    send: Send,
    current: Owned,
    attempts: int,
    routed: tuple[tuple[bytes, bytes], ...],
    idle_s: float,
    end_at: float,
    dialect: Dialect,
    streams: OpenStreams,
    cancellation: Cancellation,
    resume: StreamResume | None = None,
    writer: BodyWriter | None = None,
) -> GatewayError | None:
    """Forward an upstream response. Once this starts, the request is committed: no retry.
    Returns what ended an SSE stream short with the gateway's error event, if anything did
    (the upstream cutting it, the drain's deadline).

    `current`: the scope of the response (`upstream.response.Owned`), whose outcome the relay
    states as it learns it: the caller's scope ends it, after the last byte (a stream cut by
    the upstream, a crash, a reset, an idle timeout, is that instance's failure, accounted
    then like any other).
    A stream that breaks after the commit point is continued on another attempt when `resume`
    allows (`ingress.resume`): the client sees one stream. Otherwise it ends, for SSE, with an
    error event (and `[DONE]` for OpenAI clients: `dialect`), never a silent truncation:
    incomplete events are held back until their end arrives, so the error event never lands
    inside half an event, and a stream that ends before its protocol's last event counts as
    broken. Any other body, and a stream of a protocol the gateway does not know, is aborted
    (ResponseAborted) so the client sees an incomplete response, not a short one that looks
    whole.
    `idle_s` bounds each wait for the next chunk; `end_at` (event-loop time) the whole exchange.
    A graceful shutdown's deadline ends an SSE stream the same way (gateway.drain): the
    stream is registered with `streams` by the request's `cancellation`.
    `routed`: the headers naming the pool that answered (`Exchange.routed`).
    `writer`: where an SSE stream's plain pieces may be written straight from the upstream's
    callback (`ingress.writer`), the same destination as `send`.
    """
    response = current.response
    assert response is not None
    no_body = response.status in _NO_BODY_STATUSES
    headers = response_headers(response.headers, drop_length=response.is_sse or no_body)
    headers += (
        (b"x-gateway-attempts", str(attempts).encode()),
        (b"x-gateway-instance", response.instance.name_header),
        *routed,
    )
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    if response.body is not None or no_body:
        await send({"type": "http.response.body", "body": b"" if no_body else response.body})
        current.ok = True
        return None
    if response.is_sse:
        return await _relay_stream(
            send, current, idle_s, end_at, dialect, streams, cancellation, resume, writer
        )
    broken = await _relay_body(send, response, idle_s, end_at, None, response.first_chunk)
    if broken is None:
        current.ok = True
        return None
    error = broken[0]
    assert isinstance(error, UpstreamError)
    current.error = error
    raise ResponseAborted(error)


async def _relay_stream(
    send: Send,
    current: Owned,
    idle_s: float,
    end_at: float,
    dialect: Dialect,
    streams: OpenStreams,
    stream: Cancellation,
    resume: StreamResume | None,
    writer: BodyWriter | None,
) -> GatewayError | None:
    """Forward an SSE stream while it is registered with the open streams (by its request's
    cancellation, `stream`: the drain may end it, or ask it to move); one that ends short
    ends with the gateway's error event in the client's protocol."""
    response = current.response
    assert response is not None
    entry = streams.add(
        stream, response.instance, resume.movable if resume and resume.moves else None
    )
    try:
        if streams.ending:  # started after the drain's deadline: end it at once
            error: GatewayError | None = shutting_down()
            last = b""
        else:
            error, last = await _relay_events(
                send, current, idle_s, end_at, stream, dialect, resume, entry, writer
            )
    finally:
        streams.discard(stream)  # its last event is not the drain's to interrupt
    if isinstance(error, UpstreamError):
        current.error = error
    if error is None:
        current.ok = True
    else:
        await send({"type": "http.response.body", "body": sse_error_event(error, dialect, last)})
    return error


async def _relay_events(
    send: Send,
    current: Owned,
    idle_s: float,
    end_at: float,
    stream: Cancellation,
    dialect: Dialect,
    resume: StreamResume | None,
    entry: OpenStream,
    writer: BodyWriter | None,
) -> tuple[GatewayError | None, bytes]:
    """Forward an SSE stream, continuing it on another attempt each time it breaks and
    `resume` allows; returns what ended it short, if anything did, and its last events as the
    client got them (where `resume` learns the usage it was told, whatever ends it)."""
    response = current.response
    assert response is not None
    chunk: bytes | None = response.first_chunk
    transcript = resume.transcript if resume is not None else None
    watch = _Watch(dialect, transcript, None, entry, resume=resume)
    try:
        while True:
            broken = await _relay_body(send, response, idle_s, end_at, stream, chunk, watch, writer)
            if broken is None:
                return None, watch.last
            error, pending = broken
            if resume is None or not isinstance(error, UpstreamError):
                plan: Continue | bytes | str = "off"
            else:
                plan = resume.plan(error, response.instance)
            if isinstance(error, UpstreamLeft) and not isinstance(plan, Continue):
                # Asked to move, yet it cannot any more (a tool call began meanwhile, the
                # deadline is near, its generation just ended): a healthy stream stays.
                entry.leave = False
                chunk = None
                continue
            if isinstance(plan, str):
                if pending:
                    # The engine's own error event, not continued: relayed as it came, as the
                    # rest of the stream.
                    watch = _Watch(dialect, None, None, None, errors=False)
                    broken = await _relay_body(
                        send, response, idle_s, end_at, stream, pending, watch, writer
                    )
                    return (None if broken is None else broken[0]), watch.last
                if dialect.knows_end and dialect.ended(watch.last):
                    # It broke after its protocol's last event: the client has its whole
                    # answer, and nothing may follow that event. The body ends there.
                    await send({"type": "http.response.body", "body": b""})
                    return None, watch.last
                return error, watch.last
            assert isinstance(error, UpstreamError) and resume is not None
            if isinstance(plan, bytes):
                # The generation had ended; only the stream's last events were lost: the
                # client's stream ends whole, the attempt that lost them as broken.
                await send({"type": "http.response.body", "body": plan})
                current.error = error
                current.end()
                return None, watch.last
            moved = await _continue_elsewhere(current, resume, plan, error, entry, stream)
            if isinstance(moved, GatewayError):
                return moved, watch.last
            response, idle_s, plan = moved
            chunk = response.first_chunk
            watch = _Watch(dialect, resume.transcript, plan.rewriter, entry, resume=resume)
    finally:
        if resume is not None:
            resume.told = watch.before + watch.last


async def _continue_elsewhere(
    current: Owned,
    resume: StreamResume,
    plan: Continue,
    error: UpstreamError,
    entry: OpenStream,
    stream: Cancellation,
) -> tuple[UpstreamResponse, float, Continue] | GatewayError:
    """The stream goes on in another attempt: its response, the idle timeout of its stream and
    the plan it follows; or what ended the stream when no continuation could start."""
    # This attempt is accounted as broken now, the request's own work (its admission slot)
    # waits for the next.
    entry.instance = None  # moving: not on any instance meanwhile
    broken_on = current.break_off(error).instance
    pause_s = 0.0
    while True:
        try:
            if pause_s:
                await asyncio.sleep(pause_s)
            response, idle_s = await resume.start(plan.body, broken_on)
            break
        except GatewayError:
            # The continuation failed before its first byte (its retries, or an engine that
            # refused it): another after a pause, while resumes and budget last.
            again = resume.plan(error, broken_on)
            if not isinstance(again, Continue):
                return error  # ended as it would have without resume
            plan = again
            pause_s = resume.pause_s()
        except asyncio.CancelledError:
            drained = ended_by_drain(stream)
            if drained is None:
                raise  # the client went away
            return drained  # the drain's deadline came while it moved: ended properly
    current.resume_on(response)
    entry.instance = response.instance
    entry.leave = False
    return response, idle_s, plan


class _Watch:
    """What the relay looks for in a stream it may continue: the engine's error event, and a
    proper last event; what it keeps (`transcript`) or rewrites (`rewriter`, a continuation)."""

    __slots__ = (
        "before",
        "chunks",
        "dialect",
        "entry",
        "errors",
        "last",
        "resume",
        "rewriter",
        "slow",
        "transcript",
        "window_at",
    )

    def __init__(
        self,
        dialect: Dialect,
        transcript: Transcript | None,
        rewriter: Rewriter | None,
        entry: OpenStream | None,
        errors: bool = True,
        resume: StreamResume | None = None,
    ) -> None:
        self.dialect = dialect
        # Its registration with the open streams: `leave` asks it to move (`migrate`).
        self.entry = entry if transcript is not None else None
        self.transcript = transcript
        self.rewriter = rewriter
        # Looks for the engine's error event (to continue the stream rather than end it).
        self.errors = errors and transcript is not None
        self.last = b""  # the last chunk sent, and `before` the one before it
        self.before = b""
        # Its pace: chunks since the upstream wait was `window_at`, and windows in a row
        # found too slow.
        self.resume = resume if self.entry is not None and resume and resume.moves else None
        self.chunks = 0
        self.window_at = 0.0
        self.slow = 0


def _split_at_error(chunk: bytes, dialect: Dialect) -> tuple[bytes, bytes]:
    """`chunk` (complete events) cut before the engine's error event."""
    events = split_events(chunk)
    for i, event in enumerate(events):
        if dialect.has_error_event(event):
            return b"".join(events[:i]), b"".join(events[i:])
    return chunk, b""


async def _relay_body(
    send: Send,
    response: UpstreamResponse,
    idle_s: float,
    end_at: float,
    stream: Cancellation | None,
    chunk: bytes | None,
    watch: _Watch | None = None,
    writer: BodyWriter | None = None,
) -> tuple[GatewayError, bytes] | None:
    """Forward the body chunk by chunk, from `chunk` on (None: from the next one); returns the
    error that broke it, if any, with the engine's error event and what followed it when that
    is what broke it.

    `stream`: for an SSE stream, its request's cancellation, registered with the drain,
    which may end it. `watch`: for an SSE stream, what to look for in it. `writer`: where its
    plain pieces go from the upstream's callback (`_Tap`), a stream's rewritten ones aside."""
    events = response.is_sse
    tap = None
    if writer is not None and events and watch is not None and watch.rewriter is None:
        tap = _Tap(writer, watch, response)
    # SSE only: the start of an event whose end has not arrived yet (`_complete_events`).
    held = bytearray()
    try:
        if chunk is None:  # going on from where an earlier call stopped
            chunk = await response.next_chunk(idle_s, end_at)
        while chunk:
            if events and (held or not chunk.endswith(b"\n\n")):
                # vLLM sends whole events: this is the rare path.
                chunk = _complete_events(held, chunk)
                if len(held) > MAX_EVENT_BYTES:
                    return await _event_too_long(send, chunk, watch, response)
            if chunk and watch is not None:
                if watch.errors and watch.dialect.has_error_event(chunk):
                    chunk, pending = _split_at_error(chunk, watch.dialect)
                    if pending:  # with the start of an event after it
                        return await _up_to_error_event(
                            send, chunk, watch, response, pending + bytes(held)
                        )
                chunk = _watched(watch, chunk, response)
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if watch is not None and watch.entry is not None and watch.entry.leave and not held:
                    # Between two whole events (none half-received): the stream may move.
                    return UpstreamLeft(watch.entry.reason), b""
            if tap is None or held:
                chunk = await response.next_chunk(idle_s, end_at)
                continue
            try:
                chunk = await response.pump(idle_s, end_at, tap)
            finally:
                tap.flush()  # what it wrote goes before anything sent from here on
            if chunk is None:  # the tap wrote a piece, and the stream was then asked to move
                assert watch is not None and watch.entry is not None
                return UpstreamLeft(watch.entry.reason), b""
        if watch is not None and not watch.dialect.ended(watch.last + held):
            # A clean end before the protocol's last event: as broken as a reset.
            return UpstreamStreamCut("the upstream ended the stream before its last event"), b""
        await send({"type": "http.response.body", "body": bytes(held)})
    except UpstreamError as error:
        return error, b""
    except ValueError:
        # A continuation's event the rewriter could not read.
        return UpstreamProtocolError("the upstream sent an unreadable stream event"), b""
    except asyncio.CancelledError:
        timeout = response.cancelled_by_deadline()
        if timeout is not None:
            return timeout, b""
        drained = ended_by_drain(stream) if stream is not None else None
        if drained is None:
            raise  # not a deadline: the client went away
        return drained, b""
    return None


def _complete_events(held: bytearray, chunk: bytes) -> bytes:
    """The whole events `chunk` completes, after the start of one `held` back; the start of
    an event whose end has not arrived stays in `held`. An end is searched for only where the
    new bytes could complete one, so a long event costs linear time."""
    start = max(0, len(held) - 3)
    held += chunk
    cut = event_boundary(held, start)
    complete = bytes(held[:cut])
    del held[:cut]
    return complete


async def _event_too_long(
    send: Send, chunk: bytes, watch: _Watch | None, response: UpstreamResponse
) -> tuple[GatewayError, bytes]:
    """An event held back past `MAX_EVENT_BYTES`: the whole events before it go out, and the
    stream is broken."""
    if chunk and watch is not None:
        chunk = _watched(watch, chunk, response)
    if chunk:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    too_long = UpstreamProtocolError(
        "the upstream sent a stream event over "
        f"{MAX_EVENT_BYTES // (1024 * 1024)} MiB, or no event end"
    )
    return too_long, b""


async def _up_to_error_event(
    send: Send, chunk: bytes, watch: _Watch, response: UpstreamResponse, pending: bytes
) -> tuple[GatewayError, bytes]:
    """The engine reported an error mid-stream: the events before its error event go out, and
    the stream is broken, the error event and what followed it (`pending`) kept for whoever
    ends the stream."""
    if chunk:
        chunk = _watched(watch, chunk, response)
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    return UpstreamStreamError("the upstream reported an error mid-stream"), pending


class _Tap:
    """What `_relay_body` does with a piece of an SSE stream, done from the upstream
    connection's callback (`UpstreamResponse.pump`) for the pieces that need nothing else: one
    or more whole events, no engine error among them, a client taking every byte at once.
    Anything else it declines, and the relay's task takes it as before."""

    __slots__ = ("_dialect", "_errors", "_response", "_watch", "_writer")

    def __init__(self, writer: BodyWriter, watch: _Watch, response: UpstreamResponse) -> None:
        self._writer = writer
        self._watch = watch
        self._response = response
        self._dialect = watch.dialect
        self._errors = watch.errors

    def flush(self) -> None:
        self._writer.flush()

    def __call__(self, chunk: bytes) -> bool:
        if not chunk.endswith(b"\n\n") or (self._errors and self._dialect.has_error_event(chunk)):
            return False
        writer = self._writer
        if not writer.writable():
            return False
        watch = self._watch
        writer.write(_watched(watch, chunk, self._response))
        entry = watch.entry
        if entry is not None and entry.leave:
            # Between two whole events: the stream may move (the relay's task does it).
            self._response.stop_pump()
        return True


def _watched(watch: _Watch, chunk: bytes, response: UpstreamResponse) -> bytes:
    """A chunk of complete events on its way to the client: rewritten when it comes from a
    continuation, else kept by reference for a resume; every `PACE_WINDOW` chunks, the
    stream's pace is judged."""
    if watch.rewriter is not None:
        chunk = watch.rewriter.rewrite(chunk)
    elif watch.transcript is not None:
        watch.transcript.keep(chunk)
    if chunk:
        watch.before = watch.last
        watch.last = chunk
    if watch.resume is not None:
        watch.chunks += 1
        if watch.chunks >= PACE_WINDOW:
            _judge_pace(watch, watch.resume, response)
    return chunk


def _judge_pace(watch: _Watch, resume: StreamResume, response: UpstreamResponse) -> None:
    """A stream far slower than the pool's other instances, window after window (a gray
    failure after the first byte), is asked to move (`leave`) when it can go on elsewhere.
    Its pace is the time spent waiting for the upstream, per chunk: a client slow to read
    is not the instance's slowness."""
    waited = response.waited_s
    pace_s = (waited - watch.window_at) / watch.chunks
    watch.window_at = waited
    watch.chunks = 0
    if not resume.too_slow(response.instance, pace_s):
        watch.slow = 0
        return
    watch.slow += 1
    entry = watch.entry
    if watch.slow >= SLOW_WINDOWS and entry is not None and resume.movable():
        entry.leave = True
        entry.reason = "slow"
