"""The SSE streams a data plane is relaying, so a graceful shutdown can end them properly
(`gateway.drain`)."""

from __future__ import annotations

from gateway.errors import ShuttingDown, shutting_down
from gateway.runtime import DRAIN, Cancellation


class OpenStreams:
    """The SSE streams being relayed (their requests' cancellations), so the drain can end
    them properly.

    A stream registers when its relay starts and leaves when it ends: one set operation each.
    """

    __slots__ = ("_streams", "ending")

    def __init__(self) -> None:
        self._streams: set[Cancellation] = set()
        self.ending = False  # past the drain's deadline: a stream starting now ends at once

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, stream: Cancellation) -> None:
        self._streams.add(stream)

    def discard(self, stream: Cancellation) -> None:
        self._streams.discard(stream)

    def end_all(self) -> int:
        """Cancel every open stream's task; its relay ends it with `ended_by_drain`."""
        self.ending = True
        streams = list(self._streams)
        for stream in streams:
            stream.cancel(DRAIN)
        return len(streams)


def ended_by_drain(stream: Cancellation) -> ShuttingDown | None:
    """After a CancelledError in a relay: the error to end the stream with, if the drain's
    deadline caused it (the cancel is then consumed)."""
    return shutting_down() if stream.consume(DRAIN) else None
