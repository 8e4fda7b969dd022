"""The data plane's HTTP/1.1 client against real servers: uvicorn (both of its HTTP
implementations: vLLM runs on it), aiohttp's server, nginx, and TLS (a trustme certificate).

Each server tells the client which connection served a request (the client's port, or nginx's
`$connection`), so reuse is asserted from the server's side: Content-Length and chunked bodies,
streams read as they come, keep-alive across requests, `Connection: close`, and the server's
`Keep-Alive: timeout=` hint.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from aiohttp import web
from yarl import URL

from gateway.upstream.h1 import H1Client
from loadtests.bench.nginx import NginxServer, _config, find_nginx

from .client import REQUEST_HEADERS, fetch, post, read_exactly
from .upstream import DEFAULT_WAIT_S

SSE_EVENTS = [b'data: {"n":%d}\n\n' % n for n in range(3)]


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


# -- uvicorn ---------------------------------------------------------------------------------


async def _asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]
    who = [(b"x-peer", str(scope["client"][1]).encode())]
    if path == "/v1/length":
        body = b'{"answer":"whole"}'
        headers = [*who, (b"content-type", b"application/json")]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif path == "/v1/sse":
        headers = [*who, (b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for event in SSE_EVENTS:
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b""})
    else:  # /v1/close
        headers = [*who, (b"connection", b"close"), (b"content-length", b"3")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"bye"})


@asynccontextmanager
async def _uvicorn(http: str) -> AsyncIterator[URL]:
    sock = _listener()
    config = uvicorn.Config(_asgi, http=http, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(DEFAULT_WAIT_S):
            while not server.started:  # noqa: ASYNC110 - uvicorn offers no event to wait on
                await asyncio.sleep(0.01)
        yield URL.build(scheme="http", host="127.0.0.1", port=sock.getsockname()[1])
    finally:
        server.should_exit = True
        await task
        sock.close()


# -- aiohttp's server ------------------------------------------------------------------------


async def _aiohttp_length(request: web.Request) -> web.StreamResponse:
    await request.read()
    peer = request.transport.get_extra_info("peername")[1] if request.transport else 0
    return web.Response(
        body=b'{"answer":"whole"}',
        content_type="application/json",
        headers={"x-peer": str(peer)},
    )


async def _aiohttp_sse(request: web.Request) -> web.StreamResponse:
    await request.read()
    peer = request.transport.get_extra_info("peername")[1] if request.transport else 0
    response = web.StreamResponse(
        headers={"content-type": "text/event-stream", "x-peer": str(peer)}
    )
    await response.prepare(request)
    for event in SSE_EVENTS:
        await response.write(event)
        await asyncio.sleep(0.01)
    await response.write_eof()
    return response


async def _aiohttp_alpn(request: web.Request) -> web.StreamResponse:
    await request.read()
    tls = request.transport.get_extra_info("ssl_object") if request.transport else None
    return web.Response(body=str(tls.selected_alpn_protocol() if tls else None).encode())


async def _aiohttp_close(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.Response(body=b"bye")
    response.force_close()
    return response


@asynccontextmanager
async def _aiohttp(tls: ssl.SSLContext | None = None) -> AsyncIterator[URL]:
    app = web.Application()
    app.router.add_post("/v1/length", _aiohttp_length)
    app.router.add_post("/v1/sse", _aiohttp_sse)
    app.router.add_post("/v1/close", _aiohttp_close)
    app.router.add_post("/v1/alpn", _aiohttp_alpn)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = _listener()
    site = web.SockSite(runner, sock, ssl_context=tls)
    await site.start()
    try:
        scheme = "https" if tls is not None else "http"
        yield URL.build(scheme=scheme, host="127.0.0.1", port=sock.getsockname()[1])
    finally:
        await runner.cleanup()
        sock.close()


SERVERS = {
    "uvicorn-httptools": lambda: _uvicorn("httptools"),
    "uvicorn-h11": lambda: _uvicorn("h11"),
    "aiohttp": lambda: _aiohttp(),
}


@pytest.mark.parametrize("server", SERVERS)
async def test_whole_answers_keep_one_connection(client: H1Client, server: str) -> None:
    async with SERVERS[server]() as base:
        replies = [await fetch(client, base.with_path("/v1/length")) for _ in range(5)]
    assert {(r.status, r.body) for r in replies} == {(200, b'{"answer":"whole"}')}
    assert len({r.values("x-peer")[0] for r in replies}) == 1


@pytest.mark.parametrize("server", SERVERS)
async def test_an_sse_stream_is_read_as_it_comes_and_keeps_the_connection(
    client: H1Client, server: str
) -> None:
    async with SERVERS[server]() as base:
        peers = []
        for _ in range(2):
            head = await post(client, base.with_path("/v1/sse"))
            try:
                first = await read_exactly(head, len(SSE_EVENTS[0]))
                rest = await head.read()
            finally:
                head.release()
            assert first.startswith(SSE_EVENTS[0])
            assert first + rest == b"".join(SSE_EVENTS)
            peers.append(head.headers.get("x-peer"))
    assert peers[0] == peers[1]


@pytest.mark.parametrize("server", SERVERS)
async def test_connection_close_is_honoured(client: H1Client, server: str) -> None:
    async with SERVERS[server]() as base:
        for _ in range(2):
            reply = await fetch(client, base.with_path("/v1/close"))
            assert (reply.status, reply.body) == (200, b"bye")
        # Each answer ended its connection: nothing was pooled.
        assert sum(p.connections for p in client._pools.values()) == 0


async def test_tls_whole_answers_and_streams_keep_one_connection(
    client: H1Client, tls_pair: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    server_tls, client_tls = tls_pair
    server_tls.set_alpn_protocols(["h2", "http/1.1"])
    async with _aiohttp(server_tls) as base:
        alpn = await fetch(client, base.with_path("/v1/alpn"), tls=client_tls)
        replies = [
            await fetch(client, base.with_path("/v1/length"), tls=client_tls) for _ in range(3)
        ]
        head = await post(client, base.with_path("/v1/sse"), tls=client_tls)
        try:
            streamed = await head.read()
        finally:
            head.release()
    assert alpn.body == b"http/1.1"  # offered by the client, so never h2
    assert {r.body for r in replies} == {b'{"answer":"whole"}'}
    assert streamed == b"".join(SSE_EVENTS)
    assert len({r.values("x-peer")[0] for r in replies} | {head.headers.get("x-peer")}) == 1


# -- nginx -----------------------------------------------------------------------------------


def _nginx_config(prefix: Path, port: int) -> str:
    server = """
        keepalive_timeout 30s 30;
        add_header x-connection $connection always;
        location = /v1/length {
            default_type application/json;
            return 200 '{"answer":"whole"}';
        }
        location = /v1/gzip {
            default_type application/json;
            gzip on;
            gzip_types application/json;
            gzip_min_length 1;
            return 200 '{"answer":"compressed and chunked"}';
        }
        location = /v1/close {
            keepalive_timeout 0;
            return 200 'bye';
        }
        location = /v1/hinted {
            keepalive_timeout 1s 1;
            return 200 'hinted';
        }"""
    return _config(prefix, port, None, server, "")


@pytest.fixture(scope="module")
def nginx() -> Iterator[URL]:
    binary = find_nginx()
    assert binary is not None, "nginx is installed by `make system-deps`"
    server = NginxServer(binary, _nginx_config, name="conformance")
    try:
        yield URL.build(scheme="http", host="127.0.0.1", port=server.port)
    finally:
        server.stop()


async def test_nginx_keeps_one_connection_and_announces_its_timeout(
    client: H1Client, nginx: URL
) -> None:
    replies = [await fetch(client, nginx.with_path("/v1/length")) for _ in range(5)]
    assert {(r.status, r.body) for r in replies} == {(200, b'{"answer":"whole"}')}
    assert replies[0].values("keep-alive") == ["timeout=30"]
    assert len({r.values("x-connection")[0] for r in replies}) == 1


async def test_nginx_gzip_is_chunked_and_relayed_still_encoded(
    client: H1Client, nginx: URL
) -> None:
    headers = [*REQUEST_HEADERS, ("accept-encoding", "gzip")]
    async with asyncio.timeout(DEFAULT_WAIT_S):
        head = await client.post(
            nginx.with_path("/v1/gzip"), headers, b"{}", connect_s=DEFAULT_WAIT_S, tls=False
        )
        try:
            body = await head.read()
        finally:
            head.release()
    assert head.headers.get("transfer-encoding") == "chunked"
    assert head.headers.get("content-encoding") == "gzip"
    assert gzip.decompress(body) == b'{"answer":"compressed and chunked"}'


async def test_nginx_connection_close_and_a_short_keep_alive_are_honoured(
    client: H1Client, nginx: URL
) -> None:
    closed = [await fetch(client, nginx.with_path("/v1/close")) for _ in range(2)]
    assert [r.values("connection") for r in closed] == [["close"], ["close"]]
    assert closed[0].values("x-connection") != closed[1].values("x-connection")
    # `Keep-Alive: timeout=1`: kept for less than the second the margin takes, so not at all.
    hinted = [await fetch(client, nginx.with_path("/v1/hinted")) for _ in range(2)]
    assert hinted[0].values("keep-alive") == ["timeout=1"]
    assert hinted[0].values("x-connection") != hinted[1].values("x-connection")
