"""The fake backend's Anthropic Messages API, driven by the official `anthropic` SDK (and raw
HTTP where the exact bytes matter) against a real fake server process."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from loadtests.fake_vllm.responses import OOM_MESSAGE, text
from loadtests.procs import ManagedProcess, python_module

MODELS = ("m1", "m2")
USER = [{"role": "user", "content": "say something nice"}]


def start_fake(*extra: str) -> ManagedProcess:
    args = ["--port", "0", "--name", "a", "--models", ",".join(MODELS), "--seed", "1"]
    args += ["--ttft", "0.01", "--per-token", "0.001", *extra]
    return ManagedProcess(python_module("loadtests.fake_vllm", *args))


@pytest.fixture(scope="module")
def fake() -> Iterator[ManagedProcess]:
    proc = start_fake()
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture
def http(fake: ManagedProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{fake.port()}", timeout=5.0) as c:
        c.post("/_fake/reset").raise_for_status()
        yield c


@pytest.fixture
def sdk(fake: ManagedProcess, http: httpx.Client) -> Iterator[anthropic.Anthropic]:
    url = f"http://127.0.0.1:{fake.port()}"
    with anthropic.Anthropic(base_url=url, api_key="test", max_retries=0, timeout=5.0) as c:
        yield c


def set_faults(http: httpx.Client, **faults: Any) -> None:
    http.post("/_fake/faults", json=faults).raise_for_status()


def ended_log(http: httpx.Client, count: int, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """The request log once `count` requests have ended (the fake wakes us; no polling)."""
    log: list[dict[str, Any]] = http.get(
        "/_fake/requests", params={"wait_for": count, "timeout": timeout_s}
    ).json()
    assert sum(r["ended"] is not None for r in log) >= count, log
    return log


def body(max_tokens: int | None = 5, stream: bool = False, **extra: Any) -> dict[str, Any]:
    request: dict[str, Any] = {"model": "m1", "messages": USER, "stream": stream, **extra}
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    return request


def sse(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event, checking each is `event: X\\ndata: JSON\\n\\n`."""
    buffer = b""
    for chunk in response.iter_raw():
        buffer += chunk
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            name_line, data_line = raw.decode().split("\n")
            assert name_line.startswith("event: ") and data_line.startswith("data: "), raw
            name, data = name_line[len("event: ") :], json.loads(data_line[len("data: ") :])
            assert data["type"] == name, raw
            yield name, data
    assert buffer == b""


def test_non_streamed_message_has_text_and_usage(sdk: anthropic.Anthropic) -> None:
    message = sdk.messages.create(model="m1", max_tokens=5, messages=USER, system="be brief please")
    assert message.id.startswith("msg_")
    assert (message.type, message.role, message.model) == ("message", "assistant", "m1")
    [block] = message.content
    assert block.type == "text" and block.text == "the model says hello to"
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    # 3 prompt words + 3 system words
    assert (message.usage.input_tokens, message.usage.output_tokens) == (6, 5)

    blocks = [{"type": "text", "text": "one two"}, {"type": "text", "text": "three"}]
    message = sdk.messages.create(
        model="m2", max_tokens=2, messages=[{"role": "user", "content": blocks}]
    )
    assert message.model == "m2" and message.usage.input_tokens == 3
    assert message.content[0].type == "text" and message.content[0].text == "the model"


def test_latency_is_ttft_plus_tokens(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    set_faults(http, ttft=0.05, per_token=0.01)
    started = time.monotonic()
    sdk.messages.create(model="m1", max_tokens=10, messages=USER)
    assert time.monotonic() - started >= 0.05 + 10 * 0.01 - 0.005


def test_stream_event_sequence(http: httpx.Client) -> None:
    set_faults(http, tokens_per_event=2, per_token=0)
    with http.stream("POST", "/v1/messages", json=body(5, True)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["request-id"].startswith("req_")
        events = list(sse(response))
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == []
    assert (start["role"], start["model"], start["stop_reason"]) == ("assistant", "m1", None)
    assert start["usage"] == {"input_tokens": 3, "output_tokens": 1}
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [data for name, data in events if name == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert [d["delta"]["text"] for d in deltas] == ["the model", " says hello", " to"]
    assert events[6][1] == {"type": "content_block_stop", "index": 0}
    assert events[7][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"output_tokens": 5},
    }
    [record] = ended_log(http, 1)
    assert (record["path"], record["stream"], record["max_tokens"]) == ("/v1/messages", True, 5)
    assert (record["outcome"], record["fault"]) == ("ok", None)


def test_sdk_streams(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    set_faults(http, per_token=0.01)
    with sdk.messages.stream(model="m1", max_tokens=8, messages=USER) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) == 8
    assert "".join(pieces) == "the model says hello to a fast gateway"
    assert final.content[0].type == "text" and final.content[0].text == "".join(pieces)
    assert final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (3, 8)

    events = sdk.messages.create(model="m2", max_tokens=2, messages=USER, stream=True)
    types = [event.type for event in events]  # the SDK drops pings
    assert types == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_rate_limit_is_429_with_retry_after(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    set_faults(http, rate_limit_rate=1, retry_after=7)
    with pytest.raises(anthropic.RateLimitError) as caught:
        sdk.messages.create(model="m1", max_tokens=5, messages=USER)
    assert caught.value.status_code == 429
    assert caught.value.response.headers["retry-after"] == "7"
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "rate limit exceeded"},
    }
    [record] = ended_log(http, 1)
    assert (record["outcome"], record["fault"]) == ("rate_limited", "rate_limit")


def test_overloaded_is_529(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    set_faults(http, overloaded_rate=1)
    with pytest.raises(anthropic.InternalServerError) as caught:
        sdk.messages.create(model="m1", max_tokens=5, messages=USER)
    assert caught.value.status_code == 529
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    with pytest.raises(anthropic.APIStatusError) as streamed:
        sdk.messages.create(model="m1", max_tokens=5, messages=USER, stream=True)
    assert streamed.value.status_code == 529
    # An Anthropic-only fault: the OpenAI routes are not overloaded.
    chat = {"model": "m1", "messages": USER, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    log = ended_log(http, 3)
    assert [(r["fault"], r["outcome"]) for r in log] == [
        ("overloaded", "overloaded"),
        ("overloaded", "overloaded"),
        (None, "ok"),
    ]


def test_error_and_oom_faults_are_api_errors(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    set_faults(http, error_rate=1)
    with pytest.raises(anthropic.InternalServerError) as caught:
        sdk.messages.create(model="m1", max_tokens=5, messages=USER)
    assert caught.value.status_code == 500
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "injected error"},
    }
    set_faults(http, error_status=503)
    with pytest.raises(anthropic.APIStatusError) as unavailable:
        sdk.messages.create(model="m1", max_tokens=5, messages=USER)
    assert unavailable.value.status_code == 503

    set_faults(http, error_rate=0, oom_rate=1)
    counts = []
    for _ in range(2):
        response = http.post("/v1/messages", json=body())
        assert response.status_code == 500
        assert response.json()["error"] == {"type": "api_error", "message": OOM_MESSAGE}
        counts.append(response.headers["x-oom-count"])
    assert counts == ["1", "2"]
    outcomes = [(r["fault"], r["outcome"]) for r in ended_log(http, 4)]
    assert outcomes == [("error", "error")] * 2 + [("oom", "oom")] * 2


def test_stream_error_event_mid_stream(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    set_faults(http, stream_error_rate=1, stall_after=2, per_token=0)
    with http.stream("POST", "/v1/messages", json=body(10, True)) as response:
        assert response.status_code == 200
        events = list(sse(response))  # the stream ends cleanly after the error event
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "error",
    ]
    assert events[-1][1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }

    received: list[str] = []
    stream = sdk.messages.create(model="m1", max_tokens=10, messages=USER, stream=True)
    with pytest.raises(anthropic.APIStatusError) as caught:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                received.append(event.delta.text)
    assert received == ["the", " model"]
    assert caught.value.body == events[-1][1]
    log = ended_log(http, 2)
    assert [(r["fault"], r["outcome"]) for r in log] == [("stream_error", "stream_error")] * 2

    # Only streams can fail mid-stream: a plain request is unaffected.
    assert sdk.messages.create(model="m1", max_tokens=3, messages=USER).usage.output_tokens == 3


def test_die_cuts_the_stream(http: httpx.Client) -> None:
    set_faults(http, die_rate=1, die_after=2, per_token=0)
    names: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        http.stream("POST", "/v1/messages", json=body(10, True)) as response,
    ):
        assert response.status_code == 200
        names.extend(name for name, _ in sse(response))
    assert names.count("content_block_delta") == 2 and "message_stop" not in names
    with pytest.raises(httpx.RemoteProtocolError):
        http.post("/v1/messages", json=body(10))
    assert {r["outcome"] for r in ended_log(http, 2)} == {"died"}


def test_stall_and_hang(http: httpx.Client) -> None:
    set_faults(http, stall_rate=1, stall_after=1, per_token=0)
    names: list[str] = []
    timeout = httpx.Timeout(5.0, read=0.3)
    with (
        pytest.raises(httpx.ReadTimeout),
        http.stream("POST", "/v1/messages", json=body(10, True), timeout=timeout) as response,
    ):
        names.extend(name for name, _ in sse(response))
    assert names == ["message_start", "content_block_start", "ping", "content_block_delta"]
    assert [(r["fault"], r["outcome"]) for r in ended_log(http, 1)] == [("stall", "cancelled")]

    set_faults(http, stall_rate=0, hang_rate=1, hang_s=0.1)
    response = http.post("/v1/messages", json=body())
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout_error"
    assert ended_log(http, 2)[1]["outcome"] == "hung"


def test_bad_requests_are_invalid_request_errors(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.post("/v1/messages", cast_to=object, body=body(max_tokens=None))
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    for bad in (
        body(max_tokens=0),
        body(stream="yes"),
        {**body(), "messages": []},
        {**body(), "messages": [{"role": "system", "content": "x"}]},
        {**body(), "messages": [{"role": "user", "content": [{"text": "x"}]}]},
        {**body(), "system": 3},
        {"max_tokens": 5, "messages": USER},
    ):
        response = http.post("/v1/messages", json=bad)
        assert response.status_code == 400, bad
        assert response.json()["error"]["type"] == "invalid_request_error", bad
    assert http.post("/v1/messages", content=b"{not json").status_code == 400
    with pytest.raises(anthropic.NotFoundError) as unknown:
        sdk.messages.create(model="nope", max_tokens=5, messages=USER)
    assert unknown.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model: nope"},
    }
    assert {r["outcome"] for r in ended_log(http, 10)} == {"error"}


def test_faults_endpoint_validates_new_rates(http: httpx.Client) -> None:
    set_faults(http, overloaded_rate=0.5, stream_error_rate=0.25)
    faults = http.get("/_fake/faults").json()
    assert (faults["overloaded_rate"], faults["stream_error_rate"]) == (0.5, 0.25)
    for key in ("overloaded_rate", "stream_error_rate"):
        for bad in (2, -0.1, True, "x"):
            assert http.post("/_fake/faults", json={key: bad}).status_code == 400


def sent_key(record: dict[str, Any], key: str) -> bool:
    """Whether the SDK's request carried `key`: older SDKs send `x-api-key`, newer ones (2.x)
    `authorization: Bearer`."""
    digest = hashlib.sha256
    return (
        record["api_key_sha256"] == digest(key.encode()).hexdigest()[:12]
        or record["authorization_sha256"] == digest(f"Bearer {key}".encode()).hexdigest()[:12]
    )


def test_request_log_hides_credentials_by_default(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    sdk.messages.create(model="m1", max_tokens=5, messages=USER)
    http.post("/v1/messages", json=body(), headers={"x-api-key": "secret-key"})
    http.post("/v1/messages", json=body(), headers={"authorization": "Bearer secret-token"})
    by_sdk, keyed, bearer = ended_log(http, 3)
    assert sent_key(by_sdk, "test")
    assert by_sdk["anthropic_version_present"] is True
    assert by_sdk["anthropic_version"] == by_sdk["headers"]["anthropic-version"]
    assert keyed["api_key_present"] is True and keyed["authorization_present"] is False
    assert keyed["api_key_sha256"] == hashlib.sha256(b"secret-key").hexdigest()[:12]
    assert keyed["authorization_sha256"] is None
    assert keyed["headers"]["x-api-key"] == "[redacted]"
    assert keyed["anthropic_version_present"] is False and keyed["anthropic_version"] is None
    assert bearer["api_key_present"] is False and bearer["api_key_sha256"] is None
    assert bearer["authorization_present"] is True
    assert bearer["headers"]["authorization"] == "[redacted]"
    log = [by_sdk, keyed, bearer]
    assert all("credentials" not in record for record in log)
    assert "secret" not in json.dumps(log) and "Bearer test" not in json.dumps(log)


def test_record_credentials_logs_exact_values() -> None:
    proc = start_fake("--record-credentials")
    try:
        url = f"http://127.0.0.1:{proc.port()}"
        with anthropic.Anthropic(base_url=url, api_key="client-key", max_retries=0) as sdk:
            sdk.messages.create(model="m1", max_tokens=2, messages=USER)
        headers = {"x-api-key": "k2", "authorization": "Bearer t2"}
        assert httpx.post(f"{url}/v1/messages", json=body(), headers=headers).status_code == 200
        log = httpx.get(f"{url}/_fake/requests", params={"wait_for": 2, "timeout": 5}).json()
        assert log[0]["credentials"] in (
            {"x-api-key": "client-key", "authorization": None},
            {"x-api-key": None, "authorization": "Bearer client-key"},
        )
        assert log[1]["credentials"] == {"x-api-key": "k2", "authorization": "Bearer t2"}
        assert log[1]["headers"]["x-api-key"] == log[1]["headers"]["authorization"] == "[redacted]"
    finally:
        assert proc.stop() == 0, proc.output()


def test_engine_kv_need_counts_prompt_and_max_tokens() -> None:
    # One place and a 20-token cache: 3 prompt words + 17 fits, + 18 does not.
    proc = start_fake("--max-running", "1", "--kv-tokens", "20")
    try:
        url = f"http://127.0.0.1:{proc.port()}"
        with anthropic.Anthropic(base_url=url, api_key="test", max_retries=0) as sdk:
            assert sdk.messages.create(model="m1", max_tokens=17, messages=USER).usage
            with pytest.raises(anthropic.InternalServerError) as caught:
                sdk.messages.create(model="m1", max_tokens=18, messages=USER)
        assert caught.value.status_code == 500
        assert caught.value.response.headers["x-oom-count"] == "1"
        log = httpx.get(f"{url}/_fake/requests", params={"wait_for": 2, "timeout": 5}).json()
        assert [(r["fault"], r["outcome"]) for r in log] == [(None, "ok"), ("oom", "oom")]
        assert httpx.get(f"{url}/_fake/engine").json()["ooms"] == 1
    finally:
        assert proc.stop() == 0, proc.output()


# --- prefill, as the API does it --------------------------------------------------------------


def test_a_prefill_is_continued_and_one_ending_in_whitespace_refused(
    sdk: anthropic.Anthropic,
) -> None:

    prefill = [*USER, {"role": "assistant", "content": text(4)}]
    message = sdk.messages.create(model="m1", max_tokens=5, messages=prefill)
    assert text(4) + message.content[0].text == text(9)  # type: ignore[union-attr]
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        sdk.messages.create(
            model="m1", max_tokens=5, messages=[*USER, {"role": "assistant", "content": "Hi "}]
        )


def test_an_echoing_engine_streams_the_prefill_again() -> None:

    proc = start_fake("--echo-prefill")
    try:
        url = f"http://127.0.0.1:{proc.port()}"
        prefill = [*USER, {"role": "assistant", "content": text(3)}]
        with httpx.Client(base_url=url, timeout=5) as http:
            request = {"model": "m1", "max_tokens": 4, "messages": prefill, "stream": True}
            with http.stream("POST", "/v1/messages", json=request) as response:
                events = list(sse(response))
    finally:
        assert proc.stop() == 0
    deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    # llama.cpp's server: the prefill again, then the continuation.
    assert "".join(deltas) == text(3) + text(7)[len(text(3)) :]
