"""llama.cpp's server with a generated model, driven directly (no gateway): what the gateway can
rely on from a real engine — its API shapes, its metrics, and how it queues beyond its slots."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.engine.server import Engine
from loadtests.procs import wait_until
from tests.engine import (
    MODEL_NAME,
    Stream,
    Timeline,
    chat_body,
    engine_model,
    launch,
    metric,
    running_engine,
    sse_data,
)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return engine_model("tiny")


@pytest.fixture(scope="session")
def slow_model() -> Path:
    return engine_model("slow")


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from running_engine(tiny_model, tmp_path_factory.mktemp("engine"), slots=2)


@pytest.fixture
def client(engine: Engine) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=30.0) as c:
        yield c


def test_health_and_models(client: httpx.Client) -> None:
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]


def test_chat_completion_runs_to_max_tokens(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=chat_body(200, ignore_eos=True))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 200
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    text = choice["message"]["content"]
    assert text.strip() and text.isascii() and text.isprintable(), text


def test_model_never_ends_early_even_without_ignore_eos(client: httpx.Client) -> None:
    # The end-of-text token is out of reach by construction (model.py), whatever the seed.
    for seed in range(3):
        body = client.post("/v1/chat/completions", json=chat_body(100, seed=seed)).json()
        assert body["usage"]["completion_tokens"] == 100
        assert body["choices"][0]["finish_reason"] == "length"


def test_streamed_chat_sends_chunks_then_done(client: httpx.Client) -> None:
    body = chat_body(20, stream=True, ignore_eos=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_data(response))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    contents = [
        c["choices"][0]["delta"]["content"]
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    assert len(contents) == 20  # one chunk per token: every token is whole ASCII text
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 20


def test_metrics_count_requests_and_tokens(engine: Engine, client: httpx.Client) -> None:
    for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred"):
        assert metric(engine, name) == 0
    before = metric(engine, "llamacpp:tokens_predicted_total")
    client.post("/v1/chat/completions", json=chat_body(7, ignore_eos=True)).raise_for_status()
    assert metric(engine, "llamacpp:tokens_predicted_total") == before + 7
    assert metric(engine, "llamacpp:prompt_tokens_total") > 0


# Its own bounds add up past pytest's default: the engine's start (up to 60 s for its port,
# 60 s more for its health), two waits of 30 s, then the streams' joins of 60 s.
@pytest.mark.timeout(300)
def test_requests_beyond_the_slots_wait_for_one_to_end(slow_model: Path, tmp_path: Path) -> None:
    """Two slots, four streams: the last two get no response at all (not even headers) until a
    running one has finished. The slow model makes a token take tens of milliseconds, so the
    order below is decided by whole tokens, not by thread scheduling."""
    timeline = Timeline()
    engine = launch(slow_model, tmp_path, slots=2)
    a, b = Stream("a", 30, timeline), Stream("b", 90, timeline)
    queued = [Stream("c", 30, timeline), Stream("d", 30, timeline)]
    streams = [a, b, *queued]
    try:
        for s in (a, b):
            s.start(engine.url)
        assert wait_until(lambda: a.headers_at is not None and b.headers_at is not None, 30.0)
        assert metric(engine, "llamacpp:requests_processing") == 2

        for s in queued:
            s.start(engine.url)
        assert wait_until(lambda: metric(engine, "llamacpp:requests_deferred") == 2, 30.0)
        assert all(s.headers_at is None for s in queued)
        for s in streams:
            s.join()
    finally:
        engine.stop()
        for s in streams:
            if s.thread is not None:
                s.thread.join(5.0)

    for s in streams:
        assert len(s.token_stamps) == s.max_tokens, s.name
        assert s.done_at is not None
    # Whenever a stream got its headers, fewer than two others were still generating. A stream
    # one token short of its end counts as ended: its last token and the next stream's headers
    # leave the engine at the same moment.
    for s in streams:
        assert s.headers_at is not None
        running = [
            o.name
            for o in streams
            if o is not s
            and o.headers_at is not None
            and o.headers_at < s.headers_at
            and o.tokens_before(s.headers_at) < o.max_tokens - 1
        ]
        assert len(running) < 2, (s.name, running)
    # The short "a" ends long before "b": the first queued stream takes a's slot, and the second
    # the first one's, while "b" is still generating.
    second, third = sorted(queued, key=lambda s: s.headers_at or 0)
    assert a.tokens_before(second.headers_at or 0) >= a.max_tokens - 1
    assert second.tokens_before(third.headers_at or 0) >= second.max_tokens - 1
    assert b.tokens_before(third.headers_at or 0) < b.max_tokens - 1


def test_freeze_thaw_kill(tiny_model: Path, tmp_path: Path) -> None:
    engine = launch(tiny_model, tmp_path)
    try:
        engine.freeze()
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{engine.url}/health", timeout=0.3)
        engine.thaw()
        assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200
        engine.kill()
        assert engine.proc.returncode == -signal.SIGKILL
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{engine.url}/health", timeout=2)
    finally:
        engine.stop()


def test_stop_is_a_clean_exit(tiny_model: Path, tmp_path: Path) -> None:
    engine = launch(tiny_model, tmp_path)
    engine.freeze()  # stop() must still end it: it thaws before SIGTERM
    assert engine.stop() == 0, engine.log()
