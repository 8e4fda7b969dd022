"""The rules the data plane's HTTP/1.1 client must hold to with upstreams that misbehave.

- A connection is reused only after exactly one complete message and nothing else: any byte
  after it taints the connection (closed, never pooled), and the status and headers are the
  ones of the head that completed first.
- A connection whose reading was paused never goes back to the pool paused.
- A response head is capped (64 KiB, 100 fields); past it, an `UpstreamProtocolError` (a 502
  with code `upstream_protocol_error`).
- A malformed response is an `UpstreamProtocolError`, never a response.
- Trailers are dropped; chunked is accepted only as the final transfer coding; a 1xx response
  has no body; Content-Length is read with its surrounding whitespace.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import UpstreamProtocolError
from gateway.upstream.h1 import H1Client

from .client import Reply, fetch, post, wait_until
from .upstream import (
    Close,
    Notify,
    Receive,
    ScriptedUpstream,
    Send,
    WaitFor,
    answer,
    chunk,
    chunked_head,
    last_chunk,
    response,
)

# The answer the first connection gives a second request it should never have been given.
REUSED = response(200, [("x-connection", "tainted")], b"tainted")
FRESH = response(200, [("x-connection", "fresh")], b"fresh")
JSON = [("content-type", "application/json")]


def assert_protocol_error(error: BaseException) -> None:
    assert isinstance(error, UpstreamProtocolError)
    assert (error.status, error.code) == (502, "upstream_protocol_error")


async def fetch_or_error(client: H1Client, upstream: ScriptedUpstream) -> Reply | BaseException:
    """The reply, or the exception of an exchange that failed (whether at the head or in the
    body: either is the same 502 to the client)."""
    try:
        return await fetch(client, upstream.url())
    except Exception as exc:
        return exc


# -- one message per exchange -----------------------------------------------------------------


async def test_a_second_response_in_the_same_read_does_not_replace_the_first(
    client: H1Client,
) -> None:
    first = response(200, [("x-first", "1")], b"first")
    second = response(500, [("x-second", "1")], b"oops")
    script = [Receive(), Send(first + second), *answer(REUSED)]
    async with ScriptedUpstream(script, answer(FRESH)) as upstream:
        reply = await fetch(client, upstream.url())
        assert reply.status == 200
        assert reply.body == b"first"
        assert reply.values("x-first") == ["1"]
        assert "x-second" not in reply.names
        after = await fetch(client, upstream.url())
        assert after.body == b"fresh"  # a tainted connection is never pooled
        await upstream.wait_client_closed(0)


async def test_a_stray_byte_after_a_response_does_not_break_the_next_request(
    client: H1Client,
) -> None:
    # "H" could begin a status line: a parser still waiting on it would choke on the next
    # response's "HTTP/1.1".
    script = [Receive(), Send(response(200, body=b"first") + b"H"), *answer(REUSED)]
    async with ScriptedUpstream(script, answer(FRESH)) as upstream:
        assert (await fetch(client, upstream.url())).body == b"first"
        assert (await fetch(client, upstream.url())).body == b"fresh"
        await upstream.wait_client_closed(0)


async def test_a_stale_response_head_is_never_delivered_to_the_next_request(
    client: H1Client,
) -> None:
    stale_head = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"
    script = [
        Receive(),
        Send(response(200, body=b"first") + stale_head),
        # If the connection is reused anyway, the rest of the stale message arrives first.
        Receive(),
        Send(b"STALE" + REUSED),
    ]
    async with ScriptedUpstream(script, answer(FRESH)) as upstream:
        assert (await fetch(client, upstream.url())).body == b"first"
        assert (await fetch(client, upstream.url())).body == b"fresh"
    assert len(upstream.connections[0].requests) == 1


async def test_bytes_arriving_after_the_body_and_before_release_taint_the_connection(
    client: H1Client,
) -> None:
    body_read, late_sent = asyncio.Event(), asyncio.Event()
    late = response(500, [("x-late", "1")], b"late")
    script = [
        Receive(),
        Send(response(200, [("x-first", "1")], b"first")),
        WaitFor(body_read),
        Send(late),
        Notify(late_sent),
        *answer(REUSED),
    ]
    async with ScriptedUpstream(script, answer(FRESH)) as upstream:
        head = await post(client, upstream.url())
        try:
            assert await head.read() == b"first"
            before = list(head.raw_headers)
            body_read.set()
            await asyncio.wait_for(late_sent.wait(), 5)
            await asyncio.sleep(0.05)  # loopback: the late bytes reach the client meanwhile
            assert head.status == 200
            assert list(head.raw_headers) == before
        finally:
            head.release()
        assert (await fetch(client, upstream.url())).body == b"fresh"
        await upstream.wait_client_closed(0)


# -- reading paused ---------------------------------------------------------------------------


async def test_a_connection_paused_by_an_unread_body_is_not_pooled_paused(
    client: H1Client,
) -> None:
    # One byte past the 256 KiB the client buffers before it pauses reading: the read that
    # pauses it is the one that completes the response.
    body = b"x" * (256 * 1024 + 1)
    script = [Receive(), Send(response(200, body=body)), *answer(response(200, body=b"second"))]
    async with ScriptedUpstream(script, answer(response(200, body=b"second"))) as upstream:
        head = await post(client, upstream.url())
        try:
            await wait_until(lambda: head.connection is None)  # the body arrived whole
        finally:
            head.release()  # the client went away without reading it
        assert (await fetch(client, upstream.url())).body == b"second"


# -- limits on the head -----------------------------------------------------------------------


async def test_a_head_of_more_than_100_fields_is_a_protocol_error(client: H1Client) -> None:
    fields = [(f"x-field-{n}", "v") for n in range(100)]  # and Content-Length: 101
    async with ScriptedUpstream(answer(response(200, fields, b"ok"))) as upstream:
        with pytest.raises(UpstreamProtocolError) as caught:
            await fetch(client, upstream.url())
    assert_protocol_error(caught.value)


async def test_a_head_over_64_kib_is_a_protocol_error(client: H1Client) -> None:
    data = response(200, [("x-large", "v" * (65 * 1024))], b"ok")
    async with ScriptedUpstream(answer(data)) as upstream:
        with pytest.raises(UpstreamProtocolError) as caught:
            await fetch(client, upstream.url())
    assert_protocol_error(caught.value)


async def test_a_head_over_64_kib_after_an_interim_answer_in_the_same_read_is_an_error(
    client: H1Client,
) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    data = interim + response(200, [("x-large", "v" * (65 * 1024))], b"ok")
    async with ScriptedUpstream(answer(data)) as upstream:
        with pytest.raises(UpstreamProtocolError) as caught:
            await fetch(client, upstream.url())
    assert_protocol_error(caught.value)


async def test_a_head_over_64_kib_arriving_in_pieces_is_a_protocol_error(
    client: H1Client,
) -> None:
    # A value growing 1 KiB per read: the client must give up once past the cap rather than
    # take (and copy again on every read) all 256 KiB.
    data = response(200, [("x-large", "v" * (256 * 1024))], b"ok")
    script = [Receive(), Send.split(data, 1024, pause_s=0.001)]
    async with ScriptedUpstream(script) as upstream:
        with pytest.raises(UpstreamProtocolError) as caught:
            await fetch(client, upstream.url())
    assert_protocol_error(caught.value)


# -- malformed responses ----------------------------------------------------------------------


@pytest.mark.parametrize("status", [600, 999])
async def test_a_status_past_599_is_a_protocol_error(client: H1Client, status: int) -> None:
    async with ScriptedUpstream(answer(response(status, body=b"{}"))) as upstream:
        with pytest.raises(UpstreamProtocolError) as caught:
            await fetch(client, upstream.url())
    assert_protocol_error(caught.value)


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length : 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding : chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nconnection : close\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nx-custom : v\r\ncontent-length: 2\r\n\r\nok",
    ],
    ids=["content-length", "transfer-encoding", "connection", "other"],
)
async def test_whitespace_before_a_header_colon_is_a_protocol_error(
    client: H1Client, data: bytes
) -> None:
    async with ScriptedUpstream(answer(data)) as upstream:
        with pytest.raises(UpstreamProtocolError) as caught:
            await fetch(client, upstream.url())
    assert_protocol_error(caught.value)


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "cut-mid-body"])
async def test_a_body_longer_than_its_content_length_is_never_relayed(
    client: H1Client, split: bool
) -> None:
    """The bytes past Content-Length are not the body: the exchange either fails as a protocol
    error or ends with the declared body, and the connection is not reused."""
    data = response(200, body=b"hello") + b"EXTRA"
    sent = Send(data[:-7], data[-7:], pause_s=0.01) if split else Send(data)
    script = [Receive(), sent, *answer(REUSED)]
    async with ScriptedUpstream(script, answer(FRESH)) as upstream:
        outcome = await fetch_or_error(client, upstream)
        if isinstance(outcome, BaseException):
            assert_protocol_error(outcome)
        else:
            assert (outcome.status, outcome.body) == (200, b"hello")
        assert (await fetch(client, upstream.url())).body == b"fresh"


# -- trailers ---------------------------------------------------------------------------------


async def test_trailers_are_dropped(client: H1Client) -> None:
    head = chunked_head(headers=[*JSON, ("trailer", "x-checksum")])
    rest = chunk(b"hello") + last_chunk([("x-checksum", "abc"), ("content-type", "text/x")])
    async with ScriptedUpstream(answer(head + rest)) as upstream:
        reply = await fetch(client, upstream.url())
    assert reply.body == b"hello"
    assert "x-checksum" not in reply.names
    assert reply.values("content-type") == ["application/json"]  # the head's, alone


async def test_trailers_are_bounded_like_a_head(client: H1Client) -> None:
    # One trailer value of 256 KiB in 4 KiB pieces: refused once past 64 KiB, not buffered.
    start = chunked_head(headers=JSON) + chunk(b"hello") + b"0\r\nx-big: "
    pieces = [b"a" * 4096] * 64
    script = [Receive(), Send(start, *pieces, pause_s=0.001), Close()]
    async with ScriptedUpstream(script) as upstream:
        outcome = await fetch_or_error(client, upstream)
    assert isinstance(outcome, BaseException)
    assert_protocol_error(outcome)


async def test_trailers_arriving_after_the_head_was_handed_over_are_dropped(
    client: H1Client,
) -> None:
    """The headers a relay sends are the head's, even when it reads them after the body."""
    head = chunked_head(headers=[*JSON, ("trailer", "x-checksum")])
    rest = chunk(b"hello") + last_chunk([("x-checksum", "abc"), ("content-type", "text/x")])
    go = asyncio.Event()
    async with ScriptedUpstream([Receive(), Send(head), WaitFor(go), Send(rest)]) as upstream:
        response_head = await post(client, upstream.url())
        try:
            go.set()
            async with asyncio.timeout(5):
                body = await response_head.read()
            raw = list(response_head.raw_headers)
        finally:
            response_head.release()
    assert body == b"hello"
    assert (b"x-checksum", b"abc") not in raw
    assert [v for n, v in raw if n.lower() == b"content-type"] == [b"application/json"]
    assert "x-checksum" not in response_head.headers


# -- framing details --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "codings",
    [["chunked, gzip"], ["gzip"], ["x-chunked"], ["chunked", "gzip"]],
    ids=["chunked-then-gzip", "gzip-only", "x-chunked", "two-fields"],
)
async def test_a_transfer_coding_other_than_final_chunked_is_refused(
    client: H1Client, codings: list[str]
) -> None:
    head = response(200, [("transfer-encoding", c) for c in codings], length=False)
    script = [Receive(), Send(head + chunk(b"hello") + last_chunk()), Close()]
    async with ScriptedUpstream(script) as upstream:
        outcome = await fetch_or_error(client, upstream)
    assert isinstance(outcome, BaseException), f"accepted as {outcome}"
    assert_protocol_error(outcome)


async def test_a_1xx_body_is_never_prepended_to_the_final_body(client: H1Client) -> None:
    """A 1xx response has no body whatever its headers say: "abc" cannot be the final body's
    start (it is garbage before the final status line: a protocol error, if anything)."""
    interim = b"HTTP/1.1 199 Odd\r\ncontent-length: 3\r\n\r\nabc"
    async with ScriptedUpstream(answer(interim + response(200, body=b"final"))) as upstream:
        outcome = await fetch_or_error(client, upstream)
    if isinstance(outcome, BaseException):
        assert_protocol_error(outcome)
    else:
        assert (outcome.status, outcome.body) == (200, b"final")


async def test_a_content_length_with_trailing_whitespace_is_recognised(
    client: H1Client,
) -> None:
    padded = b"HTTP/1.1 200 OK\r\ncontent-length: 5 \r\n\r\nhello"
    async with ScriptedUpstream(answer(padded, response(body=b"next"))) as upstream:
        reply = await fetch(client, upstream.url())
        assert (await fetch(client, upstream.url())).body == b"next"
    assert reply.content_length == 5
    assert reply.body == b"hello"
    assert len(upstream.connections) == 1
