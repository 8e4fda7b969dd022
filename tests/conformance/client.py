"""Driving the data plane's HTTP/1.1 client the way the transport does: post, read, release."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from yarl import URL

from gateway.upstream.h1 import H1Client, UpstreamResponseHead

from .upstream import DEFAULT_WAIT_S

REQUEST_HEADERS = [("content-type", "application/json")]


@dataclass
class Reply:
    """What the client handed over for one exchange, as the relay would see it after the body:
    the status, the raw headers (copied once the body was read) and the body."""

    status: int
    raw_headers: list[tuple[bytes, bytes]]
    content_length: int | None
    body: bytes

    def values(self, name: str) -> list[str]:
        """Every value of header `name` (case-insensitive), in order."""
        wanted = name.lower().encode("latin-1")
        return [v.decode("latin-1") for n, v in self.raw_headers if n.lower() == wanted]

    @property
    def names(self) -> set[str]:
        """The header names, lowercased."""
        return {n.decode("latin-1").lower() for n, _ in self.raw_headers}


async def post(
    client: H1Client,
    url: URL,
    body: bytes = b"{}",
    *,
    tls: ssl.SSLContext | bool = False,
    connect_s: float = DEFAULT_WAIT_S,
    max_connections: int | None = None,
    max_idle: int | None = None,
) -> UpstreamResponseHead:
    """Send one request; its head, within `DEFAULT_WAIT_S`."""
    async with asyncio.timeout(DEFAULT_WAIT_S):
        return await client.post(
            url,
            REQUEST_HEADERS,
            body,
            connect_s=connect_s,
            tls=tls,
            max_connections=max_connections,
            max_idle=max_idle,
        )


async def fetch(
    client: H1Client,
    url: URL,
    body: bytes = b"{}",
    *,
    tls: ssl.SSLContext | bool = False,
    max_connections: int | None = None,
    max_idle: int | None = None,
) -> Reply:
    """One whole exchange: post, read the body to its end, release the connection. Bounded by
    `DEFAULT_WAIT_S`; on any failure the response is closed (its connection dropped)."""
    async with asyncio.timeout(DEFAULT_WAIT_S):
        head = await post(
            client, url, body, tls=tls, max_connections=max_connections, max_idle=max_idle
        )
        try:
            data = await head.read()
        except BaseException:
            head.close()
            raise
        reply = Reply(head.status, list(head.raw_headers), head.content_length, data)
        head.release()
    return reply


async def wait_until(condition: Callable[[], bool], timeout_s: float = DEFAULT_WAIT_S) -> None:
    """Until `condition()` holds, checked every few milliseconds (TimeoutError past
    `timeout_s`)."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - the client under test offers no event to wait on
            await asyncio.sleep(0.005)


async def read_exactly(head: UpstreamResponseHead, size: int) -> bytes:
    """`size` bytes of the body, over as many reads as they take (a stream's chunk may arrive
    in pieces); fewer only if the body ends first. Bounded by `DEFAULT_WAIT_S`."""
    data = bytearray()
    async with asyncio.timeout(DEFAULT_WAIT_S):
        while len(data) < size:
            piece = await head.readany()
            if not piece:
                break
            data += piece
    return bytes(data)
