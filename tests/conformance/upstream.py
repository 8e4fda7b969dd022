"""A scripted raw HTTP/1.1 upstream on loopback.

A well-behaved HTTP server cannot produce the bytes a client's conformance needs: two responses
in one segment, a head cut at an arbitrary byte, a stray byte after a body, a reset instead of a
close. This server therefore speaks no HTTP of its own beyond reading requests. Every accepted
connection plays a script, a list of steps run in order, and what each connection receives is
recorded, so a test can assert how many upstream connections a client opened and which of them
it reused.

    async with ScriptedUpstream(
        [Receive(), Send(response(200, body=b"one")), Receive(), Send(response(200, body=b"two"))],
        [Receive(), Send(response(200, body=b"fresh")), Close()],
    ) as upstream:
        await client.post(upstream.url(), ...)  # the first connection plays the first script
        ...
    assert len(upstream.connections) == 1
    assert [r.body for r in upstream.connections[0].requests] == [b"{}", b"{}"]

A script that ends without `Close`, `Abort` or `Reset` holds its connection open (as `Hold`
does): further requests on it are recorded, never answered, until the client closes it.
Connections beyond the scripts given play `otherwise` (by default they are reset at once, so a
connection a test did not expect fails loudly on the client's side).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final

from yarl import URL

# Bounds every wait of the helpers below: generous, because they only guard against a hang and
# a loaded machine must not turn a slow pass into a failure.
DEFAULT_WAIT_S = 5.0

# A request head larger than this is not one the client under test sends.
_REQUEST_LIMIT = 1024 * 1024


# -- script steps -----------------------------------------------------------------------------


class Step:
    """One step of a connection's script (the classes below)."""


class Receive(Step):
    """Read one whole request (its head, then as many body bytes as its Content-Length says)
    and record it. If the client closes or resets the connection instead, the script ends."""

    def __repr__(self) -> str:
        return "Receive()"


class Send(Step):
    """Write `parts` one after another, each written and drained before the next, with
    `pause_s` between two writes, so the client may see them in separate reads."""

    def __init__(self, *parts: bytes, pause_s: float = 0.0) -> None:
        self.parts = parts
        self.pause_s = pause_s

    @classmethod
    def split(cls, data: bytes, size: int, pause_s: float = 0.0) -> Send:
        """`data` in writes of `size` bytes (the last one shorter)."""
        return cls(*(data[i : i + size] for i in range(0, len(data), size)), pause_s=pause_s)

    def __repr__(self) -> str:
        return f"Send({sum(map(len, self.parts))} bytes in {len(self.parts)}, {self.pause_s}s)"


class Pause(Step):
    """Wait `seconds` before the next step."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"Pause({self.seconds})"


class WaitFor(Step):
    """Wait until the test sets `event` (bounded by `timeout_s`; past it the script ends), so
    a test decides when the next bytes go out rather than a timer."""

    def __init__(self, event: asyncio.Event, timeout_s: float = DEFAULT_WAIT_S) -> None:
        self.event = event
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return "WaitFor(event)"


class Notify(Step):
    """Set `event`: tells the test the steps before it are done (the bytes written)."""

    def __init__(self, event: asyncio.Event) -> None:
        self.event = event

    def __repr__(self) -> str:
        return "Notify(event)"


class Close(Step):
    """Close the connection in order: the data written goes out, then FIN (over TLS, after a
    close_notify)."""

    def __repr__(self) -> str:
        return "Close()"


class Abort(Step):
    """Drop the connection without a goodbye: over TLS no close_notify (a truncation the
    client can tell from an end), over TCP a FIN."""

    def __repr__(self) -> str:
        return "Abort()"


class Reset(Step):
    """Reset the connection: SO_LINGER 0 then close, so the client gets an RST."""

    def __repr__(self) -> str:
        return "Reset()"


class Hold(Step):
    """Keep the connection open until the client closes it, recording (never answering) the
    requests that arrive meanwhile. What every script does after its last step."""

    def __repr__(self) -> str:
        return "Hold()"


Script = Sequence[Step]

# What a connection no script was written for plays: a reset, so the client fails loudly.
RESET_AT_ONCE: Final[Script] = (Reset(),)


# -- building responses -----------------------------------------------------------------------


def response(
    status: int = 200,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    reason: str = "X",
    version: str = "HTTP/1.1",
    length: bool = True,
) -> bytes:
    """A response's bytes: status line, `headers`, a Content-Length of `body` (unless `length`
    is false: then nothing frames the body), and the body."""
    lines = [f"{version} {status} {reason}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers)
    if length:
        lines.append(f"content-length: {len(body)}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1") + body


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def last_chunk(trailers: Iterable[tuple[str, str]] = ()) -> bytes:
    """The end of a chunked body, with `trailers` if any."""
    fields = "".join(f"{name}: {value}\r\n" for name, value in trailers)
    return b"0\r\n" + fields.encode("latin-1") + b"\r\n"


def chunked_head(
    status: int = 200, headers: Iterable[tuple[str, str]] = (), *, coding: str = "chunked"
) -> bytes:
    """The head of a response whose body is framed by `Transfer-Encoding: <coding>`."""
    return response(status, [*headers, ("transfer-encoding", coding)], length=False)


def answer(*responses: bytes) -> list[Step]:
    """A script answering the requests of one connection with `responses` in turn (then it
    holds the connection)."""
    steps: list[Step] = []
    for data in responses:
        steps += [Receive(), Send(data)]
    return steps


# -- what the upstream saw --------------------------------------------------------------------


@dataclass
class RecordedRequest:
    """A request as the upstream received it."""

    connection: int  # the index of the connection it came on (the order of acceptance)
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    raw: bytes

    def header(self, name: str) -> str | None:
        """The first value of header `name` (case-insensitive), or None."""
        name = name.lower()
        return next((v for n, v in self.headers if n.lower() == name), None)


@dataclass
class UpstreamConnection:
    """One accepted connection: its requests, and what became of it."""

    index: int
    requests: list[RecordedRequest] = field(default_factory=list)
    # Set once the client's end was seen closed or reset (while reading, or by a failed write).
    client_closed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set once its script ended and the upstream's side is closed (or left to the client).
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    # Socket errors met on the upstream's side (a write into a connection the client reset).
    errors: list[str] = field(default_factory=list)


# -- the server -------------------------------------------------------------------------------


class ScriptedUpstream:
    """An asyncio TCP server on 127.0.0.1 (an ephemeral port) whose connections play scripts:
    the n-th accepted connection plays `scripts[n]`, later ones `otherwise`. With `tls`, it
    speaks TLS with that server context.

    Use it as an async context manager (or `start()` then `close()`): closing stops the
    listener, cancels the scripts still running and drops their connections."""

    def __init__(
        self,
        *scripts: Script,
        otherwise: Script = RESET_AT_ONCE,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._scripts = scripts
        self._otherwise = otherwise
        self._tls = tls
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepted = asyncio.Event()  # set at every accepted connection
        self.connections: list[UpstreamConnection] = []
        self.port = 0

    async def start(self) -> ScriptedUpstream:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", 0, ssl=self._tls, limit=_REQUEST_LIMIT
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> ScriptedUpstream:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def url(self, path: str = "/v1/chat/completions") -> URL:
        """The URL of `path` on this server (https:// when it speaks TLS)."""
        scheme = "https" if self._tls is not None else "http"
        return URL.build(scheme=scheme, host="127.0.0.1", port=self.port, path=path)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received, connection by connection, in the order of acceptance."""
        return [r for conn in self.connections for r in conn.requests]

    async def wait_for_connections(self, count: int, timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Until at least `count` connections were accepted (TimeoutError past `timeout_s`)."""
        async with asyncio.timeout(timeout_s):
            while len(self.connections) < count:
                self._accepted.clear()
                await self._accepted.wait()

    async def wait_client_closed(self, index: int, timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Until the client closed (or reset) connection `index` (TimeoutError past
        `timeout_s`). Only seen while that connection's script reads: in `Receive`, or in the
        `Hold` every script ends with."""
        await self.wait_for_connections(index + 1, timeout_s)
        async with asyncio.timeout(timeout_s):
            await self.connections[index].client_closed.wait()

    # -- one connection ------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        conn = UpstreamConnection(len(self.connections))
        self.connections.append(conn)
        self._accepted.set()
        index = conn.index
        script = self._scripts[index] if index < len(self._scripts) else self._otherwise
        try:
            if await self._play(script, conn, reader, writer):
                await self._hold(conn, reader)
                writer.close()
        except (ConnectionError, OSError) as exc:
            conn.errors.append(repr(exc))
            conn.client_closed.set()
            writer.transport.abort()
        except asyncio.CancelledError:
            # Only `close()` cancels a script. The task ends normally rather than cancelled:
            # asyncio's stream protocol (3.11) logs a cancelled connection task as an error.
            writer.transport.abort()
        finally:
            conn.finished.set()
            if task is not None:
                self._tasks.discard(task)

    async def _play(
        self,
        script: Script,
        conn: UpstreamConnection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Run the steps; true if the connection is still open at the end (it is then held)."""
        for step in script:
            if isinstance(step, Receive):
                if not await self._receive(conn, reader):
                    conn.client_closed.set()
                    writer.close()
                    return False
            elif isinstance(step, Send):
                for i, part in enumerate(step.parts):
                    if i and step.pause_s > 0:
                        await asyncio.sleep(step.pause_s)
                    writer.write(part)
                    await writer.drain()
            elif isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
            elif isinstance(step, WaitFor):
                try:
                    async with asyncio.timeout(step.timeout_s):
                        await step.event.wait()
                except TimeoutError:
                    conn.errors.append("the test never set the event waited for")
                    writer.transport.abort()
                    return False
            elif isinstance(step, Notify):
                step.event.set()
            elif isinstance(step, Close):
                writer.close()
                return False
            elif isinstance(step, Abort):
                writer.transport.abort()
                return False
            elif isinstance(step, Reset):
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    # Linger on, timeout 0: close() discards the unsent data and sends an RST.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return False
            elif isinstance(step, Hold):
                return True
            else:
                raise TypeError(f"not a script step: {step!r}")
        return True

    async def _hold(self, conn: UpstreamConnection, reader: asyncio.StreamReader) -> None:
        while await self._receive(conn, reader):
            pass
        conn.client_closed.set()

    async def _receive(self, conn: UpstreamConnection, reader: asyncio.StreamReader) -> bool:
        """Read and record one request; false if the client's end closed first."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        lines = head[:-4].decode("latin-1").split("\r\n")
        request_line = lines[0].split(" ")
        method = request_line[0]
        target = request_line[1] if len(request_line) > 1 else ""
        headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers.append((name, value.strip()))
        length = next((v for n, v in headers if n.lower() == "content-length"), "0")
        try:
            body = await reader.readexactly(int(length))
        except asyncio.IncompleteReadError:
            return False
        conn.requests.append(
            RecordedRequest(conn.index, method, target, headers, body, head + body)
        )
        return True
