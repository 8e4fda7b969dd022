"""Minimal ASGI plumbing: types, whole-body reads, plain responses and disconnect detection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON = b"application/json"


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client went away while sending it."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def start_message(status: int, content_type: bytes, length: int | None, extra: Headers) -> Message:
    headers: Headers = [(b"content-type", content_type)]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    headers.extend(extra)
    return {"type": "http.response.start", "status": status, "headers": headers}


def body_message(body: bytes, more: bool) -> Message:
    return {"type": "http.response.body", "body": body, "more_body": more}


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    extra: Headers | None = None,
) -> None:
    await send(start_message(status, content_type, len(body), extra or []))
    await send(body_message(body, more=False))


async def die_midway(send: Send, full: bytes, extra: Headers | None = None) -> str:
    """Promise the whole body, send half, then let uvicorn drop the connection."""
    await send(start_message(200, JSON, len(full), extra or []))
    await send(body_message(full[: len(full) // 2], more=True))
    return "died"


async def answer_whole(send: Send, full: bytes, died: bool) -> str:
    """A whole answer, or half of it (`died`: the connection is dropped after it)."""
    if died:
        return await die_midway(send, full)
    await respond(send, 200, full)
    return "ok"


class DisconnectGuard:
    """Cancels the task handling a request as soon as its client disconnects.

    uvicorn silently drops writes to a closed connection, so without this a generator would keep
    "streaming" to nobody; cancelling also ends sleeps that stand for hangs and stalls. The
    handler catches the CancelledError and checks `happened` to tell it from a server shutdown.
    """

    __slots__ = ("_done", "_task", "_watcher", "happened")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._done = False
        self.happened = False
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        # Once the body has been read, the next message uvicorn delivers is the disconnect
        # (also delivered when the response completes: `_done` makes that one harmless).
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._done:
            self.happened = True
            self._task.cancel()

    def absorb(self) -> bool:
        """Inside `except CancelledError`: True (and the cancel undone) if it was the client."""
        if self.happened:
            self._task.uncancel()
            return True
        return False

    def close(self) -> None:
        self._done = True
        self._watcher.cancel()
