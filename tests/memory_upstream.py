"""Instances in memory for the request path (`gateway.pipeline.transport.UpstreamClient`): each
instance, found by its URL's host, answers every request by its script. With the virtual-time
loop (`loadtests.virtual_time`), the whole pipeline runs with no socket and no wall-clock time."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

from yarl import URL

from gateway.errors import UpstreamConnectError, UpstreamConnectionLimit
from gateway.upstream.h1 import Headers


@dataclass(frozen=True)
class Answer:
    """A whole answer after `after_s` (virtual) seconds: JSON unless `content_type` says
    otherwise (an SSE stream sent at once), with `headers` besides."""

    status: int = 200
    body: bytes = json.dumps({"choices": [], "usage": {"completion_tokens": 4}}).encode()
    after_s: float = 0.01
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes = b"application/json"


@dataclass(frozen=True)
class Refuse:
    """The connection is refused."""


@dataclass(frozen=True)
class Full:
    """Every connection the gateway allows to the instance is busy (its own limit)."""


@dataclass(frozen=True)
class Hang:
    """Accepts the request and never answers."""


@dataclass(frozen=True)
class AnswerWhen:
    """A whole JSON answer the moment `event` is set (at once if it is)."""

    event: asyncio.Event


Act = Answer | AnswerWhen | Refuse | Full | Hang
# What an instance does with its n-th request (0-based).
Script = Callable[[int], Act]


def always(act: Act) -> Script:
    return lambda n: act


@dataclass
class Sent:
    """A request an instance received: which, when (virtual time), its body."""

    instance: str
    at: float
    body: bytes


class MemoryHead:
    """An answer's head and its whole body, in memory (`upstream.response.ResponseHead`)."""

    def __init__(self, answer: Answer) -> None:
        self.status = answer.status
        self._body: bytes | None = answer.body
        self.raw_headers = [
            (b"content-type", answer.content_type),
            (b"content-length", str(len(answer.body)).encode()),
            *answer.headers,
        ]
        self.headers = Headers(self.raw_headers)
        self.content_length: int | None = len(answer.body)
        self.released = False

    @property
    def connection(self) -> object | None:
        return self if self._body else None

    async def readany(self) -> bytes:
        body, self._body = self._body, None
        return body or b""

    async def read(self) -> bytes:
        return await self.readany()

    async def pump(self, tap: Callable[[bytes], bool]) -> bytes | None:
        return await self.readany()  # nothing tapped: what a head may do

    def stop_pump(self) -> None:
        pass

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.released = True


@dataclass
class MemoryUpstreams:
    """Instances by host name, each with its script; what they received, in order."""

    scripts: dict[str, Script]
    sent: list[Sent] = field(default_factory=list)
    _counts: dict[str, int] = field(default_factory=dict)

    def received(self, instance: str) -> int:
        return sum(1 for s in self.sent if s.instance == instance)

    def asked(self, instance: str) -> int:
        """Attempts on `instance`, refused and busy ones included."""
        return self._counts.get(instance, 0)

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
    ) -> MemoryHead:
        instance = url.host or ""
        n = self._counts.get(instance, 0)
        self._counts[instance] = n + 1
        act = self.scripts[instance](n)
        if isinstance(act, Refuse):
            raise UpstreamConnectError("cannot connect to the upstream: refused", refused=True)
        if isinstance(act, Full):
            raise UpstreamConnectionLimit("all connections are busy", retry_after_s=1.0)
        if on_sent is not None:
            on_sent()
        self.sent.append(Sent(instance, asyncio.get_running_loop().time(), body))
        if isinstance(act, Hang):
            await asyncio.get_running_loop().create_future()  # until the deadline cancels it
        if isinstance(act, AnswerWhen):
            await act.event.wait()
            return MemoryHead(Answer())
        assert isinstance(act, Answer)
        await asyncio.sleep(act.after_s)
        return MemoryHead(act)
