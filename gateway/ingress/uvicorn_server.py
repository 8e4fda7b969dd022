"""The one module that leans on `uvicorn.Server`'s internals: the server class the gateway runs,
and what the drain reads of its connections and requests.

uvicorn is capped below its next minor release for these (and for the HTTP protocol class
`ingress.protocol` subclasses); `tests/test_library_internals.py` checks each against the
installed release and names this module when one moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Generator, Iterable
from typing import Any, cast

import uvicorn

from gateway.ingress.accept import BatchAcceptor

log = logging.getLogger("gateway")

# A request's answer given at the drain's deadline, by its path (None: unknown): its response
# headers and body.
LateAnswer = Callable[[str | None], tuple[list[tuple[bytes, bytes]], bytes]]


class GatewayServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the process (two servers share it) and
    accepts its connections many at a time (`BatchAcceptor`)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None:
            raise ValueError("the gateway's servers serve pre-bound sockets (bind_listener)")
        await super().startup(sockets=[])  # uvicorn listens on nothing itself
        loop = asyncio.get_running_loop()
        config = self.config

        # Typed as asyncio.Protocol's class, built with uvicorn's keywords.
        protocol_class = cast(Callable[..., asyncio.Protocol], config.http_protocol_class)

        def protocol() -> asyncio.Protocol:
            # What uvicorn's own listener builds for each connection.
            return protocol_class(
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=loop,
            )

        # Typed as asyncio servers: uvicorn only closes them (`close`, `wait_closed`) when it
        # stops accepting.
        acceptors = [BatchAcceptor(loop, sock, protocol) for sock in sockets]
        self.servers = cast(list[Any], acceptors)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    @property
    def in_flight(self) -> int:
        """Requests being served now (one task each)."""
        return len(self.server_state.tasks)

    @property
    def answered(self) -> int:
        """Requests answered so far: uvicorn counts one when its response completes."""
        return self.server_state.total_requests

    async def answer_unanswered(self, answer: LateAnswer) -> None:
        """Answer every request that has no response yet with `answer(its path)`."""
        await answer_unanswered(self.server_state.connections, answer)

    def cancel_requests(self, reason: str) -> int:
        """Cancel every request still being served; how many there were."""
        leftover = list(self.server_state.tasks)
        for task in leftover:
            task.cancel(reason)
        return len(leftover)


async def answer_unanswered(connections: Iterable[Any], answer: LateAnswer) -> None:
    """Answer the request of every one of `connections` (uvicorn's protocol instances) that
    has no response yet with `answer(its path)`."""
    for connection in list(connections):
        cycle = getattr(connection, "cycle", None)  # uvicorn's request-response cycle
        if cycle is None or cycle.response_started or cycle.response_complete:
            continue
        headers, body = answer(_path(cycle))
        try:
            await cycle.send({"type": "http.response.start", "status": 503, "headers": headers})
            await cycle.send({"type": "http.response.body", "body": body})
        except Exception:  # the client left, or uvicorn refused: the cancel still ends it
            log.debug("could not answer a request at the drain's deadline", exc_info=True)


def _path(cycle: Any) -> str | None:
    scope = getattr(cycle, "scope", None)
    path = scope.get("path") if isinstance(scope, dict) else None
    return path if isinstance(path, str) else None
