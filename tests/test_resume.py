"""Streams that break after their first byte are continued on another attempt: the client sees
one whole stream (every token once, in order, one id, one ending, no error event, usage equal
to what it received), through the official SDKs and raw SSE, on both protocols.

The fake backends continue a final assistant message, a prompt or a prefill exactly where its
text ends (their words follow a fixed sequence: `responses.text`), so a stream cut after k
tokens and continued elsewhere must read as `text(n)`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.ingress.resume import RESUME_PAUSE_S
from loadtests.fake_vllm.requestlog import IN_PROGRESS
from loadtests.fake_vllm.responses import text
from tests.support import (
    LOOPBACK_LISTENERS,
    Backend,
    Gateway,
    post_in_parallel,
    start_backend,
    start_gateway,
)

FAST = ("--ttft", "0.005", "--per-token", "0.002")
MESSAGES = [{"role": "user", "content": "tell me about streams"}]
PROMPT_WORDS = 4  # the fake counts words: "tell me about streams"


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    started: dict[str, Backend] = {}
    try:
        for name in ("a", "b", "solo"):
            started[name] = start_backend(
                name, ["m", "mv", "t", "f"] if name != "solo" else ["s"], *FAST
            )
        for name in ("ea", "eb"):
            started[name] = start_backend(name, ["e"], *FAST, "--echo-prefill")
        started["off"] = start_backend("off", ["o"], *FAST)
        yield started
    finally:
        for backend in started.values():
            backend.stop()


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    def url(name: str) -> str:
        return backends[name].url

    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  pair:
    models: [m]
    instances: [{{name: a, url: "{url("a")}"}}, {{name: b, url: "{url("b")}"}}]
    retries: {{budget: {{ratio: 1.0, min_per_second: 100}}}}
  solo:
    models: [s]
    instances: [{{name: solo, url: "{url("solo")}"}}]
    retries: {{budget: {{ratio: 1.0, min_per_second: 100}}}}
  echo:
    models: [e]
    instances: [{{name: ea, url: "{url("ea")}"}}, {{name: eb, url: "{url("eb")}"}}]
    retries: {{budget: {{ratio: 1.0, min_per_second: 100}}}}
  moving:
    models: [mv]
    instances: [{{name: ma, url: "{url("a")}"}}, {{name: mb, url: "{url("b")}"}}]
    timeouts: {{min_samples: 3}}
    hedging: false
  tiny:
    models: [t]
    instances: [{{name: ta, url: "{url("a")}"}}, {{name: tb, url: "{url("b")}"}}]
    retries: {{budget: {{ratio: 1.0, min_per_second: 100}}}}
    resume: {{max_text: 64}}
  brittle:
    models: [f]
    instances: [{{name: fa, url: "{url("a")}"}}, {{name: fb, url: "{url("b")}"}}]
    breaker: {{consecutive_failures: 1}}
    hedging: false
  noresume:
    models: [o]
    instances: [{{name: quiet, url: "{url("off")}"}}]
    resume: false
"""
    gw = start_gateway(tmp_path_factory.mktemp("resume") / "policy.yaml", policy)
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def clean(backends: dict[str, Backend]) -> None:
    for backend in backends.values():
        backend.reset()


@pytest.fixture
def sdk(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key="k", max_retries=0, timeout=30
    ) as client:
        yield client


@pytest.fixture
def claude(gateway: Gateway) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=gateway.url, api_key="k", max_retries=0, timeout=30
    ) as client:
        yield client


def cut(backends: dict[str, Backend], names: tuple[str, ...], after: int, count: int = 1) -> None:
    """The next `count` streams of each named backend die after `after` tokens."""
    for name in names:
        backends[name].set_faults(die_next=count, die_after=after)


def sse_events(response: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name, data) of every event of a raw SSE response."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        events.append((name, "\n".join(data)))
    return events


def raw_stream(
    gateway: Gateway, path: str, body: dict[str, Any]
) -> tuple[httpx.Headers, list[tuple[str | None, str]]]:
    """A streamed request as raw SSE: the response's headers and its events."""
    with (
        httpx.Client(base_url=gateway.url, timeout=30) as http,
        http.stream("POST", path, json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200
        return response.headers, sse_events(response)


def streamed_chat(sdk: openai.OpenAI, model: str, max_tokens: int) -> str:
    """A chat completion streamed through the SDK: its text."""
    stream = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def outcomes(backend: Backend) -> list[tuple[str | None, str]]:
    return [(r["fault"], r["outcome"]) for r in backend.requests()]


def admin_state(gateway: Gateway) -> dict[str, Any]:
    response = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5)
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


# --- OpenAI chat ---------------------------------------------------------------------------


@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
def test_a_chat_stream_cut_twice_arrives_whole_through_the_sdk(
    sdk: openai.OpenAI, backends: dict[str, Backend], usage: bool
) -> None:
    # Each instance cuts its next stream after 5 tokens: the first attempt breaks, its
    # continuation (on the other instance) breaks too, and the second continuation completes.
    cut(backends, ("a", "b"), after=5)
    options: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    stream = sdk.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=20, stream=True, **options
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text(20)
    assert len({c.id for c in chunks}) == 1
    assert len({c.created for c in chunks}) == 1
    assert [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role] == [
        "assistant"
    ]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [r for r in reasons if r] == ["length"]
    usages = [c.usage for c in chunks if c.usage is not None]
    if usage:
        (only,) = usages
        assert only.completion_tokens == 20
        assert only.prompt_tokens == PROMPT_WORDS
        assert only.total_tokens == 20 + PROMPT_WORDS
    else:
        assert usages == []
    died = outcomes(backends["a"]) + outcomes(backends["b"])
    assert sorted(died, key=str) == [("die", "died"), ("die", "died"), (None, "ok")]


def test_a_chat_stream_in_a_pool_of_one_is_continued_on_the_same_instance(
    sdk: openai.OpenAI, backends: dict[str, Backend]
) -> None:
    cut(backends, ("solo",), after=3)
    assert streamed_chat(sdk, "s", 12) == text(12)
    assert outcomes(backends["solo"]) == [("die", "died"), (None, "ok")]


def test_raw_chat_stream_has_one_ending_and_no_error_event(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    cut(backends, ("solo",), after=4)
    body = {"model": "s", "messages": MESSAGES, "max_tokens": 10, "stream": True}
    headers, events = raw_stream(gateway, "/v1/chat/completions", body)
    assert headers["x-gateway-attempts"] == "1"  # sent before the resume
    data = [d for _, d in events]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    chunks = [json.loads(d) for d in data[:-1]]
    assert not any("error" in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text(10)
    assert {c["model"] for c in chunks} == {"s"}


def test_an_engine_error_event_mid_stream_is_continued(
    sdk: openai.OpenAI, backends: dict[str, Backend]
) -> None:
    # vLLM reports a failed generation with `data: {"error": ...}` then `[DONE]`.
    backends["solo"].set_faults(error_next=1, stall_after=4)
    assert streamed_chat(sdk, "s", 16) == text(16)
    assert outcomes(backends["solo"]) == [("stream_error", "stream_error"), (None, "ok")]


def test_a_continuation_refused_everywhere_is_tried_again_after_a_pause(
    sdk: openai.OpenAI, backends: dict[str, Backend]
) -> None:
    """A lone instance cuts a stream, then refuses what comes next (as while it restarts):
    every attempt of the first continuation gets a 503. The next continuation waits before it
    goes, rather than spend the stream's last resumes on the same refusals at once."""
    solo = backends["solo"]
    solo.set_faults(die_next=1, die_after=4, refuse_next=4, error_status=503)
    assert streamed_chat(sdk, "s", 16) == text(16)
    records = solo.requests()
    assert [(r["fault"], r["outcome"]) for r in records] == [
        ("die", "died"),
        *[("error", "error")] * 4,  # the first continuation and its retries
        (None, "ok"),
    ]
    waited = records[-1]["started"] - records[-2]["ended"]
    assert waited >= RESUME_PAUSE_S / 2, waited


def test_an_engine_error_event_not_continued_reaches_the_client_as_it_came(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    # Every stream fails: the resumes allowed (3) fail too, and the last error event is
    # relayed as the engine sent it, with its [DONE].
    backends["solo"].set_faults(stream_error_rate=1.0, stall_after=2)
    body = {"model": "s", "messages": MESSAGES, "max_tokens": 10, "stream": True}
    _, events = raw_stream(gateway, "/v1/chat/completions", body)
    data = [d for _, d in events]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    assert json.loads(data[-2])["error"]["message"] == "engine error mid-stream"
    contents = [json.loads(d)["choices"][0]["delta"].get("content", "") for d in data[:-2]]
    assert "".join(contents) == text(8)  # four attempts of two tokens each, once each
    assert len(outcomes(backends["solo"])) == 4


# --- OpenAI completions ----------------------------------------------------------------------


@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
def test_a_completions_stream_is_continued_from_prompt_and_text(
    sdk: openai.OpenAI, backends: dict[str, Backend], usage: bool
) -> None:
    cut(backends, ("solo",), after=6)
    options: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    stream = sdk.completions.create(
        model="s", prompt="once upon a time ", max_tokens=15, stream=True, **options
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text(15)
    assert len({c.id for c in chunks}) == 1
    usages = [c.usage for c in chunks if c.usage is not None]
    if usage:
        (only,) = usages
        assert (only.prompt_tokens, only.completion_tokens) == (4, 15)
    else:
        assert usages == []


# --- Anthropic Messages ------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["m", "e"], ids=["continues", "echoes-prefill"])
def test_a_messages_stream_cut_twice_arrives_as_one_message(
    claude: anthropic.Anthropic, backends: dict[str, Backend], pool: str
) -> None:
    names = ("a", "b") if pool == "m" else ("ea", "eb")
    cut(backends, names, after=5)
    with claude.messages.stream(model=pool, max_tokens=18, messages=MESSAGES) as stream:
        events = list(stream)
        message = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds.count("message_start") == 1
    assert kinds.count("message_stop") == 1
    assert kinds.count("content_block_start") == 1
    assert {e.index for e in events if e.type == "content_block_delta"} == {0}
    assert message.content[0].type == "text"
    assert message.content[0].text == text(18)
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 18
    assert message.usage.input_tokens == PROMPT_WORDS


def test_a_messages_stream_error_event_is_continued(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    backends["solo"].set_faults(error_next=1, stall_after=3)
    body = {"model": "s", "messages": MESSAGES, "max_tokens": 9, "stream": True}
    _, events = raw_stream(gateway, "/v1/messages", body)
    names = [n for n, _ in events]
    assert "error" not in names
    assert names.count("message_start") == 1 and names[-1] == "message_stop"
    deltas = [json.loads(d)["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert "".join(deltas) == text(9)
    (delta,) = [json.loads(d) for n, d in events if n == "message_delta"]
    assert delta["usage"]["output_tokens"] == 9


# --- what is not resumed ends as before ------------------------------------------------------


def test_a_stream_with_two_choices_is_not_continued(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    cut(backends, ("solo",), after=3)
    body = {"model": "s", "messages": MESSAGES, "max_tokens": 10, "stream": True, "n": 2}
    _, events = raw_stream(gateway, "/v1/chat/completions", body)
    data = [d for _, d in events]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "upstream_reset"
    assert outcomes(backends["solo"]) == [("die", "died")]


def test_a_pool_with_resume_off_ends_a_broken_stream_with_an_error_event(
    sdk: openai.OpenAI, backends: dict[str, Backend]
) -> None:
    cut(backends, ("off",), after=3)
    stream = sdk.chat.completions.create(model="o", messages=MESSAGES, max_tokens=10, stream=True)
    with pytest.raises(openai.APIError, match="upstream"):
        for _ in stream:
            pass
    assert outcomes(backends["off"]) == [("die", "died")]


def test_resumes_are_counted_per_instance_and_reason(
    sdk: openai.OpenAI, gateway: Gateway, backends: dict[str, Backend]
) -> None:
    cut(backends, ("solo",), after=2)
    stream = sdk.chat.completions.create(model="s", messages=MESSAGES, max_tokens=6, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text(6)
    metrics = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
    line = 'gateway_stream_resumes_total{backend="solo",pool="solo",reason="reset"}'
    assert any(row.startswith(line) for row in metrics.splitlines()), metrics


def test_a_stream_on_an_instance_being_isolated_moves_to_another(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    # A slow, healthy stream; its instance is isolated by the operator meanwhile: the stream
    # moves to the other instance at the next event and arrives whole.
    for name in ("a", "b"):
        backends[name].set_faults(per_token=0.02)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 40, "stream": True}
    pieces: list[str] = []
    try:
        with (
            httpx.Client(base_url=gateway.url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            first = response.headers["x-gateway-instance"]
            other = "b" if first == "a" else "a"
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                pieces.append(chunk["choices"][0]["delta"].get("content") or "")
                if len(pieces) == 5:
                    isolate = f"{gateway.admin_url}/admin/instances/pair/{first}/isolate"
                    httpx.post(isolate, timeout=5).raise_for_status()
        assert "".join(pieces) == text(40)
        # The first instance's stream was closed: it saw its request cancelled, and the other
        # one generated the rest.
        (moved,) = backends[first].requests(wait_for=1)
        assert moved["outcome"] == "cancelled"
        (rest,) = backends[other].requests(wait_for=1)
        assert rest["outcome"] == "ok" and rest["max_tokens"] < 40
        metrics = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
        line = f'gateway_stream_resumes_total{{backend="{first}",pool="pair",reason="isolated"}}'
        assert any(row.startswith(line) for row in metrics.splitlines()), metrics
    finally:
        httpx.post(f"{gateway.admin_url}/admin/instances/pair/a/restore", timeout=5)
        httpx.post(f"{gateway.admin_url}/admin/instances/pair/b/restore", timeout=5)


def test_a_flowing_stream_stays_when_its_instance_is_isolated_for_errors(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    # A slow, healthy stream on each instance; one of them then fails a new request, which
    # isolates it (one failure is enough in this pool). The stream it is still sending well
    # stays there: moving it would cost a new prefill elsewhere for nothing.
    for name in ("a", "b"):
        backends[name].set_faults(per_token=0.02)
    body = {"model": "f", "messages": MESSAGES, "max_tokens": 60, "stream": True}
    backend_of = {"fa": "a", "fb": "b"}
    state_url = f"{gateway.admin_url}/admin/state"

    def states() -> dict[str, str]:
        pools = httpx.get(state_url, timeout=5).json()["pools"]
        return {i["name"]: i["state"] for i in pools["brittle"]["instances"]}

    def read(response: httpx.Response) -> str:
        pieces = []
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                pieces.append(chunk["choices"][0]["delta"].get("content") or "")
        return "".join(pieces)

    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http, ExitStack() as open_streams:
            streams: list[httpx.Response] = []
            while len({r.headers["x-gateway-instance"] for r in streams}) < 2:
                assert len(streams) < 6, "the balancer never used the idle instance"
                request = http.stream("POST", "/v1/chat/completions", json=body)
                streams.append(open_streams.enter_context(request))
            faulty = streams[0].headers["x-gateway-instance"]
            backends[backend_of[faulty]].set_faults(error_rate=1.0, error_status=500)
            short = {"model": "f", "messages": MESSAGES, "max_tokens": 1}
            for _ in range(30):
                if states()[faulty] == "ISOLATED":
                    break
                assert http.post("/v1/chat/completions", json=short).status_code == 200
            assert states()[faulty] == "ISOLATED"
            assert [read(r) for r in streams] == [text(60)] * len(streams)
        sent = [
            r for r in backends[backend_of[faulty]].requests(wait_for=1) if r["max_tokens"] == 60
        ]
        assert sent and all(r["outcome"] == "ok" for r in sent), "a stream was moved or cut"
        metrics = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
        line = f'gateway_stream_resumes_total{{backend="{faulty}",pool="brittle"'
        assert not any(row.startswith(line) for row in metrics.splitlines())
    finally:
        for name in ("fa", "fb"):
            httpx.post(f"{gateway.admin_url}/admin/instances/brittle/{name}/restore", timeout=5)


def test_a_stream_in_a_pool_of_one_stays_when_its_instance_is_isolated(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    backends["solo"].set_faults(per_token=0.02)
    body = {"model": "s", "messages": MESSAGES, "max_tokens": 20, "stream": True}
    pieces: list[str] = []
    try:
        with (
            httpx.Client(base_url=gateway.url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
                    if len(pieces) == 3:
                        url = f"{gateway.admin_url}/admin/instances/solo/solo/isolate"
                        httpx.post(url, timeout=5)
        assert "".join(pieces) == text(20)
        assert outcomes(backends["solo"]) == [(None, "ok")]
    finally:
        httpx.post(f"{gateway.admin_url}/admin/instances/solo/solo/restore", timeout=5)


def test_a_stream_far_slower_than_the_pools_others_moves_to_a_healthier_instance(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    warm = {"model": "mv", "messages": MESSAGES, "max_tokens": 20, "stream": True}
    # Both instances learn their gaps (min_samples: 3).
    assert post_in_parallel(gateway.url, [warm] * 12) == [200] * 12
    admin = f"{gateway.admin_url}/admin/instances/moving"
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        # a turns 50x slower per token after its first byte: a gray failure mid-stream. The
        # stream starts on a (b held out by an operator meanwhile), which b is back to take.
        backends["a"].set_faults(per_token=0.1)
        httpx.post(f"{admin}/mb/isolate", timeout=5).raise_for_status()
        body = {**warm, "max_tokens": 80}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            instance = response.headers["x-gateway-instance"]
            httpx.post(f"{admin}/mb/restore", timeout=5).raise_for_status()
            data = [d for _, d in sse_events(response)]
        assert instance == "ma"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text(80)
    metrics = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
    line = 'gateway_stream_resumes_total{backend="ma",pool="moving",reason="slow"}'
    assert any(row.startswith(line) for row in metrics.splitlines()), metrics


# --- whole answers, fetched as streams -------------------------------------------------------


def stream_flags(*backends: Backend) -> list[bool]:
    return [r["stream"] for backend in backends for r in backend.requests()]


def test_a_whole_chat_answer_cut_twice_arrives_whole_through_the_sdk(
    sdk: openai.OpenAI, backends: dict[str, Backend]
) -> None:
    # A whole answer is fetched as a stream: each cut is continued like a stream's, and the
    # client gets one whole chat completion once the last attempt has finished.
    cut(backends, ("a", "b"), after=5)
    raw = sdk.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=20)
    assert raw.headers["content-type"] == "application/json"
    assert raw.headers["x-gateway-attempts"] == "3"  # the first, and the two continuations
    completion = raw.parse()
    assert completion.object == "chat.completion"
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == text(20)
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        PROMPT_WORDS,
        20,
    )
    died = outcomes(backends["a"]) + outcomes(backends["b"])
    assert sorted(died, key=str) == [("die", "died"), ("die", "died"), (None, "ok")]
    assert stream_flags(backends["a"], backends["b"]) == [True, True, True]


def test_a_whole_answer_nothing_broke_is_the_engines_own(
    sdk: openai.OpenAI, backends: dict[str, Backend]
) -> None:
    """Assembled from the stream, it reads as the engine's whole answer does (the fields a
    client reads; an engine's extras that a stream does not carry, such as vLLM's
    `prompt_logprobs: null`, are not made up)."""
    assembled = sdk.chat.completions.create(model="s", messages=MESSAGES, max_tokens=12)
    with openai.OpenAI(
        base_url=f"{backends['solo'].url}/v1", api_key="k", max_retries=0, timeout=30
    ) as direct:
        own = direct.chat.completions.create(model="s", messages=MESSAGES, max_tokens=12)

    def read(completion: Any) -> tuple[Any, ...]:
        (choice,) = completion.choices
        message = choice.message
        return (
            completion.object,
            completion.model,
            completion.system_fingerprint,
            completion.usage,
            (choice.index, choice.finish_reason, choice.logprobs),
            (message.role, message.content, message.refusal, message.tool_calls or []),
        )

    assert read(assembled) == read(own)
    assert assembled.id.startswith("chatcmpl-")


def test_a_whole_completion_cut_is_continued(
    sdk: openai.OpenAI, backends: dict[str, Backend]
) -> None:
    cut(backends, ("solo",), after=6)
    completion = sdk.completions.create(model="s", prompt="once upon a time ", max_tokens=15)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == text(15)
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (4, 15)
    assert outcomes(backends["solo"]) == [("die", "died"), (None, "ok")]


@pytest.mark.parametrize("pool", ["m", "e"], ids=["continues", "echoes-prefill"])
def test_a_whole_message_cut_twice_arrives_as_one_message(
    claude: anthropic.Anthropic, backends: dict[str, Backend], pool: str
) -> None:
    names = ("a", "b") if pool == "m" else ("ea", "eb")
    cut(backends, names, after=5)
    message = claude.messages.create(model=pool, max_tokens=18, messages=MESSAGES)
    assert message.type == "message" and message.role == "assistant"
    (block,) = message.content
    assert block.type == "text" and block.text == text(18)
    assert message.stop_reason == "max_tokens"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (PROMPT_WORDS, 18)
    assert stream_flags(*(backends[n] for n in names)) == [True, True, True]


def test_a_whole_answer_that_cannot_be_resumed_gets_the_engines_error(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    # Every stream fails with the engine's error event: the resumes allowed fail too, and the
    # client gets that error as a whole answer, with its status.
    backends["solo"].set_faults(stream_error_rate=1.0, stall_after=2)
    body = {"model": "s", "messages": MESSAGES, "max_tokens": 10}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "engine error mid-stream"
    assert response.headers["x-gateway-attempts"] == "4"  # the first and three continuations
    assert "x-gateway-error" not in response.headers  # the engine's error, not the gateway's
    assert len(outcomes(backends["solo"])) == 4


def test_a_whole_answer_cut_with_no_resume_left_gets_the_gateways_error(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    cut(backends, ("solo",), after=2, count=4)  # the first attempt and three continuations
    body = {"model": "s", "messages": MESSAGES, "max_tokens": 10}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 502
    assert response.headers["x-gateway-error"] == "upstream_reset"
    assert response.json()["error"]["code"] == "upstream_reset"
    assert outcomes(backends["solo"]) == [("die", "died")] * 4


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 2},
        {"logprobs": True},
        {"stream_options": {"include_usage": True}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"response_format": {"type": "json_object"}},
    ],
    ids=["n", "logprobs", "stream-options", "tools", "structured"],
)
def test_a_whole_answer_a_continuation_could_not_serve_is_sent_as_it_came(
    gateway: Gateway, backends: dict[str, Backend], extra: dict[str, Any]
) -> None:
    body = {"model": "s", "messages": MESSAGES, "max_tokens": 4, **extra}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
    assert stream_flags(backends["solo"]) == [False]
    assert response.headers["content-type"] == "application/json"


def test_a_pool_with_resume_off_sends_whole_answers_as_they_came(
    sdk: openai.OpenAI, backends: dict[str, Backend]
) -> None:
    completion = sdk.chat.completions.create(model="o", messages=MESSAGES, max_tokens=4)
    assert completion.choices[0].message.content == text(4)
    assert stream_flags(backends["off"]) == [False]


def test_a_whole_answer_on_an_instance_being_isolated_finishes_there(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    """Unlike a stream, a whole answer is not moved off a healthy-looking attempt: its client
    sees nothing until the end, and moving it would throw away the generation so far."""
    for name in ("a", "b"):
        backends[name].set_faults(per_token=0.02)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 40}
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                httpx.post, f"{gateway.url}/v1/chat/completions", json=body, timeout=30
            )
            serving = wait_for_request(backends, ("a", "b"))
            isolate = f"{gateway.admin_url}/admin/instances/pair/{serving}/isolate"
            httpx.post(isolate, timeout=5).raise_for_status()
            response = answer.result(timeout=30)
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["content"] == text(40)
        assert outcomes(backends[serving]) == [(None, "ok")]
        other = "b" if serving == "a" else "a"
        assert outcomes(backends[other]) == []
    finally:
        httpx.post(f"{gateway.admin_url}/admin/instances/pair/a/restore", timeout=5)
        httpx.post(f"{gateway.admin_url}/admin/instances/pair/b/restore", timeout=5)


def wait_for_request(backends: dict[str, Backend], names: tuple[str, ...]) -> str:
    """The backend among `names` that has a request in progress (bounded wait)."""
    for _ in range(500):
        for name in names:
            if any(r["outcome"] == IN_PROGRESS for r in backends[name].requests()):
                return name
        time.sleep(0.01)
    raise AssertionError("no request reached the backends")


def test_a_whole_answer_that_cannot_be_continued_starts_again(
    sdk: openai.OpenAI, backends: dict[str, Backend]
) -> None:
    """Its client has seen nothing yet: a whole answer whose text is past `resume.max_text`
    (or has a reasoning or tool call in progress) is asked again from nothing, where a
    stream would end with an error event."""
    cut(backends, ("a", "b"), after=20)  # ~100 bytes of text each time: past max_text 64
    raw = sdk.chat.completions.with_raw_response.create(model="t", messages=MESSAGES, max_tokens=30)
    assert raw.headers["x-gateway-attempts"] == "3"
    completion = raw.parse()
    assert completion.choices[0].message.content == text(30)
    assert completion.usage is not None and completion.usage.completion_tokens == 30
    records = backends["a"].requests() + backends["b"].requests()
    assert sorted(r["outcome"] for r in records) == ["died", "died", "ok"]
    assert [r["max_tokens"] for r in records] == [30, 30, 30]  # each from the start
    # A stream in the same pool, cut the same way, cannot be continued and ends as before.
    cut(backends, ("a", "b"), after=20)
    stream = sdk.chat.completions.create(model="t", messages=MESSAGES, max_tokens=30, stream=True)
    with pytest.raises(openai.APIError, match="upstream"):
        for _ in stream:
            pass


def test_a_stall_in_a_pool_with_nothing_learned_is_noticed_by_the_streams_own_pace(
    tmp_path: Path,
) -> None:
    """Nothing learned, so the idle timeout is the static `initial` (here 200 s). The stream
    showed its pace (a token every 20 ms) before it stalled: a gap far beyond that is a stall,
    noticed in seconds (never under 2 s), and the stream continues through a resume. Waiting
    for `initial` would outlast the client's 100 s timeout."""
    backend = start_backend("fresh", ["f"], "--ttft", "0.005", "--per-token", "0.02")
    gw: Gateway | None = None
    try:
        gw = start_gateway(
            tmp_path / "policy.yaml",
            f"""
{LOOPBACK_LISTENERS}
pools:
  fresh:
    models: [f]
    instances: [{{name: fresh, url: "{backend.url}"}}]
    timeouts: {{initial: 200s}}
""",
        )
        backend.set_faults(stall_rate=1.0, stall_after=12)
        with openai.OpenAI(
            base_url=f"{gw.url}/v1", api_key="k", max_retries=0, timeout=100
        ) as client:
            stream = client.chat.completions.create(
                model="f", messages=MESSAGES, max_tokens=40, stream=True
            )
            pieces: list[str] = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if not pieces:
                        backend.set_faults(stall_rate=0.0)  # this stream stalls; the next not
                    pieces.append(chunk.choices[0].delta.content)
        assert "".join(pieces) == text(40)
        assert outcomes(backend) == [("stall", "cancelled"), (None, "ok")]
        metrics = httpx.get(f"{gw.admin_url}/metrics", timeout=5).text
        resumed = 'gateway_stream_resumes_total{backend="fresh",pool="fresh",reason="idle_timeout"}'
        assert any(row.startswith(resumed) for row in metrics.splitlines()), metrics
    finally:
        if gw is not None:
            gw.stop()
        backend.stop()
