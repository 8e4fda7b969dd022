"""llama.cpp's real server refusing a prompt over its context window: the gateway reads its
refusal as a context-length error and hands the request to `context_fallbacks`, once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.core.refusals import refusal_of
from loadtests.engine.server import Engine
from tests.engine import MODEL_NAME, engine_model, running_engine
from tests.support import LOOPBACK_LISTENERS, Backend, start_backend, start_gateway

# Far over the engine's 128-token window, whatever the tokenizer makes of it.
LONG_PROMPT = " ".join(f"river{i} flows" for i in range(300))


def _body(model: str, stream: bool = False) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": LONG_PROMPT}],
        "max_tokens": 8,
        "stream": stream,
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from running_engine(engine_model("tiny"), tmp_path_factory.mktemp("ctx"), ctx_size=128)


@pytest.fixture(scope="module")
def big() -> Iterator[Backend]:
    backend = start_backend("big", ["big-model"], "--ttft", "0.01", "--per-token", "0.001")
    yield backend
    backend.stop()


def test_llama_cpp_words_a_long_prompt_as_a_context_length_error(engine: Engine) -> None:
    answer = httpx.post(f"{engine.url}/v1/chat/completions", json=_body(MODEL_NAME), timeout=60)
    assert answer.status_code == 400, answer.text
    assert refusal_of(400, answer.content) == "context_length", answer.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_window_goes_to_context_fallbacks(
    engine: Engine, big: Backend, tmp_path: Path, stream: bool
) -> None:
    big.reset()
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  small:
    models: [{MODEL_NAME}]
    instances: [{{name: llama, url: "{engine.url}"}}]
    fallbacks: [big]
    context_fallbacks: [big]
  big:
    models: [big-model]
    instances: [{{name: big, url: "{big.url}"}}]
"""
    gateway = start_gateway(tmp_path / "policy.yaml", policy)
    try:
        answer = httpx.post(
            f"{gateway.url}/v1/chat/completions", json=_body(MODEL_NAME, stream), timeout=60
        )
    finally:
        gateway.stop()
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-gateway-pool"] == "big"
    assert answer.headers["x-gateway-attempts"] == "2"  # one on llama.cpp, never retried
    assert '"big-model"' in answer.text
    (sent,) = big.requests()
    assert sent["model"] == "big-model"
