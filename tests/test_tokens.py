"""Token counts and the GenAI span attributes, end to end: a gateway process in front of fake
vLLMs, the real OTLP exporter to an in-test receiver. What the gateway counts equals what each
answer's `usage` says, whole and streamed, on OpenAI's routes and on Anthropic's Messages API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.otlp_receiver import OtlpReceiver
from tests.support import Backend, Gateway, pool_policy, running_backends, start_gateway


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("a",), ["m"], "--ttft", "0.01", "--per-token", "0.002")


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture
def gateway(
    tmp_path: Path, backends: dict[str, Backend], receiver: OtlpReceiver
) -> Iterator[Gateway]:
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.traces_url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    policy = pool_policy(backends, top="telemetry: {tracing: true}")
    gw = start_gateway(tmp_path / "policy.yaml", policy, env)
    try:
        yield gw
    finally:
        gw.stop()


def tokens(gateway: Gateway) -> dict[str, float]:
    """Tokens counted by type, and (as "streams") the streams timed per output token."""
    text = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
    found = {"input": 0.0, "output": 0.0, "streams": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "gateway_tokens":
            for sample in family.samples:
                found[sample.labels["type"]] += sample.value
        if family.name == "gateway_time_per_output_token_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    found["streams"] += sample.value
    return found


def events(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def usage_said(path: str, body: dict[str, Any], response: httpx.Response) -> tuple[int, int]:
    """The usage the client was told: (input, output)."""
    if not body.get("stream"):
        usage = response.json()["usage"]
        if path in ("/v1/messages", "/v1/responses"):
            return usage["input_tokens"], usage["output_tokens"]
        return usage["prompt_tokens"], usage["completion_tokens"]
    said = events(response.text)
    if path == "/v1/responses":
        usage = [e for e in said if e["type"] == "response.completed"][-1]["response"]["usage"]
        return usage["input_tokens"], usage["output_tokens"]
    if path == "/v1/messages":
        start = next(e for e in said if e["type"] == "message_start")
        delta = [e for e in said if e["type"] == "message_delta"][-1]
        return start["message"]["usage"]["input_tokens"], delta["usage"]["output_tokens"]
    usage = [e for e in said if e.get("usage")][-1]["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"]


CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two three"}]}),
    # A whole body as it came (embeddings are never fetched as a stream).
    ("/v1/embeddings", {"input": ["thirteen fourteen", "fifteen"]}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "four five"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    ("/v1/completions", {"prompt": "six seven eight nine"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "ten"}], "max_tokens": 9}),
    (
        "/v1/messages",
        {
            "messages": [{"role": "user", "content": "eleven twelve"}],
            "max_tokens": 7,
            "stream": True,
        },
    ),
    # The Responses API: its own keys, its stream's usage in its last event.
    ("/v1/responses", {"input": "sixteen seventeen", "max_output_tokens": 5}),
    ("/v1/responses", {"input": "eighteen", "max_output_tokens": 4, "stream": True}),
]


def test_token_counts_equal_the_answers_usage_and_spans_carry_it(
    gateway: Gateway, receiver: OtlpReceiver
) -> None:
    expected = {"input": 0, "output": 0}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        for path, extra in CASES:
            body = {"model": "m", "max_tokens": 6, **extra}
            response = http.post(path, json=body)
            assert response.status_code == 200, response.text
            said_in, said_out = usage_said(path, body, response)
            assert said_in > 0 and (said_out > 0 or path == "/v1/embeddings")
            expected["input"] += said_in
            expected["output"] += said_out
        # A stream that did not ask for usage says none: it is not counted (not guessed).
        quiet = {
            "model": "m",
            "max_tokens": 6,
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        }
        assert http.post("/v1/chat/completions", json=quiet).status_code == 200
    counted = tokens(gateway)
    assert (counted["input"], counted["output"]) == (expected["input"], expected["output"])
    # Streams that said their usage are timed per output token: the three streamed cases,
    # and the whole answers fetched as streams (chat, completions, messages).
    assert counted["streams"] == 6

    assert receiver.wait_for(
        lambda spans: sum(1 for s in spans if s.kind == "SERVER") >= len(CASES) + 1, timeout_s=10
    )
    servers = sorted((s for s in receiver.spans if s.kind == "SERVER"), key=lambda s: s.start_ns)
    for span, (path, _) in zip(servers, CASES, strict=False):
        attributes = span.attributes
        anthropic = path == "/v1/messages"
        assert attributes["http.route"] == path
        assert attributes["gen_ai.provider.name"] == ("anthropic" if anthropic else "openai")
        operations = {"/v1/completions": "text_completion", "/v1/embeddings": "embeddings"}
        assert attributes["gen_ai.operation.name"] == operations.get(path, "chat")
        assert attributes["gen_ai.request.model"] == "m"
        assert attributes["gen_ai.response.model"] == "m"
        assert attributes["gen_ai.usage.input_tokens"] > 0
        assert attributes["gen_ai.usage.output_tokens"] >= (path != "/v1/embeddings")
        assert "error.type" not in attributes
    attempts = [s for s in receiver.spans if s.kind == "CLIENT"]
    assert attempts and all(a.attributes["gen_ai.request.model"] == "m" for a in attempts)
    told = [a for a in attempts if "gen_ai.usage.output_tokens" in a.attributes]
    assert len(told) == len(CASES)  # every attempt whose answer said its usage (not `quiet`)
    operations = {"chat", "text_completion", "embeddings"}
    assert all(a.attributes["gen_ai.operation.name"] in operations for a in told)


def test_a_stream_continued_after_a_break_counts_the_usage_the_client_was_told(
    gateway: Gateway, backends: dict[str, Backend], receiver: OtlpReceiver
) -> None:
    cases = [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "one two three"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        ("/v1/messages", {"messages": [{"role": "user", "content": "four five"}], "stream": True}),
    ]
    before = tokens(gateway)
    expected = {"input": 0, "output": 0}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        for path, extra in cases:
            backends["a"].set_faults(die_next=1, die_after=3)  # cut after 3 of its 8 tokens
            body = {"model": "m", "max_tokens": 8, **extra}
            response = http.post(path, json=body)
            assert response.status_code == 200, response.text
            said_in, said_out = usage_said(path, body, response)
            assert said_out == 8  # every attempt's tokens: the answer the client got, whole
            expected["input"] += said_in
            expected["output"] += said_out
    served = [
        r for r in backends["a"].requests() if r["path"] in ("/v1/chat/completions", "/v1/messages")
    ]
    assert len(served) >= 4  # each stream was continued by a second attempt
    counted = tokens(gateway)
    assert counted["input"] - before["input"] == expected["input"]
    assert counted["output"] - before["output"] == expected["output"]
    assert counted["streams"] == before["streams"]  # not timed per token: two instances' pace
    assert receiver.wait_for(
        lambda spans: sum(1 for s in spans if s.attributes.get("gateway.resumes")) == 2,
        timeout_s=10,
    )
    for span in (s for s in receiver.spans if s.attributes.get("gateway.resumes")):
        assert span.attributes["gen_ai.usage.output_tokens"] == 8
