"""What the data plane's HTTP/1.1 client does right and must keep doing: every way a response
can be framed, and when a connection is (and is not) reused."""

from __future__ import annotations

import asyncio
import gzip
import ssl

import pytest

from gateway.errors import UpstreamReset
from gateway.ingress.headers import response_headers
from gateway.upstream.h1 import H1Client

from .client import Reply, fetch, post, read_exactly
from .upstream import (
    Abort,
    Close,
    Receive,
    Reset,
    ScriptedUpstream,
    Send,
    WaitFor,
    answer,
    chunk,
    chunked_head,
    last_chunk,
    response,
)

JSON = [("content-type", "application/json")]


async def test_a_content_length_body(client: H1Client) -> None:
    async with ScriptedUpstream(answer(response(200, JSON, b'{"ok":true}'))) as upstream:
        reply = await fetch(client, upstream.url(), b'{"model":"m"}')
    assert reply.status == 200
    assert reply.values("content-type") == ["application/json"]
    assert reply.content_length == 11
    assert reply.body == b'{"ok":true}'
    [request] = upstream.requests
    assert (request.method, request.target) == ("POST", "/v1/chat/completions")
    assert request.body == b'{"model":"m"}'


async def test_keep_alive_carries_sequential_requests_on_one_connection(
    client: H1Client,
) -> None:
    script = answer(response(body=b"one"), response(body=b"two"), response(body=b"three"))
    async with ScriptedUpstream(script) as upstream:
        bodies = [(await fetch(client, upstream.url(), b"%d" % n)).body for n in range(3)]
    assert bodies == [b"one", b"two", b"three"]
    assert len(upstream.connections) == 1
    assert [r.body for r in upstream.connections[0].requests] == [b"0", b"1", b"2"]


async def test_a_chunked_body(client: H1Client) -> None:
    chunked = chunked_head() + chunk(b"hello") + chunk(b", ") + chunk(b"world") + last_chunk()
    script = answer(chunked, response(body=b"next"))
    async with ScriptedUpstream(script) as upstream:
        reply = await fetch(client, upstream.url())
        assert (await fetch(client, upstream.url())).body == b"next"
    assert reply.content_length is None
    assert reply.body == b"hello, world"
    assert len(upstream.connections) == 1  # a chunked body ends the message: kept alive


async def test_a_chunked_body_cut_at_every_byte(client: H1Client) -> None:
    """A head and chunk framing split at arbitrary points still parse into the same body."""
    data = chunked_head(headers=JSON) + chunk(b"abc") + chunk(b"defgh") + last_chunk()
    script = [Receive(), Send.split(data, 1, pause_s=0.001)]
    async with ScriptedUpstream(script) as upstream:
        reply = await fetch(client, upstream.url())
    assert reply.status == 200
    assert reply.values("content-type") == ["application/json"]
    assert reply.body == b"abcdefgh"


async def test_a_close_delimited_body_ends_with_the_connection(client: H1Client) -> None:
    head = response(200, [("content-type", "text/plain")], length=False)
    script = [Receive(), Send(head, b"all of ", b"it", pause_s=0.01), Close()]
    async with ScriptedUpstream(script, answer(response(body=b"next"))) as upstream:
        reply = await fetch(client, upstream.url())
        second = await fetch(client, upstream.url())
    assert reply.body == b"all of it"
    assert reply.content_length is None
    assert second.body == b"next"
    assert len(upstream.connections) == 2


async def test_an_http_1_0_response_is_not_reused(client: H1Client) -> None:
    """HTTP/1.0 without keep-alive ends the connection after the response, even if the
    upstream leaves it open."""
    http10 = response(200, body=b"hello", version="HTTP/1.0")
    async with ScriptedUpstream(answer(http10), answer(response(body=b"next"))) as upstream:
        reply = await fetch(client, upstream.url())
        second = await fetch(client, upstream.url())
        await upstream.wait_client_closed(0)
    assert reply.body == b"hello"
    assert second.body == b"next"
    assert [len(conn.requests) for conn in upstream.connections] == [1, 1]


async def test_an_http_1_0_close_delimited_body(client: H1Client) -> None:
    http10 = response(200, body=b"", version="HTTP/1.0", length=False)
    script = [Receive(), Send(http10, b"until ", b"the end", pause_s=0.01), Close()]
    async with ScriptedUpstream(script) as upstream:
        reply = await fetch(client, upstream.url())
    assert reply.status == 200
    assert reply.body == b"until the end"


async def test_a_204_has_no_body_and_keeps_the_connection(client: H1Client) -> None:
    no_content = response(204, [("x-request-id", "r1")], length=False)
    async with ScriptedUpstream(answer(no_content, response(body=b"next"))) as upstream:
        reply = await fetch(client, upstream.url())
        second = await fetch(client, upstream.url())
    assert (reply.status, reply.body) == (204, b"")
    assert reply.values("x-request-id") == ["r1"]
    assert second.body == b"next"
    assert len(upstream.connections) == 1


async def test_a_304_with_a_content_length_has_no_body(client: H1Client) -> None:
    """A 304's Content-Length describes the representation it stands for, not a body: the
    next response follows the head at once."""
    not_modified = response(304, [("content-length", "10")], length=False)
    async with ScriptedUpstream(answer(not_modified, response(body=b"next"))) as upstream:
        reply = await fetch(client, upstream.url())
        second = await fetch(client, upstream.url())
    assert (reply.status, reply.body) == (304, b"")
    assert second.body == b"next"
    assert len(upstream.connections) == 1


async def test_connection_close_is_not_reused_even_if_the_upstream_keeps_it(
    client: H1Client,
) -> None:
    closing = response(200, [("connection", "close")], b"bye")
    async with ScriptedUpstream(answer(closing), answer(response(body=b"next"))) as upstream:
        reply = await fetch(client, upstream.url())
        second = await fetch(client, upstream.url())
        await upstream.wait_client_closed(0)  # the client hung up rather than pooling it
    assert reply.body == b"bye"
    assert second.body == b"next"
    assert [len(conn.requests) for conn in upstream.connections] == [1, 1]


async def test_an_sse_stream_is_read_event_by_event(client: H1Client) -> None:
    """Each event reaches the reader while the upstream still holds the next one back."""
    events = [b'data: {"n":%d}\n\n' % n for n in range(3)]
    released = [asyncio.Event(), asyncio.Event()]
    sse = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
    script = [
        Receive(),
        Send(chunked_head(headers=sse) + chunk(events[0])),
        WaitFor(released[0]),
        # One event over two writes: the reader may get it in pieces.
        Send(chunk(events[1])[:7], chunk(events[1])[7:], pause_s=0.01),
        WaitFor(released[1]),
        Send(chunk(events[2]) + last_chunk()),
        *answer(response(body=b"next")),
    ]
    async with ScriptedUpstream(script) as upstream:
        head = await post(client, upstream.url())
        try:
            assert head.headers.get("content-type") == "text/event-stream"
            assert head.content_length is None
            assert await read_exactly(head, len(events[0])) == events[0]
            released[0].set()
            assert await read_exactly(head, len(events[1])) == events[1]
            released[1].set()
            assert await read_exactly(head, len(events[2])) == events[2]
            assert await read_exactly(head, 1) == b""  # the end of the stream
        finally:
            head.release()
        assert (await fetch(client, upstream.url())).body == b"next"
    assert len(upstream.connections) == 1


async def test_an_interim_103_is_skipped_and_its_headers_are_not_merged(
    client: H1Client,
) -> None:
    early = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
    async with ScriptedUpstream(answer(early + response(200, JSON, b"{}"))) as upstream:
        reply = await fetch(client, upstream.url())
    assert (reply.status, reply.body) == (200, b"{}")
    assert "link" not in reply.names


async def test_chunked_as_the_final_coding_after_another_is_dechunked(client: H1Client) -> None:
    """`gzip, chunked`: chunked is the final coding, so it frames the body; the gzip coding is
    left for the client to undo (the bytes pass through as they are), named as its content
    coding (`identity` is none)."""
    coded = chunked_head(headers=[("content-encoding", "identity")], coding="gzip, chunked")
    script = answer(coded + chunk(b"\x1f\x8b") + chunk(b"rest") + last_chunk())
    async with ScriptedUpstream(script) as upstream:
        reply = await fetch(client, upstream.url())
    assert reply.status == 200
    assert reply.body == b"\x1f\x8brest"
    assert reply.values("content-encoding") == ["gzip"]


def relayed_headers(reply: Reply) -> dict[bytes, list[bytes]]:
    """The reply's headers as the relay hands them to the client, every value by name."""
    fields: dict[bytes, list[bytes]] = {}
    for name, value in response_headers(reply.raw_headers, drop_length=False):
        fields.setdefault(name, []).append(value)
    return fields


async def test_a_gzip_transfer_coding_reaches_the_client_as_its_content_coding(
    client: H1Client,
) -> None:
    """The body stays gzipped and the Transfer-Encoding is hop-by-hop: the client is told the
    gzip by a Content-Encoding, and undoes it to the backend's bytes."""
    original = b'{"choices":[{"text":"' + b"squeezed " * 200 + b'"}]}'
    coded = gzip.compress(original)
    half = len(coded) // 2
    head = chunked_head(headers=JSON, coding="gzip, chunked")
    script = answer(head + chunk(coded[:half]) + chunk(coded[half:]) + last_chunk())
    async with ScriptedUpstream(script) as upstream:
        reply = await fetch(client, upstream.url())
    assert reply.status == 200
    assert reply.body == coded
    relayed = relayed_headers(reply)
    assert relayed[b"content-encoding"] == [b"gzip"]
    assert b"transfer-encoding" not in relayed
    assert relayed[b"content-type"] == [b"application/json"]
    assert gzip.decompress(reply.body) == original


async def test_transfer_codings_follow_the_content_codings_the_backend_declared(
    client: H1Client,
) -> None:
    """`Content-Encoding: br` and `Transfer-Encoding: gzip, chunked`: brotli was applied first,
    then gzip; the client is told both, in that order, in one field."""
    brotli = b"\x8b\x02\x80 stands in for a brotli-coded body"  # relayed, never decoded
    coded = gzip.compress(brotli)
    head = chunked_head(headers=[("content-encoding", "br")], coding="gzip, chunked")
    script = answer(head + chunk(coded) + last_chunk(), response(body=b"next"))
    async with ScriptedUpstream(script) as upstream:
        reply = await fetch(client, upstream.url())
        assert (await fetch(client, upstream.url())).body == b"next"
    assert reply.values("content-encoding") == ["br, gzip"]
    relayed = relayed_headers(reply)
    assert relayed[b"content-encoding"] == [b"br, gzip"]
    assert b"transfer-encoding" not in relayed
    assert gzip.decompress(reply.body) == brotli
    assert len(upstream.connections) == 1  # the chunked end still ends the message


async def test_a_head_of_exactly_100_fields_is_accepted(client: H1Client) -> None:
    fields = [(f"x-field-{n}", "v") for n in range(99)]  # and Content-Length: 100
    async with ScriptedUpstream(answer(response(200, fields, b"ok"))) as upstream:
        reply = await fetch(client, upstream.url())
    assert reply.status == 200
    assert len(reply.raw_headers) == 100
    assert reply.body == b"ok"


async def test_a_head_under_64_kib_in_pieces_is_accepted(client: H1Client) -> None:
    value = "v" * (60 * 1024)
    data = response(200, [("x-large", value)], b"ok")
    async with ScriptedUpstream([Receive(), Send.split(data, 4096, pause_s=0.001)]) as upstream:
        reply = await fetch(client, upstream.url())
    assert reply.values("x-large") == [value]
    assert reply.body == b"ok"


async def test_a_reset_before_the_first_byte_is_a_reset_of_the_first_byte(
    client: H1Client,
) -> None:
    async with ScriptedUpstream([Receive(), Reset()]) as upstream:
        with pytest.raises(UpstreamReset, match="first_byte"):
            await fetch(client, upstream.url())
    assert len(upstream.requests) == 1


async def test_a_reset_in_the_middle_of_the_body_is_a_reset_of_the_body(
    client: H1Client,
) -> None:
    head_and_some = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b"
    async with ScriptedUpstream([Receive(), Send(head_and_some), Reset()]) as upstream:
        with pytest.raises(UpstreamReset, match="body"):
            await fetch(client, upstream.url())


async def test_a_close_before_a_content_length_body_ends_is_a_reset_of_the_body(
    client: H1Client,
) -> None:
    head_and_some = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b"
    async with ScriptedUpstream([Receive(), Send(head_and_some), Abort()]) as upstream:
        with pytest.raises(UpstreamReset, match="body"):
            await fetch(client, upstream.url())


async def test_a_pooled_connection_the_upstream_closed_is_not_used(client: H1Client) -> None:
    script = [Receive(), Send(response(body=b"one")), Close()]
    async with ScriptedUpstream(script, answer(response(body=b"two"))) as upstream:
        assert (await fetch(client, upstream.url())).body == b"one"
        await upstream.connections[0].finished.wait()
        # Loopback: the FIN reaches the client's idle connection long before this ends.
        await asyncio.sleep(0.1)
        assert (await fetch(client, upstream.url())).body == b"two"
    assert [len(conn.requests) for conn in upstream.connections] == [1, 1]


@pytest.mark.parametrize("orderly", [True, False], ids=["close_notify", "bare-fin"])
async def test_a_close_delimited_body_over_tls_is_whole_only_with_close_notify(
    client: H1Client, tls_pair: tuple[ssl.SSLContext, ssl.SSLContext], orderly: bool
) -> None:
    # A bare FIN over TLS: the body may have been cut by anyone on the path (RFC 8446 6.1).
    server_tls, client_tls = tls_pair
    head = response(200, [("content-type", "text/plain")], length=False)
    end = Close() if orderly else Abort()
    script = [Receive(), Send(head, b"whole ", b"body", pause_s=0.01), end]
    async with ScriptedUpstream(script, tls=server_tls) as upstream:
        if orderly:
            assert (await fetch(client, upstream.url(), tls=client_tls)).body == b"whole body"
        else:
            with pytest.raises(UpstreamReset, match="body"):
                await fetch(client, upstream.url(), tls=client_tls)
