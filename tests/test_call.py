"""`Call`: the calls made for one request (a hedge's, a continuation's) carry the request and
start their attempt anew; a hedge that wins hands its attempt over whole."""

from __future__ import annotations

import asyncio
from dataclasses import fields

from gateway.config import parse_policy
from gateway.config.routes import KNOWN_ROUTES
from gateway.core.timeouts import AttemptTimeouts
from gateway.pipeline.call import Attempt, Call, RequestFacts
from gateway.runtime import Cancellation
from gateway.upstream.registry import InstanceState, Registry

POLICY = """
pools:
  chat:
    models: [m]
    instances:
      - {name: a, url: "http://127.0.0.1:9"}
      - {name: b, url: "http://127.0.0.1:10"}
      - {name: c, url: "http://127.0.0.1:11"}
    health: {enabled: false}
"""


def a_call() -> tuple[Call, dict[str, InstanceState]]:
    """A request on its first attempt (on `a`, a probe, holding tokens reserved there) after `c`
    timed out on it; and the pool's instances by name."""
    loop = asyncio.get_running_loop()
    pool = Registry(parse_policy(POLICY), now=loop.time()).pools["chat"]
    by_name = {inst.name: inst for inst in pool.instances}
    a, c = by_name["a"], by_name["c"]
    task = asyncio.current_task()
    assert task is not None
    call = Call(
        pool=pool,
        route=KNOWN_ROUTES["/v1/chat/completions"],
        query="x=1",
        body=b'{"model": "m", "messages": []}',
        headers=[("content-type", "application/json")],
        facts=RequestFacts("m", True, 16),
        deadline=loop.time() + 30,
        cancellation=Cancellation(task),
        acts=False,
        priority="batch",
        prompt_tokens=8,
        attempts=2,
        last_attempt=3,
        k=2.5,
        tried=[c, a],
        avoid=[c],
        timed_out=[(c, 1.0)],
        attempt=Attempt(
            instance=a,
            probe=True,
            timeouts=AttemptTimeouts(first_byte_s=2.0, idle_s=1.0, connect_s=0.5),
            tokens=120,
            reserved=a,
        ),
    )
    return call, by_name


async def test_a_hedge_carries_the_request_and_its_history_and_starts_a_fresh_attempt() -> None:
    call, by_name = a_call()
    a, c = by_name["a"], by_name["c"]
    before = Attempt(**{f.name: getattr(call.attempt, f.name) for f in fields(Attempt)})

    hedge = call.for_hedge()

    assert hedge.attempt == Attempt() and hedge.attempt is not call.attempt
    assert call.attempt == before  # the first attempt goes on as it was
    # It avoids the instance it hedges, on top of those the request avoids already.
    assert hedge.avoid == [a, c] and call.avoid == [c]
    # The rest is the request's own and its retry loop's so far: the very same objects.
    for f in fields(Call):
        if f.name not in ("attempt", "avoid"):
            assert getattr(hedge, f.name) is getattr(call, f.name), f.name
    # Its attempts are counted on from the first one's (the hedge layer adds the difference).
    assert (hedge.attempts, hedge.hedges) == (2, 0)


async def test_what_a_hedge_tries_or_times_out_on_is_the_requests() -> None:
    call, by_name = a_call()
    b = by_name["b"]
    hedge = call.for_hedge()
    hedge.tried.append(b)
    hedge.timed_out.append((b, 2.0))
    assert call.tried[-1] is b and call.timed_out[-1] == (b, 2.0)
    hedge.attempt.instance = b  # its pick
    assert call.attempt.instance is by_name["a"]


async def test_a_continuation_keeps_the_request_and_starts_a_loop_and_an_attempt_anew() -> None:
    call, by_name = a_call()
    a, b, c = by_name["a"], by_name["b"], by_name["c"]
    body = b'{"model": "m", "messages": [{"role": "assistant", "content": "Hel"}]}'

    continued = call.for_continuation(body, [a, b])

    assert continued.attempt == Attempt() and continued.attempt is not call.attempt
    assert continued.body is body and call.body != body
    assert continued.prompt_tokens == 0  # its own body's, worked out when it is sent
    assert (continued.attempts, continued.hedges) == (0, 0)
    assert continued.tried == [] and call.tried == [c, a]
    # The instances that broke the stream, then those the request avoided.
    assert continued.avoid == [a, b, c] and call.avoid == [c]
    # An instance that timed out on the request stays silent for its continuation.
    assert continued.timed_out is call.timed_out
    assert continued.silent(c) and not continued.silent(a)
    body_and_loop = ("attempt", "body", "prompt_tokens", "attempts", "hedges", "tried", "avoid")
    for f in fields(Call):
        if f.name not in body_and_loop:
            assert getattr(continued, f.name) is getattr(call, f.name), f.name


async def test_a_continuation_of_a_request_whose_hedge_won_starts_afresh_too() -> None:
    call, by_name = a_call()
    hedge = call.for_hedge()
    hedge.attempt.instance = by_name["b"]
    call.adopt(hedge)
    continued = call.for_continuation(b"{}", [by_name["b"]])
    assert continued.attempt == Attempt()
    assert continued.avoid == [by_name["b"], by_name["c"]]


async def test_adopting_a_hedge_brings_over_every_field_of_its_attempt() -> None:
    call, by_name = a_call()
    b = by_name["b"]
    hedge = call.for_hedge()
    # What the layers set on the hedge's attempt: a value unlike the first attempt's in each.
    hedge.attempt.instance = b
    hedge.attempt.probe = False
    hedge.attempt.timeouts = AttemptTimeouts(first_byte_s=4.0, idle_s=3.0, connect_s=1.0)
    hedge.attempt.tokens = 0
    hedge.attempt.reserved = None
    won = {f.name: getattr(hedge.attempt, f.name) for f in fields(Attempt)}
    assert all(won[name] != getattr(call.attempt, name) for name in won)
    history = (call.attempts, call.hedges, list(call.tried), list(call.avoid))

    call.adopt(hedge)

    assert {f.name: getattr(call.attempt, f.name) for f in fields(Attempt)} == won
    # The request and its history stay the request's (the hedge layer counts the attempts).
    assert (call.attempts, call.hedges, call.tried, call.avoid) == history
    assert call.avoid == [by_name["c"]]
