"""Stream resume on a real engine: llama.cpp's server, greedy decoding, a stream cut mid-way by
a TCP proxy that resets the connection after some bytes, and continued by the gateway on the
same engine reached directly. The client must get exactly what the engine gives when nothing
breaks: every word once, in order, one stream.

Each protocol exercises the engine's own continuation behaviour: chat through vLLM's pair
(`continue_final_message`, `add_generation_prompt: false`), which llama.cpp's server honours;
completions through prompt + text; the Messages route through a prefill, which llama.cpp's
server streams again before the continuation (dropped by `resume.echo: auto`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtests.engine.server import Engine
from loadtests.procs import ManagedProcess, python_module
from tests.engine import MODEL_NAME, engine_model, running_engine
from tests.support import LOOPBACK_LISTENERS, Gateway, start_gateway

PROMPT = "tell me about the river"
GREEDY = {"temperature": 0, "seed": 1}
CUT_AFTER_BYTES = 1500  # a few of llama.cpp's events, well before the end of the answer


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from running_engine(engine_model("tiny"), tmp_path_factory.mktemp("engine"), slots=2)


@pytest.fixture(scope="module")
def proxy(engine: Engine) -> Iterator[ManagedProcess]:
    argv = python_module(
        "loadtests.chaos.tcpproxy",
        *("--listen-port", "0", "--upstream", f"127.0.0.1:{engine.port}"),
        *("--control-port", "0", "--seed", "1"),
    )
    proc = ManagedProcess(argv)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(
    engine: Engine, proxy: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    # `cut` reaches the engine through the proxy, `whole` directly: the same engine, so a
    # continuation on `whole` must give the very words the cut stream would have.
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  llama:
    models: [{MODEL_NAME}]
    instances:
      - {{name: cut, url: "http://127.0.0.1:{proxy.port()}"}}
      - {{name: whole, url: "{engine.url}"}}
    health: {{enabled: false}}
    hedging: false
    # Every cut is on purpose, one per test: `cut` stays in rotation for the next test.
    breaker: {{consecutive_failures: 100}}
"""
    gw = start_gateway(tmp_path_factory.mktemp("gateway") / "policy.yaml", policy)
    yield gw
    gw.stop()


def cut_streams(proxy: ManagedProcess, after_bytes: int) -> None:
    url = f"http://127.0.0.1:{proxy.port('control')}/faults"
    response = httpx.post(url, json={"reset_after_bytes": after_bytes}, timeout=5)
    response.raise_for_status()


def events(url: str, path: str, body: dict[str, Any]) -> tuple[str, list[tuple[str | None, str]]]:
    """The instance that answered (or "" direct) and the (event name, data) of a stream."""
    out: list[tuple[str | None, str]] = []
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url + path, json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200, response.read()
        instance = response.headers.get("x-gateway-instance", "")
        buffer = b""
        for chunk in response.iter_raw():
            buffer += chunk
            while b"\n\n" in buffer:
                raw, buffer = buffer.split(b"\n\n", 1)
                name: str | None = None
                data = ""
                for line in raw.decode().splitlines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data = line[5:].strip()
                out.append((name, data))
    return instance, out


def text_of(path: str, stream: list[tuple[str | None, str]]) -> str:
    pieces: list[str] = []
    for name, data in stream:
        if not data.startswith("{"):
            continue
        event = json.loads(data)
        assert "error" not in event and name != "error", data
        if path == "/v1/messages":
            if event["type"] == "content_block_delta":
                pieces.append(event["delta"]["text"])
        elif event.get("choices"):
            choice = event["choices"][0]
            pieces.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(pieces)


def resumes_of_cut(gateway: Gateway) -> float:
    """Streams resumed after `cut` broke them, by the gateway's metrics."""
    metrics = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
    rows = [r for r in metrics.splitlines() if r.startswith("gateway_stream_resumes_total{")]
    return sum(float(r.rsplit(" ", 1)[1]) for r in rows if 'backend="cut"' in r)


BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40},
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 40},
    "/v1/messages": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40},
}


@pytest.mark.parametrize("path", list(BODIES), ids=["chat", "completions", "messages"])
def test_a_cut_stream_is_continued_with_exactly_the_engines_words(
    engine: Engine, proxy: ManagedProcess, gateway: Gateway, path: str
) -> None:
    body = {"model": MODEL_NAME, **BODIES[path], **GREEDY}
    _, direct = events(engine.url, path, body)
    expected = text_of(path, direct)
    assert len(expected.split()) >= 30  # long enough to be cut well before its end
    before = resumes_of_cut(gateway)
    cut_streams(proxy, CUT_AFTER_BYTES)
    try:
        for _ in range(20):  # until the balancer sends the first attempt through the proxy
            instance, through = events(gateway.url, path, body)
            assert text_of(path, through) == expected
            if instance == "cut":
                break
        assert instance == "cut"
    finally:
        cut_streams(proxy, 0)
    names = [name for name, _ in through]
    if path == "/v1/messages":
        assert names.count("message_start") == 1 and names[-1] == "message_stop"
    else:
        data = [d for _, d in through]
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
        assert len({json.loads(d)["id"] for d in data if d.startswith("{")}) == 1
    assert resumes_of_cut(gateway) == before + 1


def whole_text(path: str, answer: dict[str, Any]) -> str:
    if path == "/v1/messages":
        assert answer["type"] == "message"
        return "".join(block["text"] for block in answer["content"] if block["type"] == "text")
    (choice,) = answer["choices"]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


@pytest.mark.parametrize("path", list(BODIES), ids=["chat", "completions", "messages"])
def test_a_cut_whole_answer_is_continued_with_exactly_the_engines_words(
    engine: Engine, proxy: ManagedProcess, gateway: Gateway, path: str
) -> None:
    """A whole answer is fetched as a stream: cut mid-way, it is continued, and the client
    gets the engine's own whole answer's words, in one JSON answer."""
    body = {"model": MODEL_NAME, **BODIES[path], **GREEDY}
    direct = httpx.post(engine.url + path, json=body, timeout=60)
    assert direct.status_code == 200, direct.text
    expected = whole_text(path, direct.json())
    assert len(expected.split()) >= 30
    before = resumes_of_cut(gateway)
    cut_streams(proxy, CUT_AFTER_BYTES)
    try:
        for _ in range(20):  # until the balancer sends the first attempt through the proxy
            response = httpx.post(gateway.url + path, json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == "application/json"
            answer = response.json()
            assert whole_text(path, answer) == expected
            if resumes_of_cut(gateway) > before:
                break
        assert resumes_of_cut(gateway) == before + 1
    finally:
        cut_streams(proxy, 0)
    if path == "/v1/messages":
        assert answer["stop_reason"] == direct.json()["stop_reason"]
        assert answer["usage"]["output_tokens"] == direct.json()["usage"]["output_tokens"]
    else:
        own = direct.json()
        assert answer["choices"][0]["finish_reason"] == own["choices"][0]["finish_reason"]
        assert answer["usage"]["completion_tokens"] == own["usage"]["completion_tokens"]
        assert answer["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"]
