"""A bounded log of the requests a fake backend received, which tests can wait on."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from .waiters import CountWaiters

IN_PROGRESS = "in_progress"


class RequestRecord:
    __slots__ = (
        "body_sha256",
        "ended",
        "extra",
        "fault",
        "headers",
        "id",
        "live",
        "max_tokens",
        "method",
        "model",
        "outcome",
        "path",
        "query",
        "started",
        "stream",
    )

    def __init__(
        self,
        rid: int,
        method: str,
        path: str,
        query: str,
        headers: dict[str, str],
    ) -> None:
        self.id = rid
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.model: str | None = None
        self.stream: bool | None = None
        self.max_tokens: int | None = None
        self.fault: str | None = None
        # Lets a test prove a proxy forwarded the body byte for byte.
        self.body_sha256: str | None = None
        # Route-specific fields shown beside the common ones (the Anthropic route's credentials).
        self.extra: dict[str, Any] | None = None
        self.started = time.time()
        self.ended: float | None = None
        self.outcome = IN_PROGRESS
        # False once evicted or reset away, so its end no longer counts towards `wait_for`.
        self.live = True

    def as_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "id": self.id,
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "model": self.model,
            "stream": self.stream,
            "max_tokens": self.max_tokens,
            "headers": self.headers,
            "started": self.started,
            "ended": self.ended,
            "outcome": self.outcome,
            "fault": self.fault,
            "body_sha256": self.body_sha256,
        }
        if self.extra is not None:
            result.update(self.extra)
        return result


def header_dict(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """Header names lowercased; a repeated header's values joined with ", " as HTTP allows."""
    headers: dict[str, str] = {}
    for name_b, value_b in raw:
        name = name_b.decode("latin-1").lower()
        value = value_b.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


class RequestLog:
    def __init__(self, maxlen: int) -> None:
        self._maxlen = maxlen
        self._records: deque[RequestRecord] = deque()
        self._next_id = 1
        self._ended = 0
        # (count to reach, future to resolve): woken by `finish`, so waiting costs no polling.
        self._waiters = CountWaiters()

    def start(
        self, method: str, path: str, query: str, raw_headers: Iterable[tuple[bytes, bytes]]
    ) -> RequestRecord:
        record = RequestRecord(self._next_id, method, path, query, header_dict(raw_headers))
        self._next_id += 1
        if len(self._records) >= self._maxlen:
            self._forget(self._records.popleft())
        self._records.append(record)
        return record

    def finish(self, record: RequestRecord, outcome: str) -> None:
        if record.ended is not None:
            return
        record.ended = time.time()
        record.outcome = outcome
        if record.live:
            self._ended += 1
            if self._waiters:
                self._wake()

    def _forget(self, record: RequestRecord) -> None:
        record.live = False
        if record.ended is not None:
            self._ended -= 1

    def reset(self) -> None:
        for record in self._records:
            record.live = False
        self._records.clear()
        self._ended = 0
        self._next_id = 1

    def snapshot(self) -> list[dict[str, Any]]:
        return [record.as_dict() for record in self._records]

    async def wait_ended(self, count: int, timeout_s: float) -> bool:
        """Wait until `count` logged requests have ended; False if `timeout_s` passed first."""
        return await self._waiters.wait(count, self._ended, timeout_s)

    def _wake(self) -> None:
        self._waiters.wake(self._ended)
