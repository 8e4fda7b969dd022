"""The two peers of a gateway on wires in memory (`loadtests.cost.wire`): a keep-alive HTTP/1.1
client, and backends answering as vLLM's OpenAI server does, from bytes made before the run.

Both do as little as they can per request: the cost budget counts every call in the process,
theirs included (`harness` leaves this module's own functions out).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import httptools

from loadtests.fake_vllm.responses import DONE, ChunkWriter, chat_body, error_body

MODEL = "m"
PROMPT_TOKENS = 12


@dataclass
class Answer:
    """What the client got: the status, the headers, the body in the pieces it came in."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    pieces: list[bytes] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces)


class Client(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._answer = Answer()
        self._done: asyncio.Future[Answer] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError(f"the gateway closed the connection: {exc}"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._answer.headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self._answer.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._answer.pieces.append(body)

    def on_message_complete(self) -> None:
        assert self._done is not None
        self._done.set_result(self._answer)

    async def send(self, request: bytes) -> Answer:
        assert self._transport is not None
        self._answer = Answer()
        self._done = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return await self._done


def chat_request(stream: bool, request_id: str) -> bytes:
    """A chat completion as an OpenAI SDK sends it (streams ask for the usage at their end)."""
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three prime numbers and say why they are prime."},
        ],
        "max_tokens": 64,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        "host: 127.0.0.1:8080\r\n"
        "accept: application/json\r\n"
        "content-type: application/json\r\n"
        "user-agent: OpenAI/Python 1.99.0\r\n"
        "authorization: Bearer sk-not-a-real-key\r\n"
        f"x-request-id: {request_id}\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


@dataclass(frozen=True)
class Script:
    """How the backends answer: a whole chat completion of `tokens` tokens after `latency_s`,
    or a stream of `chunks` events `gap_s` apart (the first after `latency_s`); with
    `fail_first`, the first attempt of each request whose id starts with `retry-` gets vLLM's
    503 instead."""

    chunks: int = 0
    tokens: int = 48
    latency_s: float = 0.02
    gap_s: float = 0.005
    fail_first: bool = False


def _head(status: int, reason: str, content_type: str, length: int | None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (
        f"HTTP/1.1 {status} {reason}\r\n"
        "date: Sat, 05 Dec 2026 09:00:00 GMT\r\n"
        "server: uvicorn\r\n"
        f"{framing}\r\n"
        f"content-type: {content_type}\r\n\r\n"
    ).encode()


class Backends:
    """Every instance's answers, made once; which request ids have failed once (shared by the
    instances, so a retry elsewhere succeeds)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.failed: set[bytes] = set()
        self.received = 0
        body = chat_body("cost", json.dumps(MODEL), script.tokens, PROMPT_TOKENS)
        self.whole = _head(200, "OK", "application/json", len(body)) + body
        unavailable = error_body(503, "the engine is overloaded")
        self.refusal = _head(503, "Service Unavailable", "application/json", len(unavailable))
        self.refusal += unavailable
        writer = ChunkWriter(True, "cost", json.dumps(MODEL))
        events = [writer.token(i, last=i == script.chunks - 1) for i in range(script.chunks)]
        events += [writer.usage(PROMPT_TOKENS, script.chunks), DONE]
        self.stream_head = _head(200, "OK", "text/event-stream; charset=utf-8", None)
        self.stream_chunks = [b"%x\r\n%b\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]

    def protocol(self) -> Backend:
        return Backend(self)


class Backend(asyncio.Protocol):
    """One connection to an instance: a request in, its answer out, as scripted."""

    def __init__(self, backends: Backends) -> None:
        self._backends = backends
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._request_id = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-request-id":
            self._request_id = value

    def on_message_complete(self) -> None:
        backends = self._backends
        backends.received += 1
        script = backends.script
        loop = asyncio.get_running_loop()
        if (
            script.fail_first
            and self._request_id.startswith(b"retry-")
            and self._request_id not in backends.failed
        ):
            backends.failed.add(self._request_id)
            loop.call_later(script.latency_s, self._write, backends.refusal)
        elif script.chunks:
            # The head at once, the first event after the time to first token (a streaming
            # response's start is sent before its first chunk is made).
            loop.call_soon(self._write, backends.stream_head)
            loop.call_later(script.latency_s, self._stream, iter(backends.stream_chunks))
        else:
            loop.call_later(script.latency_s, self._write, backends.whole)

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _stream(self, chunks: Iterator[bytes]) -> None:
        chunk = next(chunks, None)
        if chunk is not None:
            self._write(chunk)
            asyncio.get_running_loop().call_later(self._backends.script.gap_s, self._stream, chunks)
