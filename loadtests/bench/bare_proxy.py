"""The floor for a Python streaming proxy: pure ASGI on uvicorn (uvloop + httptools), aiohttp
upstream, each upstream chunk written to the client as it arrives. No timeouts, retries,
breakers, balancing, accounting or error handling: what the gateway costs per relayed chunk
is compared with this, measured in the same run on the same core.

    python -m loadtests.bench.bare_proxy --upstream http://127.0.0.1:PORT

announces `bare-proxy READY port=<port>` once it serves. For benchmarks only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import aiohttp
from starlette.types import Receive, Scope, Send

from gateway.server import bind_listener
from loadtests.serving import rig_config, serve_announced


class BareProxy:
    """Forwards every request to one upstream, body relayed chunk by chunk."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self._session is None:  # made on the server's loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
            )
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {"content-type": "application/json"}
        url = self._upstream + scope["path"]
        async with self._session.post(url, data=body, headers=headers) as response:
            kind = response.headers.get("content-type", "application/octet-stream")
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [(b"content-type", kind.encode("latin-1"))],
                }
            )
            while chunk := await response.content.readany():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.bare_proxy")
    parser.add_argument("--upstream", required=True, help="base URL of the one upstream")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    sock = bind_listener("127.0.0.1", args.port)
    config = rig_config(BareProxy(args.upstream))
    serve_announced(config, sock, f"bare-proxy READY port={sock.getsockname()[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
