"""The ledger: one line of JSON per request, streamed to disk as requests end.

It is the single source of the load tests' numbers (the report reads it, never the gateway's
own counters). Fault events of a run go to a second file in the same directory.

Run directory layout (one per scenario run):
    <run>/scenario.yaml            the scenario as run (after defaults)
    <run>/<mode>/ledger.jsonl      one Record per request; mode is `direct` or `gateway`
    <run>/<mode>/events.jsonl      one Event per fault action, same clock as the ledger
    <run>/<mode>/meta.json         RunMeta: rates, CPU, instance start times, gateway counters
    <run>/report.md, <run>/charts/*.png
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any


@dataclass(slots=True)
class Record:
    """What one request did, as the client saw it. Times are seconds from the run's start."""

    seq: int  # 0-based order of sending
    t: float  # when it was sent (scheduled arrival, not the moment the socket wrote)
    model: str
    kind: str  # "chat" | "completions"
    stream: bool
    prompt_tokens: int
    max_tokens: int
    target: str  # where the client sent it: the gateway, or an instance name when direct
    status: int = 0  # HTTP status; 0 when no response arrived (refused, reset, client timeout)
    error: str | None = None  # client-side failure: exception class and short message
    ttfb: float | None = None  # seconds from send to the first body byte
    total: float | None = None  # seconds from send to the end (or the failure)
    bytes: int = 0
    chunks: int = 0  # SSE events received (streams)
    attempts: int | None = None  # x-gateway-attempts
    instance: str | None = None  # x-gateway-instance, or the target instance when direct
    proper: bool = False  # a full JSON body, or a stream ending in [DONE] without error event
    error_event: bool = False  # the stream carried an error event
    oom: bool = False  # a CUDA out-of-memory answer (body text or x-oom-count)
    lag: float = 0.0  # how late the generator sent it after its scheduled time
    # Added later, so defaulted: older ledger lines without them still parse.
    priority: str | None = None  # the x-gateway-priority class sent; None: no header
    shed: bool = False  # a 429 marked `x-gateway-error: shed` (gateway admission control)
    retry_after: str | None = None  # a 429's Retry-After header, as it came

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.proper

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Record:
        data = json.loads(line)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(slots=True)
class Event:
    """A fault action applied during a run (or its automatic revert)."""

    t: float
    action: str  # e.g. "set", "clear", "kill", "freeze", "thaw", "start", "restart", "network"
    target: str  # instance name, or "redis"
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Event:
        data = json.loads(line)
        return cls(data["t"], data["action"], data["target"], data.get("detail") or {})


class JsonlWriter:
    """Appends one JSON line per item, flushed in batches so memory stays flat for hours."""

    def __init__(self, path: Path, flush_every: int = 256) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("w", encoding="utf-8")
        self._pending = 0
        self._flush_every = flush_every

    def write(self, item: Record | Event) -> None:
        self._file.write(item.to_json())
        self._file.write("\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        self._file.close()


def read_records(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield Record.from_json(line)


def read_events(path: Path) -> list[Event]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as lines:
        return [Event.from_json(line) for line in lines if line.strip()]
