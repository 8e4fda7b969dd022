"""An upstream response on its way to the client, read up to the commit point."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import aiohttp

from gateway.errors import UpstreamTimeout, map_upstream_exception

if TYPE_CHECKING:
    from gateway.upstream.registry import InstanceState


class UpstreamResponse:
    """Status and headers, plus either the whole body (`body`) or a stream to relay.

    For a stream, `first_chunk` was already read, so a failure before the first byte happens
    while the attempt can still be retried. `finish()` must be called exactly once when the
    relay ends; it closes the upstream connection if the body was not read to the end.
    """

    __slots__ = (
        "_on_finish",
        "_raw",
        "body",
        "first_chunk",
        "headers",
        "instance",
        "is_sse",
        "status",
    )

    def __init__(
        self,
        instance: InstanceState,
        raw: aiohttp.ClientResponse,
        *,
        body: bytes | None,
        first_chunk: bytes,
        is_sse: bool,
        on_finish: Callable[[UpstreamResponse, bool], None],
    ) -> None:
        self.instance = instance
        self._raw = raw
        self.status = raw.status
        self.headers = raw.raw_headers
        self.body = body
        self.first_chunk = first_chunk
        self.is_sse = is_sse
        self._on_finish = on_finish

    async def rest(self, deadline: float) -> AsyncIterator[bytes]:
        """The body after `first_chunk`, as it arrives; raises UpstreamError if it breaks.

        `deadline` (event-loop time) ends the exchange: it is checked as each chunk arrives,
        and the idle timeout bounds the wait for the next one, so it is overrun by at most
        one idle gap without costing a timer per request.
        """
        content = self._raw.content
        loop_time = asyncio.get_running_loop().time
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                if loop_time() > deadline:
                    raise UpstreamTimeout(
                        "the upstream exceeded the timeout ceiling", phase="total"
                    )
                yield chunk
        except Exception as exc:
            raise map_upstream_exception(exc, phase="body") from exc

    def finish(self, ok: bool) -> None:
        """Release the connection (or close it when the body was cut short); account once."""
        if self._raw.connection is not None and not ok:
            self._raw.close()
        else:
            self._raw.release()
        self._on_finish(self, ok)
