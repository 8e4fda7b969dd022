"""Sending responses to the client: the gateway's own, and upstream ones past the commit point."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.errors import (
    GatewayError,
    MethodNotAllowed,
    UpstreamError,
    UpstreamProtocolError,
    shutting_down,
)
from gateway.ingress.dialect import OPENAI, Dialect
from gateway.ingress.headers import response_headers
from gateway.ingress.streams import OpenStreams, ended_by_drain
from gateway.runtime import Cancellation
from gateway.upstream.response import UpstreamResponse

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

JSON_HEADERS = ((b"content-type", b"application/json"),)
# The most of one SSE event held back while its end has not arrived: a stream that never ends
# an event (or whose events are this large: a model's delta is a few bytes) is broken.
MAX_EVENT_BYTES = 1024 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})


class ResponseAborted(Exception):
    """A non-SSE body broke after the commit point: the client connection must be dropped."""

    def __init__(self, error: UpstreamError) -> None:
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
    send: Send, error: GatewayError, attempts: int = 0, dialect: Dialect = OPENAI
) -> None:
    """The gateway's own error answer, marked `x-gateway-error: <code>` whatever the dialect:
    a backend's error relayed by `relay` never carries it."""
    extra: list[tuple[bytes, bytes]] = [error.header]
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


def sse_error_event(error: GatewayError, dialect: Dialect = OPENAI) -> bytes:
    """The end of a stream the gateway has to break: an error event in the client's protocol
    (for OpenAI clients followed by `[DONE]`)."""
    return dialect.stream_ending(error)


def _event_boundary(data: bytes | bytearray, start: int = 0) -> int:
    """Length of the prefix of `data` made of complete SSE events (ending in a blank line:
    the spec's lines end in LF, CRLF or CR alone), looking from `start` on; 0 if none."""
    lf = data.rfind(b"\n\n", start)
    crlf = data.rfind(b"\r\n\r\n", start)
    cr = data.rfind(b"\r\r", start)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0, cr + 2 if cr >= 0 else 0)


async def relay(
    send: Send,
    response: UpstreamResponse,
    attempts: int,
    idle_s: float,
    end_at: float,
    dialect: Dialect,
    streams: OpenStreams,
    cancellation: Cancellation,
) -> UpstreamError | None:
    """Forward an upstream response. Once this starts, the request is committed: no retry.
    Returns what broke an SSE stream the upstream cut short, if anything did.

    A stream that breaks after the commit point ends, for SSE, with an error event (and
    `[DONE]` for OpenAI clients: `dialect`), never a silent truncation: incomplete events are
    held back until their end arrives, so the error event never lands inside half an event.
    Any other body is aborted (ResponseAborted) so the client sees an incomplete response, not
    a short one that looks whole.
    `idle_s` bounds each wait for the next chunk; `end_at` (event-loop time) the whole exchange.
    A graceful shutdown's deadline ends an SSE stream the same way (gateway.drain): the
    stream is registered with `streams` by the request's `cancellation`.
    """
    ok = False
    broke: UpstreamError | None = None  # what broke the body, when the upstream did
    stream: Cancellation | None = None
    try:
        no_body = response.status in _NO_BODY_STATUSES
        headers = response_headers(response.headers, drop_length=response.is_sse or no_body)
        headers.append((b"x-gateway-attempts", str(attempts).encode()))
        headers.append((b"x-gateway-instance", response.instance.name_header))
        start = {"type": "http.response.start", "status": response.status, "headers": headers}
        if response.body is not None or no_body:
            await send(start)
            await send({"type": "http.response.body", "body": b"" if no_body else response.body})
            ok = True
            return None
        await send(start)
        error: GatewayError | None
        if response.is_sse:
            stream = cancellation
            streams.add(stream)
            if streams.ending:  # started after the drain's deadline: end it at once
                error = shutting_down()
            else:
                error = await _relay_body(send, response, idle_s, end_at, stream)
            streams.discard(stream)  # its last event is not the drain's to interrupt
            stream = None
        else:
            error = await _relay_body(send, response, idle_s, end_at, None)
        if isinstance(error, UpstreamError):
            broke = error
        if error is None:
            ok = True
        elif response.is_sse:
            await send({"type": "http.response.body", "body": sse_error_event(error, dialect)})
        else:
            assert isinstance(error, UpstreamError)
            raise ResponseAborted(error)
        return broke
    finally:
        if stream is not None:
            streams.discard(stream)
        # A stream cut by the upstream (a crash, a reset, an idle timeout) is that instance's
        # failure, accounted now like any other.
        response.finish(ok, broke)


async def _relay_body(
    send: Send,
    response: UpstreamResponse,
    idle_s: float,
    end_at: float,
    stream: Cancellation | None,
) -> GatewayError | None:
    """Forward the body chunk by chunk; returns the error that broke it, if any.

    `stream`: for an SSE stream, its request's cancellation, registered with the drain,
    which may end it."""
    events = response.is_sse
    # SSE only: the start of an event whose end has not arrived yet. Searched for an end only
    # where the new bytes could complete one, so a long event costs linear time.
    held = bytearray()
    chunk = response.first_chunk
    try:
        while chunk:
            if events and (held or not chunk.endswith(b"\n\n")):
                # vLLM sends whole events: this is the rare path.
                start = max(0, len(held) - 3)
                held += chunk
                cut = _event_boundary(held, start)
                chunk = bytes(held[:cut])
                del held[:cut]
                if len(held) > MAX_EVENT_BYTES:
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    return UpstreamProtocolError(
                        "the upstream sent a stream event over "
                        f"{MAX_EVENT_BYTES // (1024 * 1024)} MiB, or no event end"
                    )
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            chunk = await response.next_chunk(idle_s, end_at)
        await send({"type": "http.response.body", "body": bytes(held)})
    except UpstreamError as error:
        return error
    except asyncio.CancelledError:
        timeout = response.cancelled_by_deadline()
        if timeout is not None:
            return timeout
        drained = ended_by_drain(stream) if stream is not None else None
        if drained is None:
            raise  # not a deadline: the client went away
        return drained
    return None
