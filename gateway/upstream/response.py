"""An upstream response on its way to the client, read up to the commit point."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp

from gateway.errors import UpstreamError, UpstreamTimeout, map_upstream_exception
from gateway.pipeline.watchdog import Deadline, Watchdog, expired

if TYPE_CHECKING:
    from gateway.upstream.registry import InstanceState


class UpstreamResponse:
    """Status and headers, plus either the whole body (`body`) or a stream to relay.

    For a stream, `first_chunk` was already read, so a failure before the first byte happens
    while the attempt can still be retried. `finish()` must be called exactly once when the
    relay ends; it closes the upstream connection if the body was not read to the end.
    `is_sse` is true only for an uncompressed event stream: the gateway may append an error
    event to it, which would corrupt a compressed one.
    """

    __slots__ = (
        "_deadline",
        "_loop_time",
        "_on_finish",
        "_raw",
        "_watchdog",
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
        deadline: Deadline,
        watchdog: Watchdog,
        on_finish: Callable[[UpstreamResponse, bool], None],
    ) -> None:
        self.instance = instance
        self._raw = raw
        self.status = raw.status
        self.headers = raw.raw_headers
        self.body = body
        self.first_chunk = first_chunk
        self.is_sse = is_sse
        self._deadline = deadline
        self._watchdog = watchdog
        self._loop_time = asyncio.get_running_loop().time
        self._on_finish = on_finish

    async def next_chunk(self, idle_s: float, end_at: float) -> bytes:
        """The next piece of the body as it arrives (b"" at the end); raises UpstreamError.

        Waits at most `idle_s` for it, and never past `end_at` (the exchange's deadline).
        """
        deadline = self._deadline
        now = self._loop_time()
        if now + idle_s < end_at:
            deadline.move(now + idle_s, "idle")
        else:
            deadline.move(end_at, "total")
        try:
            return await self._raw.content.readany()
        except asyncio.CancelledError:
            if expired(deadline):
                raise self.timeout() from None
            raise
        except Exception as exc:
            raise map_upstream_exception(exc, phase="body") from exc
        finally:
            deadline.move(end_at, "total")  # while the client is being written to

    def cancelled_by_deadline(self) -> UpstreamError | None:
        """After a CancelledError outside `next_chunk`: the timeout it stands for, if any."""
        return self.timeout() if expired(self._deadline) else None

    def timeout(self) -> UpstreamTimeout:
        phase = self._deadline.phase
        return UpstreamTimeout(f"the upstream timed out ({phase})", phase=phase)

    def finish(self, ok: bool) -> None:
        """Release the connection (or close it when the body was cut short); account once."""
        self._watchdog.disarm(self._deadline)
        if self._raw.connection is not None and not ok:
            self._raw.close()
        else:
            self._raw.release()
        self._on_finish(self, ok)
