"""Random and mutated response byte streams against the data plane's HTTP/1.1 client.

Each example plays one answer to a first request (well formed, or with a byte changed, or
followed by what should not be there: a second message, stray bytes), written in random pieces
and ended by a close or a reset; then a second request, which an upstream connection of its own
answers with a marker. The properties:

- the first exchange ends, as a reply or an `UpstreamError`, never another exception and never a
  hang (bounded generously: a hang is what this catches, not slowness);
- an untouched, well-framed answer comes out exactly as it was meant (status and body), whatever
  followed it;
- once the first connection's bytes are all sent (and it is closed or reset), the second
  request gets exactly the marker: never a byte of the first exchange, whatever came after the
  first message (a connection is reused only after exactly one whole message and nothing else).
  Bytes a server sends after the next request was written cannot be told from its answer by
  any HTTP/1.1 client; that is not what this checks.

`make test` runs the `ci` profile (derandomized: the same examples every run); `make fuzz` runs
`HYPOTHESIS_PROFILE=long` with fresh random examples (`FUZZ_EXAMPLES`, default 20,000).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import UpstreamError
from gateway.upstream.h1 import H1Client

from .client import Reply, fetch
from .upstream import (
    Close,
    Receive,
    Reset,
    ScriptedUpstream,
    Send,
    Step,
    chunk,
    last_chunk,
    response,
)

settings.register_profile("ci", max_examples=120, deadline=None, derandomize=True, print_blob=True)
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "20000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

MARKER = b"the second exchange's own answer"
# Hang detection for one exchange: far above what a loopback exchange takes on a busy machine.
EXCHANGE_BOUND_S = 10.0


@dataclass(frozen=True)
class Case:
    """One generated answer: its bytes, what it means when untouched, how it is delivered."""

    data: bytes
    status: int
    body: bytes
    framed: bool  # by Content-Length or chunked (not by the connection's end)
    untouched: bool  # no byte of the message itself was changed
    cuts: tuple[int, ...]
    reset: bool


@st.composite
def cases(draw: st.DrawFn) -> Case:
    status = draw(st.sampled_from([200, 201, 400, 404, 429, 500, 503]))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    headers = [("content-type", "application/json")]
    if framing == "length":
        message = response(status, headers, body)
    elif framing == "chunked":
        sizes = draw(st.lists(st.integers(1, 64), max_size=8))
        pieces, rest = [], body
        for size in sizes:
            if rest:
                pieces.append(rest[:size])
                rest = rest[size:]
        if rest:
            pieces.append(rest)
        head = response(status, [*headers, ("transfer-encoding", "chunked")], length=False)
        trailers = [("x-checksum", "abc")] if draw(st.booleans()) else []
        message = head + b"".join(chunk(p) for p in pieces) + last_chunk(trailers)
    else:
        message = response(status, [*headers, ("connection", "close")], body, length=False)
    if draw(st.integers(0, 4)) == 0:  # an interim answer first (103 Early Hints, 100)
        interim = draw(st.sampled_from([100, 103]))
        message = response(interim, [("link", "</a.css>; rel=preload")], length=False) + message
    untouched = True
    if draw(st.booleans()) and message:
        # One byte changed, inserted or removed anywhere in the message.
        at = draw(st.integers(0, len(message) - 1))
        how = draw(st.sampled_from(["flip", "insert", "delete"]))
        byte = bytes([draw(st.integers(0, 255))])
        if how == "flip":
            message = message[:at] + byte + message[at + 1 :]
        elif how == "insert":
            message = message[:at] + byte + message[at:]
        else:
            message = message[:at] + message[at + 1 :]
        untouched = False
    after = draw(
        st.sampled_from(["nothing", "second message", "stray bytes", "nothing", "nothing"])
    )
    extra = b""
    if after == "second message":
        extra = response(500, headers, b'{"error":"not yours"}')
    elif after == "stray bytes":
        extra = draw(st.binary(min_size=1, max_size=16))
    data = message + extra
    cuts = tuple(sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=6)))))
    return Case(
        data,
        status,
        body,
        framing != "close",
        untouched,
        cuts,
        draw(st.booleans()),
    )


def _parts(data: bytes, cuts: tuple[int, ...]) -> list[bytes]:
    bounds = [0, *[c for c in cuts if 0 < c < len(data)], len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


async def _play(case: Case) -> None:
    first: list[Step] = [Receive(), Send(*_parts(case.data, case.cuts), pause_s=0.001)]
    first.append(Reset() if case.reset else Close())
    second: list[Step] = [Receive(), Send(response(200, body=MARKER)), Close()]
    client = H1Client(keepalive_s=4.0)
    try:
        async with ScriptedUpstream(first, second, second) as upstream:
            reply: Reply | UpstreamError
            try:
                async with asyncio.timeout(EXCHANGE_BOUND_S):
                    reply = await fetch(client, upstream.url())
            except UpstreamError as error:
                reply = error
            if isinstance(reply, Reply) and case.untouched and case.framed:
                assert (reply.status, reply.body) == (case.status, case.body)
            async with asyncio.timeout(EXCHANGE_BOUND_S):
                await upstream.connections[0].finished.wait()
                again = await fetch(client, upstream.url())
            assert (again.status, again.body) == (200, MARKER)
    finally:
        client.close()


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.mark.parametrize("loop", sorted(LOOPS))
@settings(settings.get_profile(PROFILE))
@given(case=cases())
def test_random_answers_never_leak_into_another_exchange(loop: str, case: Case) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(_play(case))
