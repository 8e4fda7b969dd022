"""A real uvicorn server in a thread of the test process, on a loopback port, optionally over
TLS: for backends the tests need to look inside (connections, SNI, received headers)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send


class Recorder:
    """ASGI middleware noting each HTTP request's path, client address (one per connection)
    and headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.requests.append(
                {
                    "path": scope["path"],
                    "client": tuple(scope["client"]) if scope.get("client") else None,
                    "headers": [(k.decode(), v.decode("latin-1")) for k, v in scope["headers"]],
                }
            )
        await self.app(scope, receive, send)

    def connections(self, path_prefix: str = "/") -> set[tuple[str, int]]:
        return {r["client"] for r in self.requests if r["path"].startswith(path_prefix)}


class ThreadedServer:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread; `sni` lists the server names
    TLS clients asked for."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        certfile: str | None = None,
        keyfile: str | None = None,
    ) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.sni: list[str | None] = []
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="warning",
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
            timeout_keep_alive=30,
        )
        config.load()
        if config.ssl is not None:

            def note_sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
                self.sni.append(name)

            config.ssl.sni_callback = note_sni
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-test server did not start")
            time.sleep(0.01)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
