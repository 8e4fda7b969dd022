"""The data plane's HTTP/1.1 client against scripted servers on loopback: framing, connection
reuse, and every way an upstream can fail before or during its answer."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trustme
from yarl import URL

from gateway.errors import (
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamReset,
    UpstreamTimeout,
)
from gateway.upstream.h1 import H1Client, UpstreamResponseHead, _request, _request_line_parts
from tests.support import closed_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEADERS = [("content-type", "application/json"), ("x-request-id", "r1")]


class Server:
    """A loopback server answering each request with `handler`; counts its connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a client closed a connection

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.closed.set()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


def answering(*responses: bytes, then_close: bool = False) -> Callable[[Server], Handler]:
    """A handler answering the requests of one connection with `responses` in turn."""

    def make(server: Server) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for response in responses:
                server.requests.append(await read_request(reader))
                writer.write(response)
                await writer.drain()
            if not then_close:
                await reader.read()  # until the client closes

        return handle

    return make


def writing_then_closing(data: bytes) -> Callable[[Server], Handler]:
    """A handler that reads one request, writes `data` and closes the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(data)
        await writer.drain()

    return lambda server: handle


def chunked_in_steps(*steps: tuple[asyncio.Event, bytes]) -> Callable[[Server], Handler]:
    """A handler that reads one request and answers with a chunked head, then each step's
    bytes once its event is set, then the last chunk."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for event, data in steps:
            await writer.drain()
            await event.wait()
            writer.write(data)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    return lambda server: handle


@asynccontextmanager
async def running(make: Callable[[Server], Handler]) -> AsyncIterator[tuple[Server, URL]]:
    server = Server(lambda r, w: asyncio.sleep(0))
    server.handler = make(server)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield server, URL(f"http://127.0.0.1:{port}/v1/chat/completions")
    finally:
        listener.close()


@asynccontextmanager
async def one_response(make: Callable[[Server], Handler]) -> AsyncIterator[UpstreamResponseHead]:
    """The response to one request to a server answering with `make`'s handler."""
    client = H1Client(keepalive_s=4.0)
    async with running(make) as (_, url):
        response = await client.post(url, [], b"{}", connect_s=1.0, tls=False)
        try:
            yield response
        finally:
            response.release()
    client.close()


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def post(client: H1Client, url: URL, body: bytes = b"{}") -> bytes:
    response = await client.post(url, HEADERS, body, connect_s=1.0, tls=False)
    try:
        assert response.status == 200
        return await response.read()
    finally:
        response.release()


async def test_a_kept_alive_connection_carries_the_next_requests() -> None:
    client = H1Client(keepalive_s=4.0)
    async with running(answering(ok(), ok(), ok())) as (server, url):
        assert [await post(client, url) for _ in range(3)] == [b'{"ok":true}'] * 3
    assert server.connections == 1
    client.close()


async def test_the_request_bytes() -> None:
    client = H1Client(keepalive_s=4.0)
    async with running(answering(ok())) as (server, url):
        response = await client.post(
            url, HEADERS, b'{"model":"m"}', query="a=1", connect_s=1.0, tls=False
        )
        await response.read()
        response.release()
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions?a=1 HTTP/1.1"
    assert lines[1] == b"host: 127.0.0.1:%d" % url.port
    assert lines[2:] == [
        b"content-type: application/json",
        b"x-request-id: r1",
        b"content-length: 13",
    ]
    assert body == b'{"model":"m"}'
    client.close()


def test_the_host_header_of_an_ipv6_upstream_and_a_default_port() -> None:
    ipv6 = _request(*_request_line_parts(URL("http://[::1]:8000/x")), [], b"")
    assert b"\r\nhost: [::1]:8000\r\n" in ipv6
    default_port = _request(*_request_line_parts(URL("https://example.com/x")), [], b"")
    assert b"\r\nhost: example.com\r\n" in default_port


async def test_a_response_that_closes_the_connection_is_not_reused() -> None:
    closing = ok(extra=b"connection: close\r\n")
    client = H1Client(keepalive_s=4.0)
    async with running(answering(closing, then_close=True)) as (server, url):
        assert await post(client, url) == b'{"ok":true}'
        assert await post(client, url) == b'{"ok":true}'
    assert server.connections == 2
    client.close()


async def test_an_idle_connection_past_keepalive_is_not_reused() -> None:
    client = H1Client(keepalive_s=0.0)  # every idle connection is already too old
    async with running(answering(ok(), ok())) as (server, url):
        await post(client, url)
        await post(client, url)
    assert server.connections == 2
    client.close()


async def test_a_connection_the_upstream_closes_while_idle_leaves_the_pool() -> None:
    client = H1Client(keepalive_s=4.0)
    async with running(answering(ok(), then_close=True)) as (server, url):
        await post(client, url)
        await server.closed.wait()
        for _ in range(100):  # the client's side hears of the close within a few loop turns
            if not client._pools[("http", "127.0.0.1", url.port or 0, 0, None, None)]._idle:
                break
            await asyncio.sleep(0)
        assert await post(client, url) == b'{"ok":true}'
    assert server.connections == 2
    client.close()


async def test_a_chunked_body_arrives_chunk_by_chunk() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await go.wait()
        writer.write(b"6\r\n world\r\n0\r\n\r\n")
        await writer.drain()
        await read_request(reader)
        writer.write(ok())
        await writer.drain()
        await reader.read()

    go = asyncio.Event()
    client = H1Client(keepalive_s=4.0)
    async with running(lambda server: handle) as (server, url):
        response = await client.post(url, [], b"{}", connect_s=1.0, tls=False)
        assert response.content_length is None
        assert await response.readany() == b"hello"
        assert response.connection is not None  # not read to its end yet
        go.set()
        assert await response.readany() == b" world"
        assert await response.readany() == b""
        assert response.connection is None
        response.release()
        assert await post(client, url) == b'{"ok":true}'  # over the same connection
    assert server.connections == 1
    client.close()


async def test_a_pump_hands_its_tap_the_pieces_it_takes_and_returns_the_first_it_declines() -> None:
    """Pieces arrive one at a time: the tap takes `a` and `b` as they come, declines `c`, which
    the pump returns; what comes after (`d`) goes to the reader too; the end is b""."""
    steps = [asyncio.Event() for _ in range(4)]
    pieces = [
        (step, b"1\r\n%b\r\n" % piece)
        for step, piece in zip(steps, (b"a", b"b", b"c", b"d"), strict=True)
    ]
    taken: list[bytes] = []

    def tap(piece: bytes) -> bool:
        if piece == b"c":
            return False
        taken.append(piece)
        steps[len(taken)].set()  # the server sends the next one once this one is taken
        return True

    async with one_response(chunked_in_steps(*pieces)) as response:
        steps[0].set()
        assert await response.pump(tap) == b"c"
        assert taken == [b"a", b"b"]
        steps[3].set()
        assert await response.readany() == b"d"  # the tap is gone: the reader's again
        assert await response.pump(tap) == b""  # the end, nothing left to tap
        assert taken == [b"a", b"b"]


async def test_a_tap_that_stops_the_pump_gets_nothing_more_and_the_reader_its_task() -> None:
    first, go = asyncio.Event(), asyncio.Event()
    taken: list[bytes] = []

    steps = chunked_in_steps((first, b"1\r\na\r\n"), (go, b"1\r\nb\r\n"))
    async with one_response(steps) as response:

        def tap(piece: bytes) -> bool:
            taken.append(piece)
            response.stop_pump()
            return True

        first.set()  # sent once the pump waits
        assert await response.pump(tap) is None
        go.set()
        assert await response.readany() == b"b"  # not handed to the tap
        assert taken == [b"a"]


async def test_a_pump_raises_what_broke_the_connection() -> None:
    short = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b"
    async with one_response(writing_then_closing(short)) as response:
        taken: list[bytes] = []
        with pytest.raises(UpstreamReset, match="body"):
            while await response.pump(lambda piece: taken.append(piece) is None):
                pass  # (pieces already read before the pump came back to the reader)
        assert b"".join(taken) in (b"", b"only ten b")


async def test_a_body_without_length_ends_with_the_connection() -> None:
    unframed = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it"
    client = H1Client(keepalive_s=4.0)
    async with running(writing_then_closing(unframed)) as (_, url):
        assert await post(client, url) == b"all of it"
    client.close()


async def test_headers_are_read_case_insensitively_and_kept_raw() -> None:
    response_bytes = ok(extra=b"X-Custom: One\r\nx-custom: two\r\nRetry-After: 3\r\n")
    client = H1Client(keepalive_s=4.0)
    async with running(answering(response_bytes)) as (_server, url):
        response = await client.post(url, [], b"{}", connect_s=1.0, tls=False)
        assert response.headers.get("retry-after") == "3"
        assert response.headers.get("X-CUSTOM") == "One"  # the first, as multidicts give it
        assert "x-custom" in response.headers and "x-absent" not in response.headers
        assert (b"X-Custom", b"One") in response.raw_headers
        assert response.content_length == len(b'{"ok":true}')
        await response.read()
        response.release()
    client.close()


async def test_an_interim_100_continue_is_skipped() -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    client = H1Client(keepalive_s=4.0)
    async with running(answering(interim + ok())) as (_server, url):
        assert await post(client, url) == b'{"ok":true}'
    client.close()


async def test_a_close_before_the_headers_is_a_reset_of_the_first_byte() -> None:
    client = H1Client(keepalive_s=4.0)
    async with running(writing_then_closing(b"HTTP/1.1 200 OK\r\ncontent-le")) as (_, url):
        with pytest.raises(UpstreamReset, match="first_byte"):
            await client.post(url, [], b"{}", connect_s=1.0, tls=False)
    client.close()


async def test_a_close_in_the_middle_of_the_body_is_a_reset_of_the_body() -> None:
    short = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b"
    client = H1Client(keepalive_s=4.0)
    async with running(writing_then_closing(short)) as (_, url):
        response = await client.post(url, [], b"{}", connect_s=1.0, tls=False)
        assert await response.readany() == b"only ten b"
        with pytest.raises(UpstreamReset, match="body"):
            await response.readany()
        response.release()
    client.close()


async def test_bytes_that_are_not_http_are_a_protocol_error() -> None:
    client = H1Client(keepalive_s=4.0)
    async with running(answering(b"SSH-2.0-OpenSSH\r\n\r\n")) as (_server, url):
        with pytest.raises(UpstreamProtocolError) as caught:
            await client.post(url, [], b"{}", connect_s=1.0, tls=False)
    assert "SSH" not in str(caught.value)  # upstream bytes are never quoted back
    client.close()


async def test_a_refused_connection_is_a_connect_error() -> None:
    client = H1Client(keepalive_s=4.0)
    url = URL(f"http://127.0.0.1:{closed_port()}/v1/chat/completions")
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await client.post(url, [], b"{}", connect_s=1.0, tls=False)
    client.close()


async def test_a_tls_handshake_that_never_ends_is_a_connect_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts TCP, never speaks TLS

    client = H1Client(keepalive_s=4.0)
    async with running(lambda server: silent) as (_server, url):
        tls_url = url.with_scheme("https")
        with pytest.raises(UpstreamTimeout) as caught:
            await client.post(tls_url, [], b"{}", connect_s=0.2, tls=True)
    assert caught.value.phase == "connect"
    client.close()


async def test_https_with_the_pools_ca_and_a_wrong_one() -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ssl)
    server = Server(lambda r, w: asyncio.sleep(0))
    server.handler = answering(ok(), ok())(server)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0, ssl=server_ssl)
    port = listener.sockets[0].getsockname()[1]
    url = URL(f"https://localhost:{port}/v1/chat/completions")
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    client = H1Client(keepalive_s=4.0)
    try:
        response = await client.post(url, [], b"{}", connect_s=2.0, tls=trusting)
        assert await response.read() == b'{"ok":true}'
        response.release()
        with pytest.raises(UpstreamConnectError):
            await client.post(url, [], b"{}", connect_s=2.0, tls=ssl.create_default_context())
    finally:
        client.close()
        listener.close()
    assert server.connections >= 1


async def test_a_cancelled_request_closes_its_connection() -> None:
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        started.set()
        await reader.read()  # returns once the client closes

    started = asyncio.Event()
    client = H1Client(keepalive_s=4.0)
    async with running(lambda server: hang) as (server, url):
        task = asyncio.create_task(client.post(url, [], b"{}", connect_s=1.0, tls=False))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.closed.wait(), 5)
    client.close()


async def test_a_large_body_read_slowly_arrives_whole() -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: past the read pause threshold
    client = H1Client(keepalive_s=4.0)
    async with running(answering(ok(body))) as (_server, url):
        response = await client.post(url, [], b"{}", connect_s=1.0, tls=False)
        received = bytearray()
        while chunk := await response.readany():
            received += chunk
            await asyncio.sleep(0)
        response.release()
    assert bytes(received) == body
    client.close()


async def test_an_idle_connection_that_receives_bytes_is_closed_not_reused() -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok())
        await writer.drain()
        await answered.wait()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale")  # nobody asked
        await writer.drain()
        await reader.read()

    answered = asyncio.Event()
    client = H1Client(keepalive_s=4.0)
    async with running(lambda server: chatty) as (server, url):
        await post(client, url)
        answered.set()
        await asyncio.wait_for(server.closed.wait(), 5)  # the client hung up on it
    client.close()


async def test_pools_left_without_connections_are_forgotten() -> None:
    client = H1Client(keepalive_s=0.0)  # nothing stays idle: every pool empties after use
    async with running(answering(ok())) as (_, first), running(answering(ok())) as (_, second):
        await post(client, first)
        await post(client, second)
    assert [origin[2] for origin in client._pools] == [second.port]
    client.close()
