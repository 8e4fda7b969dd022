"""Sending responses to the client: the gateway's own, and upstream ones past the commit point."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.errors import GatewayError, UpstreamError
from gateway.ingress.headers import response_headers
from gateway.upstream.response import UpstreamResponse

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

JSON_HEADERS = ((b"content-type", b"application/json"),)
_SSE_DONE = b"data: [DONE]\n\n"


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


async def send_error(send: Send, error: GatewayError, attempts: int = 0) -> None:
    extra: list[tuple[bytes, bytes]] = []
    if error.retry_after_s is not None:
        extra.append((b"retry-after", str(max(1, round(error.retry_after_s))).encode()))
    if attempts:
        extra.append((b"x-gateway-attempts", str(attempts).encode()))
    if error.status == 413:
        # The rest of the body was never read: the connection cannot be reused.
        extra.append((b"connection", b"close"))
    await send_json(send, error.status, error.body(), tuple(extra))


def sse_error_event(error: GatewayError) -> bytes:
    """An SSE event carrying an error, then the end-of-stream marker OpenAI clients expect."""
    return b"data: " + error.body() + b"\n\n" + _SSE_DONE


async def relay(send: Send, response: UpstreamResponse, attempts: int, deadline: float) -> None:
    """Forward an upstream response. Once this starts, the request is committed: no retry.

    A stream that breaks after the commit point ends, for SSE, with an error event and
    `[DONE]` (never a silent truncation); for other bodies the connection is aborted so the
    client sees an incomplete response rather than a short one that looks whole.
    """
    ok = False
    try:
        headers = response_headers(response.headers, drop_length=response.is_sse)
        headers.append((b"x-gateway-attempts", str(attempts).encode()))
        headers.append((b"x-gateway-instance", response.instance.name_header))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        if response.body is not None:
            await send({"type": "http.response.body", "body": response.body})
            ok = True
            return
        if response.first_chunk:
            await send(
                {"type": "http.response.body", "body": response.first_chunk, "more_body": True}
            )
        try:
            async for chunk in response.rest(deadline):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as error:
            if not response.is_sse:
                raise
            await send({"type": "http.response.body", "body": sse_error_event(error)})
            return
        await send({"type": "http.response.body", "body": b""})
        ok = True
    finally:
        response.finish(ok)
