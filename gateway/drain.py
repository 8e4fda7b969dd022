"""Graceful shutdown: SIGTERM drains the data plane instead of cutting it.

1. SIGTERM: `/readyz` answers 503 `{"ready": false, "draining": true}`; requests are still
   served as usual for `drain.delay`, while Kubernetes takes the pod out of its Services.
2. The data plane's listener closes (new connections are refused); idle keep-alive connections
   are closed, busy ones get `Connection: close` on their response (uvicorn's own shutdown).
3. In-flight requests and streams may finish for `drain.timeout`, counted from step 2.
4. At that deadline every SSE stream still open ends with an SSE error event (`shutting_down`)
   and `data: [DONE]`, never a silent cut. A request still without an answer a moment later
   gets a 503 `shutting_down` (Retry-After: 1; in its route's error shape) and is cancelled
   (its upstream request closed, so vLLM aborts it); a non-streamed body already under way is
   cut (the connection closes, so the client sees an incomplete response, as for a backend
   that dies mid-body).
5. The admin plane, which kept serving, closes; background tasks stop (`Gateway.close`); exit 0.

A second SIGTERM during the drain skips to step 4 at once. SIGINT (Ctrl-C) is the quick stop,
as in gunicorn: straight to step 4, so streams still end properly but nobody waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from gateway.config.models import DrainPolicy
from gateway.errors import shutting_down
from gateway.ingress.dialect import Dialect, dialect_for
from gateway.ingress.streams import OpenStreams
from gateway.ingress.uvicorn_server import GatewayServer, LateAnswer

log = logging.getLogger("gateway")

# After the deadline: time for the ended streams to flush their last event, and then for the
# cancelled requests to be answered, before the process stops waiting for them.
END_GRACE_S = 1.0


def late_answers() -> LateAnswer:
    """The 503 `shutting_down` for a request on a path, in its route's dialect (OpenAI's when
    the route is unknown): its headers and body, made once per dialect."""
    answers: dict[Dialect, tuple[list[tuple[bytes, bytes]], bytes]] = {}

    def answer(path: str | None) -> tuple[list[tuple[bytes, bytes]], bytes]:
        dialect = dialect_for(path or "")
        made = answers.get(dialect)
        if made is None:
            made = answers[dialect] = _late_answer(dialect)
        return made

    return answer


def _late_answer(dialect: Dialect) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The 503 `shutting_down` in a route's dialect: its headers and body."""
    error = shutting_down()
    body = dialect.body(error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        error.header,
    ]
    return headers, body


class Drain:
    """Runs the steps above once the first signal comes (see `signal`), with the `drain`
    settings `policy` gives then (a policy reload may change them until SIGTERM)."""

    def __init__(
        self,
        policy: Callable[[], DrainPolicy],
        data: GatewayServer,
        data_task: asyncio.Task[None],
        admin: Sequence[GatewayServer],
        set_draining: Callable[[bool], None],
        streams: OpenStreams,
    ) -> None:
        self._policy = policy
        self._data = data
        self._data_task = data_task
        self._admin = admin
        self._set_draining = set_draining
        self._streams = streams
        self._hurry = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self._task is not None

    def signal(self) -> None:
        """SIGTERM: start draining; a second one ends the drain at once."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        else:
            self._hurry.set()

    def interrupt(self) -> None:
        """SIGINT: end at once (streams still get their proper ending)."""
        self._hurry.set()
        self.signal()

    async def _wait(self, timeout_s: float, *others: asyncio.Future[Any]) -> None:
        """Until `timeout_s` passes, a second signal comes, or one of `others` is done."""
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait([hurry, *others], timeout=timeout_s, return_when="FIRST_COMPLETED")
        finally:
            hurry.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        data = self._data
        in_flight = data.in_flight
        answered = data.answered
        policy = self._policy()  # read once: a reload during the drain does not change it
        self._set_draining(True)
        fields: dict[str, Any] = {
            "delay_s": policy.delay,
            "timeout_s": policy.timeout,
            "in_flight": in_flight,
            "streams": len(self._streams),
        }
        log.warning("drain started", extra={"fields": fields})
        ended = cut = 0
        try:
            await self._wait(policy.delay, self._data_task)
            # uvicorn notices within its 0.1 s tick: it closes the listener and idle
            # connections, and gives the busy ones `Connection: close`.
            data.should_exit = True
            await self._wait(policy.timeout, self._data_task)
            ended = self._streams.end_all()
            if not self._data_task.done():
                await asyncio.wait([self._data_task], timeout=END_GRACE_S)
            if not self._data_task.done():
                await data.answer_unanswered(late_answers())
                cut = data.cancel_requests("the drain's deadline passed")
                await asyncio.wait([self._data_task], timeout=END_GRACE_S)
                data.force_exit = True
        finally:
            for server in self._admin:  # the admin plane (and the metrics listener)
                server.should_exit = True
            fields = {
                # answered during the drain (in flight at its start, or new during the delay)
                "completed": max(0, data.answered - answered - ended - cut),
                "ended_at_deadline": ended,
                "cancelled": cut,
                "duration_s": round(loop.time() - started, 3),
            }
            log.warning("drain finished", extra={"fields": fields})
