"""Graceful shutdown: SIGTERM with live streams, against a real gateway process.

Every stream in flight either completes normally or ends with an SSE error event and
`data: [DONE]`; none is cut silently, and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.drain import late_answers
from gateway.ingress.uvicorn_server import answer_unanswered
from loadtests.procs import wait_until
from tests.support import Backend, Gateway, pool_policy, running_backends, start_gateway

STREAMS = 8
PER_TOKEN_S = 0.01  # the backend's pace: max_tokens=100 is a one-second stream


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("a", "b"), ["m"], "--ttft", "0", "--per-token", str(PER_TOKEN_S))


def drain_gateway(
    tmp_path: Path, backends: dict[str, Backend], delay: str, timeout: str
) -> Gateway:
    top = f"drain: {{delay: {delay}, timeout: {timeout}}}"
    return start_gateway(tmp_path / "policy.yaml", pool_policy(backends, top=top))


@dataclass
class Stream:
    """One streamed completion read to its end in a thread; `started` once its first byte came."""

    started: threading.Event = field(default_factory=threading.Event)
    status: int = 0
    body: bytes = b""
    ended_at: float = 0.0

    def events(self) -> list[str]:
        return [e[6:] for e in self.body.decode().split("\n\n") if e.startswith("data: ")]


def _read_stream(url: str, max_tokens: int, stream: Stream) -> Stream:
    payload = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": max_tokens,
    }
    chunks: list[bytes] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=30) as r:
        stream.status = r.status_code
        for chunk in r.iter_bytes():
            stream.started.set()
            chunks.append(chunk)
    stream.body = b"".join(chunks)
    stream.ended_at = time.monotonic()
    return stream


def start_streams(pool: ThreadPoolExecutor, gw: Gateway, max_tokens: int) -> list[Future[Stream]]:
    """STREAMS streams, all with their first byte received when this returns."""
    streams = [Stream() for _ in range(STREAMS)]
    futures = [pool.submit(_read_stream, gw.url, max_tokens, s) for s in streams]
    for stream in streams:
        assert stream.started.wait(10), "a stream did not start"
    return futures


def refused(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def ready_status(gw: Gateway) -> int:
    try:
        return httpx.get(f"{gw.url}/readyz", timeout=2).status_code
    except httpx.TransportError:
        return 0


def in_flight(gw: Gateway) -> int:
    state = httpx.get(f"{gw.admin_url}/admin/state", timeout=2).json()
    return sum(i["in_flight"] for i in state["pools"]["chat"]["instances"])


def wait_exit(gw: Gateway, timeout_s: float) -> int:
    return gw.proc.proc.wait(timeout_s)


def assert_drain_logged(gw: Gateway) -> None:
    gw.proc.stop()  # joins the output reader (the process has exited already)
    output = gw.proc.output()
    assert "drain started" in output and "drain finished" in output, output


def test_streams_that_finish_within_the_deadline_complete(
    tmp_path: Path, backends: dict[str, Backend]
) -> None:
    gw = drain_gateway(tmp_path, backends, delay="500ms", timeout="2s")
    data_address = gw.proc.ready["data"]
    try:
        assert ready_status(gw) == 200
        with ThreadPoolExecutor(STREAMS) as pool:
            futures = start_streams(pool, gw, max_tokens=100)  # about 1 s each
            signalled = time.monotonic()
            gw.proc.signal(signal.SIGTERM)
            # During the delay: not ready, yet requests are still served.
            assert wait_until(lambda: ready_status(gw) == 503, timeout_s=2)
            ready = httpx.get(f"{gw.url}/readyz", timeout=2)
            assert ready.json() == {"ready": False, "draining": True}
            answer = httpx.post(
                f"{gw.url}/v1/chat/completions",
                json={
                    "model": "m",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                },
                timeout=5,
            )
            assert answer.status_code == 200
            # After the delay, the listener is closed: new connections are refused.
            assert wait_until(lambda: refused(data_address), timeout_s=3)
            assert time.monotonic() - signalled >= 0.5
            results = [f.result(timeout=10) for f in futures]
        for stream in results:
            events = stream.events()
            assert stream.status == 200
            assert events[-1] == "[DONE]"
            assert not any('"error"' in e for e in events), events
            assert len(events) > 100 / 2  # the whole generation came through
        assert wait_exit(gw, 5) == 0
        assert_drain_logged(gw)
    finally:
        gw.stop()


def test_streams_longer_than_the_deadline_end_with_an_error_event(
    tmp_path: Path, backends: dict[str, Backend]
) -> None:
    gw = drain_gateway(tmp_path, backends, delay="300ms", timeout="1s")
    # Not streamed, 2000 tokens: still without an answer at the deadline, on either API.
    whole_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
    try:
        with ThreadPoolExecutor(STREAMS + 2) as pool:
            futures = start_streams(pool, gw, max_tokens=2000)  # 20 s each
            whole, whole_messages = (
                pool.submit(httpx.post, f"{gw.url}{path}", json=whole_body, timeout=30)
                for path in ("/v1/chat/completions", "/v1/messages")
            )
            assert wait_until(lambda: in_flight(gw) > STREAMS + 1)
            signalled = time.monotonic()
            gw.proc.signal(signal.SIGTERM)
            results = [f.result(timeout=10) for f in futures]
            unanswered = whole.result(timeout=10)
            unanswered_messages = whole_messages.result(timeout=10)
            code = wait_exit(gw, 5)
        for stream in results:
            events = stream.events()
            assert stream.status == 200
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == "shutting_down"
            assert error["type"] == "service_unavailable"
            for event in events[:-2]:  # whole events before it, none cut in half
                assert json.loads(event)["object"] == "chat.completion.chunk"
            # Ended at the deadline (delay + timeout), not before.
            assert stream.ended_at - signalled >= 1.2
        assert unanswered.status_code == 503
        assert unanswered.json()["error"]["code"] == "shutting_down"
        assert unanswered.headers["x-gateway-error"] == "shutting_down"
        assert unanswered.headers["retry-after"] == "1"
        # The Messages route's late answer is in Anthropic's shape, marked the same way.
        assert unanswered_messages.status_code == 503
        assert unanswered_messages.json() == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "the gateway is shutting down"},
        }
        assert unanswered_messages.headers["x-gateway-error"] == "shutting_down"
        assert code == 0
        assert_drain_logged(gw)
        finished = next(line for line in gw.proc.lines if "drain finished" in line)
        # The two whole answers too: they were fetched as streams (`resume.whole_answers`).
        assert f"ended_at_deadline={STREAMS + 2}" in finished, finished
    finally:
        gw.stop()


def test_a_second_signal_ends_the_drain_at_once(
    tmp_path: Path, backends: dict[str, Backend]
) -> None:
    gw = drain_gateway(tmp_path, backends, delay="5s", timeout="30s")
    try:
        with ThreadPoolExecutor(STREAMS) as pool:
            futures = start_streams(pool, gw, max_tokens=2000)
            gw.proc.signal(signal.SIGTERM)
            assert wait_until(lambda: ready_status(gw) == 503, timeout_s=2)
            # Operators watching the admin plane see it too.
            assert httpx.get(f"{gw.admin_url}/admin/state", timeout=2).json()["draining"] is True
            hurried = time.monotonic()
            gw.proc.signal(signal.SIGINT)
            # The drain's own deadline is 35 s away (delay + timeout): streams ended within
            # these waits were ended by the second signal.
            results = [f.result(timeout=10) for f in futures]
            code = wait_exit(gw, 5)
        for stream in results:
            events = stream.events()
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "shutting_down"
            assert stream.ended_at >= hurried  # still running when the second signal came
        assert code == 0
        assert_drain_logged(gw)
        finished = next(line for line in gw.proc.lines if "drain finished" in line)
        assert f"ended_at_deadline={STREAMS}" in finished, finished
    finally:
        gw.stop()


def test_sigint_is_the_quick_stop(tmp_path: Path, backends: dict[str, Backend]) -> None:
    gw = drain_gateway(tmp_path, backends, delay="5s", timeout="30s")
    try:
        with ThreadPoolExecutor(STREAMS) as pool:
            futures = start_streams(pool, gw, max_tokens=2000)
            gw.proc.signal(signal.SIGINT)
            # A drain would take 35 s (delay + timeout) and each stream 20 s: streams ended
            # within these waits were ended by the quick stop.
            results = [f.result(timeout=10) for f in futures]
            code = wait_exit(gw, 5)
        for stream in results:  # no delay, no waiting, yet every stream ends properly
            events = stream.events()
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert code == 0
        assert_drain_logged(gw)
        finished = next(line for line in gw.proc.lines if "drain finished" in line)
        assert f"ended_at_deadline={STREAMS}" in finished, finished
    finally:
        gw.stop()


@dataclass
class FakeCycle:
    """uvicorn's request-response cycle, as far as the drain's late answer uses it."""

    scope: dict[str, Any] | None
    response_started: bool = False
    response_complete: bool = False
    sent: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


@dataclass
class FakeConnection:
    cycle: FakeCycle | None


def late_answer(cycle: FakeCycle) -> tuple[int, dict[bytes, bytes], Any]:
    start, body = cycle.sent
    headers = dict(start["headers"])
    assert headers[b"content-length"] == str(len(body["body"])).encode()
    return start["status"], headers, json.loads(body["body"])


async def test_the_late_answer_speaks_each_routes_dialect() -> None:
    messages = FakeCycle({"type": "http", "path": "/v1/messages"})
    chat = FakeCycle({"type": "http", "path": "/v1/chat/completions"})
    no_scope = FakeCycle(None)
    answered = FakeCycle({"type": "http", "path": "/v1/messages"}, response_started=True)
    cycles = (messages, chat, no_scope, answered, None)
    await answer_unanswered([FakeConnection(c) for c in cycles], late_answers())

    status, headers, body = late_answer(messages)
    assert status == 503 and headers[b"x-gateway-error"] == b"shutting_down"
    assert body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the gateway is shutting down"},
    }
    for cycle in (chat, no_scope):  # OpenAI's shape, also when the route is unknown
        status, headers, body = late_answer(cycle)
        assert status == 503 and headers[b"retry-after"] == b"1"
        assert headers[b"x-gateway-error"] == b"shutting_down"
        assert body["error"]["code"] == "shutting_down"
    assert answered.sent == []  # its response had started: not the drain's to answer
