"""The SSE streams a data plane is relaying, so a graceful shutdown can end them properly
(`gateway.drain`), and streams on an instance being left can move (`migrate`)."""

from __future__ import annotations

from collections.abc import Callable

from gateway.errors import ShuttingDown, shutting_down
from gateway.runtime import DRAIN, Cancellation

# Whether a stream could be continued elsewhere now (`ingress.resume.StreamResume.movable`).
Movable = Callable[[], bool]


class OpenStream:
    """One stream being relayed: the instance it comes from (None while it moves between
    two), whether it could go on elsewhere, and whether it is asked to (`leave`: the relay
    looks after each chunk it forwards, so a move never lands inside an event)."""

    __slots__ = ("instance", "leave", "movable", "reason")

    def __init__(self, instance: object, movable: Movable | None) -> None:
        self.instance = instance
        self.movable = movable
        self.leave = False
        self.reason = "isolated"  # why it is asked to leave: isolated, slow


class OpenStreams:
    """The SSE streams being relayed (their requests' cancellations), with the instance each
    is on, so the drain can end them properly and an instance's can move elsewhere.

    A stream registers when its relay starts and leaves when it ends: one dict operation each.
    """

    __slots__ = ("_streams", "ending")

    def __init__(self) -> None:
        self._streams: dict[Cancellation, OpenStream] = {}
        self.ending = False  # past the drain's deadline: a stream starting now ends at once

    def __len__(self) -> int:
        return len(self._streams)

    def add(
        self, stream: Cancellation, instance: object = None, movable: Movable | None = None
    ) -> OpenStream:
        entry = self._streams[stream] = OpenStream(instance, movable)
        return entry

    def discard(self, stream: Cancellation) -> None:
        self._streams.pop(stream, None)

    def end_all(self) -> int:
        """Cancel every open stream's task; its relay ends it with `ended_by_drain`."""
        self.ending = True
        streams = list(self._streams)
        for stream in streams:
            stream.cancel(DRAIN)
        return len(streams)

    def migrate(self, instance: object) -> int:
        """Move the streams on `instance` that can be continued elsewhere (it is being left:
        isolated, drained); those that cannot go on where they are. Returns how many moved."""
        moving = [
            entry
            for entry in self._streams.values()
            if entry.instance is instance
            and not entry.leave
            and entry.movable is not None
            and entry.movable()
        ]
        for entry in moving:
            entry.leave = True
            entry.reason = "isolated"
        return len(moving)


def ended_by_drain(stream: Cancellation) -> ShuttingDown | None:
    """After a CancelledError in a relay: the error to end the stream with, if the drain's
    deadline caused it (the cancel is then consumed; not when its client left as well:
    `Cancellation.consume`)."""
    return shutting_down() if stream.consume(DRAIN) else None
