"""The official `openai` SDK as the client, through the gateway, streamed and not."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support import LOOPBACK_LISTENERS, Backend, Gateway, start_backend, start_gateway


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Backend, Gateway]]:
    backend = start_backend("sdk", ["sdk-model"], "--ttft", "0.01", "--per-token", "0.001")
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  sdk:
    models: [sdk-model]
    instances: [{{name: sdk, url: "{backend.url}"}}]
"""
    gateway = start_gateway(tmp_path_factory.mktemp("sdk") / "policy.yaml", policy)
    yield backend, gateway
    gateway.stop()
    backend.stop()


@pytest.fixture
def client(stack: tuple[Backend, Gateway]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{stack[1].url}/v1", api_key="sk-test-key", max_retries=0, timeout=20
    ) as sdk:
        yield sdk


def test_chat_completion(client: openai.OpenAI, stack: tuple[Backend, Gateway]) -> None:
    completion = client.chat.completions.create(
        model="sdk-model", messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    (record,) = stack[0].requests()
    assert record["headers"]["authorization"] == "Bearer sk-test-key"


def test_streamed_chat_completion(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="sdk-model",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = []
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert len(pieces) == 8
    assert usage is not None and usage.completion_tokens == 8


def test_completions_embeddings_and_models(client: openai.OpenAI) -> None:
    text = client.completions.create(model="sdk-model", prompt="once upon", max_tokens=3)
    assert text.choices[0].text
    embedding = client.embeddings.create(model="sdk-model", input=["a", "b"])
    assert len(embedding.data) == 2
    assert [m.id for m in client.models.list()] == ["sdk-model"]


def test_sdk_sees_gateway_errors_as_api_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.code == "model_not_found"
