"""The HTTP client side of the Python load generators: one aiohttp session, no hidden queue."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")

JSON_HEADERS = {"Content-Type": "application/json"}
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30.0, sock_connect=5.0)


def chat_body(model: str, **extra: Any) -> bytes:
    payload = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return json.dumps(payload, separators=(",", ":")).encode()


def new_session() -> aiohttp.ClientSession:
    # limit=0: every due request gets a connection at once instead of waiting in the pool,
    # which would turn an open-loop schedule back into a closed loop.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=REQUEST_TIMEOUT,
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        trust_env=False,
    )


def run_async(main: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine on uvloop when available: the generator must be faster than its target."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency of the gateway
        factory = None

    async def wrapper() -> T:
        return await main()

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(wrapper())
