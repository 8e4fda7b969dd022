"""Anthropic's Messages API through the gateway, with the official `anthropic` SDK as the client
and fake backends speaking the protocol: answers, streams, retries on 529 and on 429 with
retry-after, a mid-stream `error` event passed through and counted, and the gateway's own
errors in Anthropic's shape."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.support import Backend, Gateway, pool_policy, running_backends, start_gateway

MODEL = "m"
PROMPT = [{"role": "user", "content": "say something"}]


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("a", "b"), [MODEL], "--ttft", "0.01", "--per-token", "0.001")


@pytest.fixture
def gateway(backends: dict[str, Backend], tmp_path: Path) -> Iterator[Gateway]:
    for backend in backends.values():
        backend.reset()
        backend.set_faults()  # none
    gw = start_gateway(
        tmp_path / "policy.yaml", pool_policy(backends, "retries: {max_retry_after: 2s}")
    )
    yield gw
    gw.stop()


def client(gateway: Gateway) -> anthropic.Anthropic:
    # No retries in the SDK: every retry seen here is the gateway's.
    return anthropic.Anthropic(base_url=gateway.url, api_key="client-key", max_retries=0)


def messages(backend: Backend) -> list[dict[str, object]]:
    return [r for r in backend.requests() if r["path"] == "/v1/messages"]


def test_a_whole_answer_and_a_stream(gateway: Gateway) -> None:
    sdk = client(gateway)
    message = sdk.messages.create(model=MODEL, max_tokens=12, messages=PROMPT)
    assert message.type == "message" and message.content[0].type == "text"
    assert message.usage.output_tokens == 12
    with sdk.messages.stream(model=MODEL, max_tokens=20, messages=PROMPT) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens == 20 and final.stop_reason == "max_tokens"


@pytest.mark.parametrize(
    ("faults", "fault"),
    [
        ({"overloaded_rate": 1.0}, "overloaded"),  # 529
        ({"rate_limit_rate": 1.0, "retry_after": 1}, "rate_limit"),  # 429 + retry-after
    ],
)
def test_overloaded_and_rate_limited_answers_are_retried_elsewhere(
    gateway: Gateway, backends: dict[str, Backend], faults: dict[str, float], fault: str
) -> None:
    backends["a"].set_faults(**faults)
    sdk = client(gateway)
    retried = 0
    deadline = time.monotonic() + 5
    # Until a was tried twice (the balancer picks at random; after a 429, not for a second).
    while retried < 2 and time.monotonic() < deadline:
        raw = sdk.messages.with_raw_response.create(model=MODEL, max_tokens=4, messages=PROMPT)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-gateway-instance"] == "b"
        retried += int(raw.headers["x-gateway-attempts"]) > 1
    assert retried == 2, "instance a was tried, refused, and the request retried on b"
    refused = [r for r in messages(backends["a"]) if r["fault"] == fault]
    assert len(refused) == retried
    if fault == "rate_limit":
        # Its retry-after is honoured: a is left alone for that second, not hammered.
        starts = sorted(float(r["started"]) for r in refused)  # type: ignore[arg-type]
        assert all(later - earlier >= 0.9 for earlier, later in itertools.pairwise(starts))


def test_a_mid_stream_error_event_not_resumed_is_passed_through_and_counted(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    only_a = {"a": backends["a"]}
    backends["a"].reset()
    backends["a"].set_faults(stream_error_rate=1.0, stall_after=3)
    gw = start_gateway(tmp_path / "policy.yaml", pool_policy(only_a))
    try:
        sdk = client(gw)
        with (
            pytest.raises(anthropic.APIStatusError) as raised,
            sdk.messages.stream(model=MODEL, max_tokens=50, messages=PROMPT) as stream,
        ):
            for _ in stream.text_stream:
                pass
        assert "Overloaded" in str(raised.value)
        # The raw stream: the backend's events, ending with its error event, nothing after.
        with httpx.stream(
            "POST",
            f"{gw.url}/v1/messages",
            json={"model": MODEL, "max_tokens": 50, "messages": PROMPT, "stream": True},
            timeout=10,
        ) as response:
            body = b"".join(response.iter_bytes())
        assert response.status_code == 200
        assert body.rstrip().split(b"\n\n")[-1].startswith(b"event: error\n")
        assert b"[DONE]" not in body
        state = httpx.get(f"{gw.admin_url}/admin/state", timeout=5).json()
        instance = state["pools"]["chat"]["instances"][0]
        # Each stream was resumed as often as allowed (three times), each attempt ending in
        # the engine's error: every one counts against the instance.
        attempts = messages(backends["a"])
        assert len(attempts) == 8
        assert instance["failures"] == 8
    finally:
        gw.stop()
        backends["a"].set_faults()


def test_the_gateways_own_errors_are_in_anthropics_shape(gateway: Gateway) -> None:
    sdk = client(gateway)
    with pytest.raises(anthropic.NotFoundError) as raised:
        sdk.messages.create(model="no-such-model", max_tokens=4, messages=PROMPT)
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "the model 'no-such-model' does not exist"},
    }
    # The shape has no code: the header carries it.
    assert raised.value.response.headers["x-gateway-error"] == "model_not_found"
    response = httpx.post(f"{gateway.url}/v1/messages", content=b"{not json", timeout=5)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.headers["x-gateway-error"] == "invalid_request"


def test_a_backends_own_error_is_not_marked_as_the_gateways(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    for backend in backends.values():
        backend.set_faults(error_rate=1.0, error_status=500)
    try:
        response = httpx.post(
            f"{gateway.url}/v1/messages",
            json={"model": MODEL, "max_tokens": 4, "messages": PROMPT},
            timeout=10,
        )
    finally:
        for backend in backends.values():
            backend.set_faults()
    # Retried, then the last backend's answer relayed as it came.
    assert response.status_code == 500
    assert int(response.headers["x-gateway-attempts"]) > 1
    assert response.json()["error"] == {"type": "api_error", "message": "injected error"}
    assert "x-gateway-error" not in response.headers
