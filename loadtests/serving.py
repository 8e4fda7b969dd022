"""Run a uvicorn server for the local test rig on a pre-bound socket, announce it on one line
(`loadtests.procs` waits for that line), and exit with status 0 on SIGTERM or SIGINT."""

from __future__ import annotations

import signal
import socket
from types import FrameType

import uvicorn
from starlette.types import ASGIApp


class _AnnouncingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, announce: str) -> None:
        super().__init__(config)
        self._announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self._announce, flush=True)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """uvicorn re-raises the stop signal after shutting down; by then there is nothing to do."""


def rig_config(app: ASGIApp, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn as the rig's servers run it: uvloop + httptools, no lifespan, no access log, no
    server or date header, and a 1 s grace at stop (a hung request must not delay a stop)."""
    return uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        server_header=False,
        date_header=False,
        log_level=log_level,
        backlog=2048,
        timeout_graceful_shutdown=1,
    )


def serve_announced(config: uvicorn.Config, sock: socket.socket, announce: str) -> None:
    """Serve on `sock` until stopped; print `announce` once serving."""
    signal.signal(signal.SIGTERM, _ignore)
    signal.signal(signal.SIGINT, _ignore)
    _AnnouncingServer(config, announce).run(sockets=[sock])
