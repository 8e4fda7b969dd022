"""A response's lifetime is its scope's (`upstream.response.Owned`): whatever way the scope is
left (its end, an exception, a cancellation), the response is finished once, as failed unless
its outcome was stated; handed over, it is the next scope's to finish; a stream resumed on
another attempt hands the request's own work (its admission slot) to that attempt."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import parse_policy
from gateway.errors import UpstreamError, UpstreamStreamCut
from gateway.runtime import Cancellation
from gateway.upstream.instance import InstanceState
from gateway.upstream.registry import Registry
from gateway.upstream.response import Owned, UpstreamResponse
from gateway.upstream.watchdog import Watchdog
from loadtests.virtual_time import run
from tests.memory_upstream import Answer, MemoryHead

POLICY = """
pools:
  chat:
    models: [m]
    instances: [{name: a, url: "http://a:8000"}, {name: b, url: "http://b:8000"}]
    health: {enabled: false}
"""

Ran = list[tuple[str, UpstreamResponse, UpstreamError | None]]


class CountingHead(MemoryHead):
    """A streamed answer's head whose body was not read to its end: how it was ended, each
    time it was."""

    def __init__(self) -> None:
        super().__init__(Answer())
        self.ends: list[str] = []

    def release(self) -> None:
        self.ends.append("released")

    def close(self) -> None:
        self.ends.append("closed")


def _response(instance: InstanceState, head: CountingHead) -> UpstreamResponse:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    watchdog = Watchdog()
    deadline = watchdog.arm(Cancellation(task), loop.time() + 10, "first_byte")
    return UpstreamResponse(
        instance,
        head,
        body=None,
        first_chunk=b"data: {}\n\n",
        is_sse=True,
        deadline=deadline,
        watchdog=watchdog,
        started_at=loop.time(),
        clock=loop.time,
    )


def _instances() -> list[InstanceState]:
    loop = asyncio.get_running_loop()
    registry = Registry(parse_policy(POLICY), now=loop.time())
    return registry.pools["chat"].instances


def _recorded(response: UpstreamResponse, ran: Ran, name: str) -> UpstreamResponse:
    """`response`, whose attempt work and request work write to `ran` when they run."""
    response.after(lambda r, error: ran.append((f"{name}: attempt", r, error)))
    response.after(lambda r, error: ran.append((f"{name}: request", r, error)), request=True)
    return response


def test_a_scope_that_ends_finishes_its_response_once_with_the_outcome_it_stated() -> None:
    async def scenario() -> tuple[CountingHead, UpstreamResponse, Ran]:
        [a, _] = _instances()
        head = CountingHead()
        ran: Ran = []
        response = _recorded(_response(a, head), ran, "a")
        with Owned(response) as relayed:
            relayed.ok = True
            assert ran == []  # nothing before the scope ends
        return head, response, ran

    head, response, ran = run(scenario())
    assert head.ends == ["released"]  # whole: its connection goes back to the pool
    assert ran == [("a: attempt", response, None), ("a: request", response, None)]


@pytest.mark.parametrize("stated", [False, True], ids=["no outcome", "an error stated"])
def test_an_exception_leaving_the_scope_finishes_the_response_as_failed(stated: bool) -> None:
    cut = UpstreamStreamCut("cut")

    async def scenario() -> tuple[CountingHead, UpstreamResponse, Ran]:
        [a, _] = _instances()
        head = CountingHead()
        ran: Ran = []
        response = _recorded(_response(a, head), ran, "a")
        with pytest.raises(RuntimeError), Owned(response) as relayed:
            if stated:
                relayed.error = cut
            raise RuntimeError("the relay failed")
        return head, response, ran

    head, response, ran = run(scenario())
    error = cut if stated else None
    assert head.ends == ["closed"]  # cut short: its connection cannot be reused
    assert ran == [("a: attempt", response, error), ("a: request", response, error)]


def test_a_cancellation_leaving_the_scope_finishes_the_response_as_failed() -> None:
    async def scenario() -> tuple[CountingHead, UpstreamResponse, Ran]:
        [a, _] = _instances()
        head = CountingHead()
        ran: Ran = []
        response = _recorded(_response(a, head), ran, "a")
        entered = asyncio.Event()

        async def relaying() -> None:
            with Owned(response):
                entered.set()
                await asyncio.sleep(60)  # the client leaves meanwhile

        task = asyncio.get_running_loop().create_task(relaying())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return head, response, ran

    head, response, ran = run(scenario())
    assert head.ends == ["closed"]
    assert ran == [("a: attempt", response, None), ("a: request", response, None)]


def test_a_response_handed_over_is_finished_by_the_next_scope_only() -> None:
    async def scenario() -> tuple[CountingHead, list[str], Ran]:
        [a, _] = _instances()
        head = CountingHead()
        ran: Ran = []
        response = _recorded(_response(a, head), ran, "a")
        with Owned(response) as layer:
            passed = layer.hand_over()  # returned to the caller, as a retry loop returns it
        after_handing = list(head.ends)
        with Owned(passed) as relayed:
            relayed.ok = True
        return head, after_handing, ran

    head, after_handing, ran = run(scenario())
    assert after_handing == []
    assert head.ends == ["released"]
    assert [what for what, _, _ in ran] == ["a: attempt", "a: request"]


def test_a_second_end_does_nothing() -> None:
    async def scenario() -> tuple[CountingHead, Ran]:
        [a, _] = _instances()
        head = CountingHead()
        ran: Ran = []
        response = _recorded(_response(a, head), ran, "a")
        with Owned(response) as relayed:
            relayed.ok = True
            relayed.end()  # ended early, as a stream whose last events were lost is
        with Owned(response):  # a scope that should never have held it
            pass
        return head, ran

    head, ran = run(scenario())
    assert head.ends == ["released"]
    assert [what for what, _, _ in ran] == ["a: attempt", "a: request"]


def test_a_resumed_streams_request_work_moves_to_the_next_attempt() -> None:
    cut = UpstreamStreamCut("cut")

    async def scenario() -> tuple[CountingHead, CountingHead, Ran, Ran, UpstreamResponse]:
        a, b = _instances()
        first_head, second_head = CountingHead(), CountingHead()
        ran: Ran = []
        first = _recorded(_response(a, first_head), ran, "a")
        with Owned(first) as relayed:
            assert relayed.break_off(cut) is first
            at_break = list(ran)
            second = _response(b, second_head)
            second.after(lambda r, error: ran.append(("b: attempt", r, error)))
            relayed.resume_on(second)
            relayed.ok = True
        return first_head, second_head, at_break, ran, second

    first_head, second_head, at_break, ran, second = run(scenario())
    # The broken attempt ends as it breaks; the request's work waits for the next attempt.
    assert first_head.ends == ["closed"]
    assert [(what, error) for what, _, error in at_break] == [("a: attempt", cut)]
    # ... and runs once, after that attempt's own, when the stream ends there.
    assert second_head.ends == ["released"]
    assert [(what, r, error) for what, r, error in ran[1:]] == [
        ("b: attempt", second, None),
        ("a: request", second, None),
    ]


def test_a_stream_whose_continuation_never_came_runs_the_request_work_with_the_break() -> None:
    cut = UpstreamStreamCut("cut")

    async def scenario() -> tuple[CountingHead, Ran, UpstreamResponse]:
        [a, _] = _instances()
        head = CountingHead()
        ran: Ran = []
        first = _recorded(_response(a, head), ran, "a")
        with pytest.raises(asyncio.CancelledError), Owned(first) as relayed:
            relayed.break_off(cut)
            raise asyncio.CancelledError  # the client left while the stream moved
        return head, ran, first

    head, ran, first = run(scenario())
    assert head.ends == ["closed"]
    assert ran == [("a: attempt", first, cut), ("a: request", first, cut)]
