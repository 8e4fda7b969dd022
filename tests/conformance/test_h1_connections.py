"""How the client keeps, drops and replaces upstream connections.

- A request that a reused connection fails before any byte of an answer (the upstream closed
  the idle connection as the request went out) is sent once more on a fresh connection; on a
  fresh connection, or after an answer began, the failure is the caller's.
- The upstream's `Keep-Alive: timeout=N` shortens how long a connection is kept idle (to a
  second less than N); `max=0` ends it.
- A connection given up on is reset, not closed: the upstream sees it go at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import pytest
from yarl import URL

from gateway.errors import UpstreamConnectError, UpstreamConnectionLimit, UpstreamReset
from gateway.upstream.h1 import H1Client

from .client import fetch, post, wait_until
from .upstream import Close, Receive, ScriptedUpstream, Send, WaitFor, answer, response


async def test_a_request_lost_to_a_stale_keep_alive_connection_is_sent_again_afresh(
    client: H1Client,
) -> None:
    # The first connection answers once, then closes as the second request arrives.
    stale = [Receive(), Send(response(body=b"one")), Receive(), Close()]
    async with ScriptedUpstream(stale, answer(response(body=b"two"))) as upstream:
        assert (await fetch(client, upstream.url(), b"1")).body == b"one"
        assert (await fetch(client, upstream.url(), b"2")).body == b"two"
    assert [[r.body for r in c.requests] for c in upstream.connections] == [
        [b"1", b"2"],
        [b"2"],
    ]
    assert counted(client, upstream.url()) == {"opened": 2, "reused": 1, "resent": 1}


async def test_a_fresh_connection_closed_before_an_answer_is_not_tried_again(
    client: H1Client,
) -> None:
    async with ScriptedUpstream([Receive(), Close()]) as upstream:
        with pytest.raises(UpstreamReset, match="first_byte"):
            await fetch(client, upstream.url())
    assert len(upstream.connections) == 1
    assert counted(client, upstream.url()) == {"opened": 1, "reused": 0, "resent": 0}


async def test_a_reused_connection_that_broke_mid_answer_is_not_tried_again(
    client: H1Client,
) -> None:
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart"
    script = [Receive(), Send(response(body=b"one")), Receive(), Send(cut), Close()]
    async with ScriptedUpstream(script) as upstream:
        assert (await fetch(client, upstream.url())).body == b"one"
        with pytest.raises(UpstreamReset, match="body"):
            await fetch(client, upstream.url())
    assert len(upstream.connections) == 1
    assert counted(client, upstream.url()) == {"opened": 1, "reused": 1, "resent": 0}


@pytest.mark.parametrize(
    ("hint", "connections"),
    [("timeout=30", 1), ("timeout=30, max=100", 1), ("timeout=1", 2), ("timeout=5, max=0", 2)],
)
async def test_the_upstreams_keep_alive_hint_bounds_reuse(
    client: H1Client, hint: str, connections: int
) -> None:
    hinted = response(headers=[("keep-alive", hint)], body=b"one")
    async with ScriptedUpstream(
        answer(hinted, response(body=b"two")), answer(response(body=b"two"))
    ) as upstream:
        assert (await fetch(client, upstream.url())).body == b"one"
        assert (await fetch(client, upstream.url())).body == b"two"
    assert len(upstream.connections) == connections


async def test_a_request_given_up_on_resets_its_connection(client: H1Client) -> None:
    async with ScriptedUpstream([Receive()]) as upstream:  # never answers
        pending = asyncio.ensure_future(post(client, upstream.url()))
        await wait_until(lambda: len(upstream.requests) == 1)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await upstream.wait_client_closed(0)
    assert any("ConnectionResetError" in error for error in upstream.connections[0].errors)


@pytest.fixture
async def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The host names the event loop is asked to resolve from now on (uvloop also passes
    each address literal it connects to through `getaddrinfo`: not a lookup, not counted)."""
    loop = asyncio.get_running_loop()
    asked: list[str] = []
    resolve = loop.getaddrinfo

    async def counting(host: str, *args: Any, **kwargs: Any) -> Any:
        if not _is_address(host):
            asked.append(host)
        return await resolve(host, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", counting)
    return asked


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def test_a_hosts_addresses_are_resolved_once_for_many_connections(
    client: H1Client, lookups: list[str]
) -> None:
    closing = response(headers=[("connection", "close")], body=b"ok")
    scripts = [[Receive(), Send(closing), Close()] for _ in range(3)]
    async with ScriptedUpstream(*scripts) as upstream:
        url = upstream.url().with_host("localhost")
        bodies = [(await fetch(client, url)).body for _ in range(3)]
    assert bodies == [b"ok"] * 3
    assert len(upstream.connections) == 3
    assert lookups == ["localhost"]


async def test_a_refused_address_is_resolved_again_on_the_next_connect(
    client: H1Client, lookups: list[str]
) -> None:
    async with ScriptedUpstream(answer(response(body=b"ok"))) as upstream:
        url = upstream.url().with_host("localhost")
    # Closed: nothing listens there any more.
    for _ in range(2):
        with pytest.raises(UpstreamConnectError):
            await fetch(client, url)
    assert lookups == ["localhost", "localhost"]


async def test_a_request_beyond_the_connection_limit_waits_for_one_to_come_free(
    client: H1Client,
) -> None:
    release = asyncio.Event()
    script = [Receive(), WaitFor(release), Send(response(body=b"one")), Receive()]
    script.append(Send(response(body=b"two")))
    async with ScriptedUpstream(script) as upstream:
        first = asyncio.ensure_future(
            fetch(client, upstream.url(), b"1", max_connections=1, max_idle=8)
        )
        await wait_until(lambda: len(upstream.requests) == 1)
        second = asyncio.ensure_future(
            fetch(client, upstream.url(), b"2", max_connections=1, max_idle=8)
        )
        await asyncio.sleep(0.05)  # it would have connected by now, were it not waiting
        assert len(upstream.connections) == 1
        release.set()
        assert [(await first).body, (await second).body] == [b"one", b"two"]
    assert [r.body for r in upstream.connections[0].requests] == [b"1", b"2"]
    counts = client.connection_counts(upstream.url())
    assert counts is not None
    # Handed the first one's connection as it came back: one wait, no refusal, one reuse.
    assert (counts.opened, counts.reused, counts.waited, counts.refused) == (1, 1, 1, 0)


async def test_a_request_that_waits_past_the_connect_timeout_is_a_local_503(
    client: H1Client,
) -> None:
    async with ScriptedUpstream([Receive()]) as upstream:  # never answers
        first = asyncio.ensure_future(post(client, upstream.url(), max_connections=1))
        await wait_until(lambda: len(upstream.requests) == 1)
        with pytest.raises(UpstreamConnectionLimit) as caught:
            await post(client, upstream.url(), max_connections=1, connect_s=0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    assert (caught.value.status, caught.value.code, caught.value.local) == (
        503,
        "upstream_connection_limit",
        True,
    )
    assert len(upstream.connections) == 1
    counts = client.connection_counts(upstream.url())
    assert counts is not None
    assert (counts.opened, counts.waited, counts.refused) == (1, 1, 1)


async def test_no_more_than_max_idle_connections_stay_open(client: H1Client) -> None:
    release = asyncio.Event()
    scripts = [[Receive(), WaitFor(release), Send(response(body=b"ok"))] for _ in range(3)]
    async with ScriptedUpstream(*scripts) as upstream:
        replies = [
            asyncio.ensure_future(fetch(client, upstream.url(), max_connections=8, max_idle=1))
            for _ in range(3)
        ]
        await wait_until(lambda: len(upstream.requests) == 3)
        release.set()
        assert [(await r).body for r in replies] == [b"ok"] * 3
        assert sum(pool.connections for pool in client._pools.values()) == 1
        assert client.connection_use(upstream.url()) == (0, 1, 0)  # busy, idle, opening


def counted(client: H1Client, url: URL) -> dict[str, int]:
    """The client's counts of connections opened, requests on a kept connection, and stale
    requests sent again, for `url`'s address."""
    counts = client.connection_counts(url)
    assert counts is not None, "no request went there"
    return {"opened": counts.opened, "reused": counts.reused, "resent": counts.resent}
