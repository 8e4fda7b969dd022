"""A real inference engine for the tests: llama.cpp's server on loopback, with a generated model.

Model files are written once per machine (cached in the temp directory, see
loadtests/engine/model.py) and looked up once per session. Engines started here are always
stopped, whatever the test did. A missing llama-server fails the test with the command that
installs it: these tests never skip.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.engine.model import model_path
from loadtests.engine.server import Engine, EngineMissing, start_engine

MODEL_NAME = "m"
_log_numbers = count(1)


@cache
def engine_model(preset: str) -> Path:
    """The `preset` model file, generated on first use (`tiny` or `slow`)."""
    return model_path(preset)


def launch(model: Path, log_dir: Path, **options: Any) -> Engine:
    """start_engine, logging to `log_dir`; a missing llama-server fails the test (no skip)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"llama-server-{next(_log_numbers)}.log"
    try:
        return start_engine(model, alias=MODEL_NAME, log_path=log_path, **options)
    except EngineMissing as exc:
        pytest.fail(f"{exc} (it builds llama.cpp once, then caches the wheel)", pytrace=False)


def running_engine(model: Path, log_dir: Path, **options: Any) -> Iterator[Engine]:
    """For a fixture: `yield from running_engine(...)`; stopped when the fixture ends."""
    engine = launch(model, log_dir, **options)
    try:
        yield engine
    finally:
        engine.stop()


def chat_body(max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "tell me about the river"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def sse_data(response: httpx.Response) -> Iterator[str]:
    """The `data:` payload of each server-sent event, as it arrives."""
    buffer = b""
    for chunk in response.iter_raw():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            yield event[len(b"data: ") :].decode()


def metric(engine: Engine, name: str) -> float:
    """One unlabelled sample from the engine's /metrics (e.g. `llamacpp:requests_deferred`)."""
    text = httpx.get(f"{engine.url}/metrics", timeout=10).raise_for_status().text
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    raise AssertionError(f"{name} not in /metrics:\n{text}")


class Timeline:
    """A total order of what the client threads observed: one sequence number per event."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = count()

    def stamp(self) -> int:
        with self._lock:
            return next(self._next)


@dataclass
class Stream:
    """A streamed chat completion run in its own thread; records when things arrived."""

    name: str
    max_tokens: int
    timeline: Timeline
    headers_at: int | None = None
    token_stamps: list[int] = field(default_factory=list)
    done_at: int | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self, url: str) -> Stream:
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()
        return self

    def join(self, timeout_s: float = 60.0) -> None:
        assert self.thread is not None
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"{self.name} still streaming"
        if self.error is not None:
            raise self.error

    def tokens_before(self, stamp: int) -> int:
        return sum(s < stamp for s in self.token_stamps)

    def _run(self, url: str) -> None:
        body = chat_body(self.max_tokens, stream=True, ignore_eos=True)
        try:
            with (
                httpx.Client(timeout=60.0) as client,
                client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
            ):
                self.headers_at = self.timeline.stamp()
                response.raise_for_status()
                for data in sse_data(response):
                    if data == "[DONE]":
                        self.done_at = self.timeline.stamp()
                        break
                    if json.loads(data)["choices"][0]["delta"].get("content"):
                        self.token_stamps.append(self.timeline.stamp())
        except BaseException as exc:  # reported by join(), in the test's thread
            self.error = exc
