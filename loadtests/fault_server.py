"""A faulty OpenAI-compatible backend on loopback: a real TCP server whose misbehaviour is
picked by the `model` of each request (`FaultServer(scripts)`), for the crash suite
(`loadtests.crash_suite`) and anything else that needs a backend broken at the byte level.

It speaks HTTP/1.1 from raw bytes, one request per connection (`connection: close`), because
the faults it plays are the ones a well-behaved HTTP server cannot produce: a connection closed
before any byte, a reset mid-stream, a stream that stops without its last event, a byte a
second, a 200 whose body is not the JSON it claims to be. A request for a stream (`"stream":
true`, which the gateway also sends for a whole answer it fetches as a stream) gets the
scenario's streamed form, any other its whole form. `GET /health` is always answered 200: the
instance is up, only its answers are wrong.

Every POST is counted per model with its time (`hits`), to tell how often the gateway went
back to a faulty instance for one request.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOKENS = ("Hello", " from", " the", " faulty", " backend", ".")
CONTEXT_LENGTH_MESSAGE = (
    "This model's maximum context length is 60 tokens. However, you requested 120 tokens "
    "(112 in the messages, 8 in the completion). Please reduce the length of the messages "
    "or completion."
)


@dataclass(frozen=True)
class Timing:
    """How long the slow faults last: `slow_s` (a time to first token, a stall mid-stream),
    `hang_s` (a hang that sends nothing), `drip_s` (the pause between two bytes of a drip)."""

    slow_s: float = 30.0
    hang_s: float = 120.0
    drip_s: float = 1.0


@dataclass
class Request:
    """What a script needs of the request it answers."""

    model: str
    stream: bool
    usage: bool  # the stream asked for a usage chunk (`stream_options.include_usage`)


Script = Callable[["Reply"], None]


class Reply:
    """A connection's answer, written by a script; `stopped` is set when the server closes, so
    that a sleeping script ends at once."""

    def __init__(
        self, sock: socket.socket, request: Request, timing: Timing, stopped: threading.Event
    ) -> None:
        self.sock = sock
        self.request = request
        self.timing = timing
        self.stopped = stopped

    def send(self, data: bytes) -> bool:
        """False once the peer has gone."""
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        return True

    def sleep(self, seconds: float) -> bool:
        """Wait, or less when the server stops; False then."""
        return not self.stopped.wait(seconds)

    def head(self, status: int, content_type: str, length: int | None, *extra: str) -> bool:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines.append(f"content-type: {content_type}")
        if length is None:
            lines.append("transfer-encoding: chunked")
        else:
            lines.append(f"content-length: {length}")
        lines += [*extra, "connection: close"]
        return self.send(("\r\n".join(lines) + "\r\n\r\n").encode())

    def whole(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.head(status, content_type, len(body))
        self.send(body)

    def error(self, status: int, message: str, kind: str, *extra: str) -> None:
        body = json.dumps({"error": {"message": message, "type": kind, "code": status}})
        self.head(status, "application/json", len(body), *extra)
        self.send(body.encode())

    def sse_head(self) -> bool:
        return self.head(200, "text/event-stream; charset=utf-8", None)

    def chunk(self, data: bytes) -> bool:
        return self.send(b"%x\r\n%s\r\n" % (len(data), data))

    def end_chunks(self) -> None:
        self.send(b"0\r\n\r\n")

    def reset(self) -> None:
        """Close with a TCP reset (SO_LINGER 0) rather than a FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


_REASONS = {200: "OK", 400: "Bad Request", 429: "Too Many Requests", 500: "Internal Server Error"}
_REASONS |= {503: "Service Unavailable"}


def chat_event(model: str, content: str | None, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {} if content is None else {"content": content}
    if content is not None and finish is None and content == TOKENS[0]:
        delta["role"] = "assistant"
    event = {
        "id": "chatcmpl-fault",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def usage_event(model: str) -> bytes:
    event = {
        "id": "chatcmpl-fault",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": len(TOKENS), "total_tokens": 11},
    }
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def stream_events(request: Request) -> list[bytes]:
    """A complete, well-formed stream's events: the tokens, the finish, usage, `[DONE]`."""
    events = [chat_event(request.model, token) for token in TOKENS]
    events.append(chat_event(request.model, None, "stop"))
    if request.usage:
        events.append(usage_event(request.model))
    events.append(b"data: [DONE]\n\n")
    return events


def whole_body(model: str) -> bytes:
    answer = {
        "id": "chatcmpl-fault",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(TOKENS)},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": len(TOKENS), "total_tokens": 11},
    }
    return json.dumps(answer).encode()


def normal(reply: Reply) -> None:
    """A healthy answer, streamed or whole."""
    if reply.request.stream:
        if reply.sse_head():
            for event in stream_events(reply.request):
                if not reply.chunk(event):
                    return
            reply.end_chunks()
    else:
        reply.whole(200, whole_body(reply.request.model))


class FaultServer:
    """The server, on a port of its own on 127.0.0.1; `scripts` by model. A model it has no
    script for is answered normally."""

    def __init__(self, scripts: dict[str, Script], timing: Timing | None = None) -> None:
        self.timing = timing or Timing()
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._hits: dict[str, list[float]] = {}
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._handle(self.request, scripts)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def hits(self, model: str) -> list[float]:
        """When each POST for `model` arrived (time.monotonic())."""
        with self._lock:
            return list(self._hits.get(model, ()))

    def _handle(self, sock: socket.socket, scripts: dict[str, Script]) -> None:
        sock.settimeout(self.timing.hang_s + 10.0)
        try:
            method, body = _read_request(sock)
        except (OSError, ValueError):
            return
        if method != "POST":
            reply = Reply(sock, Request("", False, False), self.timing, self.stopped)
            reply.whole(200, b"{}")
            return
        try:
            parsed = json.loads(body or b"{}")
        except ValueError:
            parsed = {}
        options = parsed.get("stream_options") or {}
        request = Request(
            str(parsed.get("model")),
            parsed.get("stream") is True,
            isinstance(options, dict) and options.get("include_usage") is True,
        )
        with self._lock:
            self._hits.setdefault(request.model, []).append(time.monotonic())
        script = scripts.get(request.model, normal)
        with contextlib.suppress(OSError):  # the peer went away: nothing more to play
            script(Reply(sock, request, self.timing, self.stopped))

    def close(self) -> None:
        self.stopped.set()
        self._server.shutdown()
        self._server.server_close()


def _read_request(sock: socket.socket) -> tuple[str, bytes]:
    """The request's method and body (Content-Length only, as the gateway sends them)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            raise ValueError("the peer closed before its request ended")
        data += part
        if len(data) > 1 << 20:
            raise ValueError("headers too large")
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    method = lines[0].split(b" ", 1)[0].decode("latin-1")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        part = sock.recv(65536)
        if not part:
            raise ValueError("the peer closed before its body ended")
        body += part
    return method, body


# --- the faults ---------------------------------------------------------------------------
# Each plays one way a backend fails, in a request's streamed form and its whole form.


def closed(reply: Reply) -> None:
    """The connection is closed before any byte of an answer."""


def hang(reply: Reply) -> None:
    """Nothing at all, not even a status line, for `hang_s`."""
    reply.sleep(reply.timing.hang_s)


def slow_first_token(reply: Reply) -> None:
    """A first token after `slow_s` (a stream's head at once, as engines send it), then a
    normal answer."""
    if reply.request.stream:
        if not reply.sse_head() or not reply.sleep(reply.timing.slow_s):
            return
        for event in stream_events(reply.request):
            reply.chunk(event)
        reply.end_chunks()
    elif reply.sleep(reply.timing.slow_s):
        normal(reply)


def stall(reply: Reply) -> None:
    """A few tokens, `slow_s` of silence, then the rest (a whole body: half of it, then the
    rest)."""
    if reply.request.stream:
        events = stream_events(reply.request)
        if not reply.sse_head():
            return
        for event in events[:3]:
            reply.chunk(event)
        if not reply.sleep(reply.timing.slow_s):
            return
        for event in events[3:]:
            reply.chunk(event)
        reply.end_chunks()
    else:
        body = whole_body(reply.request.model)
        reply.head(200, "application/json", len(body))
        reply.send(body[: len(body) // 2])
        if reply.sleep(reply.timing.slow_s):
            reply.send(body[len(body) // 2 :])


def no_done(reply: Reply) -> None:
    """A stream that ends cleanly without its `[DONE]` (and without its finish); a whole body
    shorter than its Content-Length."""
    if reply.request.stream:
        if reply.sse_head():
            for event in stream_events(reply.request)[:3]:
                reply.chunk(event)
            reply.end_chunks()
    else:
        body = whole_body(reply.request.model)
        reply.head(200, "application/json", len(body))
        reply.send(body[: len(body) // 2])


def reset(reply: Reply) -> None:
    """A few tokens (half a whole body), then a TCP reset."""
    if reply.request.stream:
        if reply.sse_head():
            for event in stream_events(reply.request)[:3]:
                reply.chunk(event)
    else:
        body = whole_body(reply.request.model)
        reply.head(200, "application/json", len(body))
        reply.send(body[: len(body) // 2])
    time.sleep(0.05)  # let the bytes leave before the reset
    reply.reset()


def status_500(reply: Reply) -> None:
    reply.error(500, "internal server error", "InternalServerError")


def status_503_retry_after(reply: Reply) -> None:
    reply.error(503, "the server is overloaded", "ServiceUnavailableError", "retry-after: 1")


def status_429_retry_after(reply: Reply) -> None:
    reply.error(429, "too many requests", "RateLimitError", "retry-after: 1")


def status_429(reply: Reply) -> None:
    reply.error(429, "too many requests", "RateLimitError")


def malformed_json(reply: Reply) -> None:
    """A 200 whose JSON body stops half-way, the same for a streamed request."""
    body = whole_body(reply.request.model)
    reply.whole(200, body[: len(body) // 2])


def empty_body(reply: Reply) -> None:
    """A 200 with nothing in it."""
    reply.whole(200, b"")


def html_page(reply: Reply) -> None:
    """A 200 with an HTML error page (a proxy's or load balancer's), `text/html`."""
    page = (
        b"<html><head><title>502 Bad Gateway</title></head><body><h1>Bad Gateway</h1></body></html>"
    )
    reply.whole(200, page, "text/html")


def malformed_sse(reply: Reply) -> None:
    """An event stream of garbage: lines that are not SSE and a data event that is not JSON,
    from its first event on, then the end of a stream."""
    model = reply.request.model
    if not reply.sse_head():
        return
    reply.chunk(b"this is not an event stream\n\n")
    reply.chunk(b'data: {"id":"chatcmpl-fault","choices":[{"delta":{"content":"Hel\n\n')
    reply.chunk(chat_event(model, None, "stop"))
    reply.chunk(b"data: [DONE]\n\n")
    reply.end_chunks()


def stream_error(reply: Reply) -> None:
    """vLLM's error event inside a stream (after a few tokens), then `[DONE]`; a whole answer's
    500."""
    if reply.request.stream:
        if not reply.sse_head():
            return
        for event in stream_events(reply.request)[:3]:
            reply.chunk(event)
        error = {"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}}
        reply.chunk(b"data: " + json.dumps(error).encode() + b"\n\n")
        reply.chunk(b"data: [DONE]\n\n")
        reply.end_chunks()
    else:
        status_500(reply)


def drip(reply: Reply) -> None:
    """The answer one byte every `drip_s` (a stream's head at once)."""
    if reply.request.stream:
        if not reply.sse_head():
            return
        data = b"".join(stream_events(reply.request))
        for byte in data:
            if not reply.chunk(bytes([byte])) or not reply.sleep(reply.timing.drip_s):
                return
        reply.end_chunks()
    else:
        body = whole_body(reply.request.model)
        reply.head(200, "application/json", len(body))
        for byte in body:
            if not reply.send(bytes([byte])) or not reply.sleep(reply.timing.drip_s):
                return


def context_length(reply: Reply) -> None:
    """vLLM's 400 for a prompt over the model's context window."""
    reply.error(400, CONTEXT_LENGTH_MESSAGE, "BadRequestError")
