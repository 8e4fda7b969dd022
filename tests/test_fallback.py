"""Fallbacks across pools, through the official OpenAI and Anthropic SDKs: a model whose pool
cannot answer is answered by the next pool its policy names, before the first byte."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support import LOOPBACK_LISTENERS, Backend, Gateway, closed_port, start_backend
from tests.support import start_gateway as start

LONG = " ".join(["word"] * 80)  # over the small model's 60-token window with max_tokens 8
SHORT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    fast = ("--ttft", "0.01", "--per-token", "0.001")
    started = {
        "small": start_backend("small", ["small-model"], *fast, "--max-model-len", "60"),
        "backup": start_backend("backup", ["backup-model"], *fast),
        "big": start_backend("big", ["big-model", "iso-model"], *fast),
        "cross": start_backend("cross", ["claude-model", "gpt-model"], *fast),
    }
    yield started
    for backend in started.values():
        backend.stop()


def _policy(backends: dict[str, Backend]) -> str:
    return f"""
{LOOPBACK_LISTENERS}
telemetry: {{access_log: true}}
pools:
  down:
    models: [down-model]
    instances:
      - {{name: d1, url: "http://127.0.0.1:{closed_port()}"}}
      - {{name: d2, url: "http://127.0.0.1:{closed_port()}"}}
    fallbacks: [backup]
  small:
    models: [small-model]
    instances: [{{name: s1, url: "{backends["small"].url}"}}]
    fallbacks: [backup]
    context_fallbacks: [{{pool: big, model: big-model}}]
  backup:
    models: [backup-model]
    instances: [{{name: b1, url: "{backends["backup"].url}"}}]
  big:
    models: [big-model]
    instances: [{{name: g1, url: "{backends["big"].url}"}}]
  openai-down:
    models: [oa-model]
    api: openai
    instances: [{{name: o1, url: "http://127.0.0.1:{closed_port()}"}}]
    fallbacks: [claude]
  claude:
    models: [claude-model]
    api: anthropic
    instances: [{{name: c1, url: "{backends["cross"].url}"}}]
  anthropic-down:
    models: [an-model]
    api: anthropic
    instances: [{{name: a1, url: "http://127.0.0.1:{closed_port()}"}}]
    fallbacks: [gpt]
  gpt:
    models: [gpt-model]
    api: openai
    instances: [{{name: g1, url: "{backends["cross"].url}"}}]
  iso:
    models: [iso-model]
    instances: [{{name: i1, url: "{backends["big"].url}"}}]
    fallbacks: [backup]
"""


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    gw = start(tmp_path_factory.mktemp("fallback") / "policy.yaml", _policy(backends))
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def fresh(backends: dict[str, Backend]) -> None:
    for backend in backends.values():
        backend.reset()
        backend.set_faults()


def _openai(gateway: Gateway, **headers: str) -> openai.OpenAI:
    # No retries in the SDK: whatever is retried or handed over is the gateway's doing.
    return openai.OpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="k",
        max_retries=0,
        timeout=30,
        default_headers=headers or None,
    )


def _anthropic(gateway: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0, timeout=30)


def _metric(gateway: Gateway, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return 0.0


def _access_lines(gateway: Gateway, marker: str, count: int) -> list[str]:
    """The access-log lines holding `marker`, once `count` were written (each is written as
    its request ends, which may be just after its client read the answer)."""
    for _ in range(100):
        lines = [line for line in gateway.proc.lines if "gateway.access" in line]
        found = [line for line in lines if marker in line]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} access lines with {marker!r}")


def test_pool_all_down_is_answered_by_its_fallback_whole_and_streamed(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    sdk = _openai(gateway)
    before = _metric(
        gateway, "gateway_fallbacks_total", **{"from": "down", "to": "backup"}, reason="unavailable"
    )
    for _ in range(5):
        raw = sdk.chat.completions.with_raw_response.create(
            model="down-model",
            messages=SHORT,
            max_tokens=4,
        )
        completion = raw.parse()
        assert completion.model == "backup-model"  # the answering engine's
        assert completion.choices[0].message.content
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        assert raw.headers["x-gateway-pool"] == "backup"
        assert raw.headers["x-gateway-fallbacks"] == "1"
    with sdk.chat.completions.with_streaming_response.create(
        model="down-model",
        messages=SHORT,
        max_tokens=6,
        stream=True,
    ) as streamed:
        assert streamed.headers["x-gateway-pool"] == "backup"
        assert streamed.headers["x-gateway-fallbacks"] == "1"
        chunks = list(streamed.parse())
    assert {chunk.model for chunk in chunks} == {"backup-model"}
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 6
    sent = backends["backup"].requests()
    assert len(sent) == 6 and {r["model"] for r in sent} == {"backup-model"}
    after = _metric(
        gateway, "gateway_fallbacks_total", **{"from": "down", "to": "backup"}, reason="unavailable"
    )
    assert after - before == 6
    logged = _access_lines(gateway, "fallback=down>", 6)
    assert all("fallback=down>backup:unavailable" in line for line in logged[-6:]), logged[-1]
    assert all("model_sent=backup-model" in line for line in logged[-6:])
    assert all("pool=backup" in line for line in logged[-6:])


def test_anthropic_sdk_falls_back_too(gateway: Gateway) -> None:
    client = _anthropic(gateway)
    raw = client.messages.with_raw_response.create(
        model="down-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    )
    message = raw.parse()
    assert message.model == "backup-model"
    assert message.usage.output_tokens == 5
    assert raw.headers["x-gateway-pool"] == "backup"
    with client.messages.stream(
        model="down-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.model == "backup-model" and final.stop_reason == "max_tokens"


def test_a_client_can_turn_fallbacks_off(gateway: Gateway, backends: dict[str, Backend]) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        _openai(gateway, **{"x-gateway-fallback": "off"}).chat.completions.create(
            model="down-model",
            messages=SHORT,
            max_tokens=4,
        )
    assert caught.value.status_code in (502, 503)
    assert "x-gateway-pool" not in caught.value.response.headers  # not one to hand over
    assert backends["backup"].requests() == []
    with pytest.raises(openai.BadRequestError):
        _openai(gateway, **{"x-gateway-fallback": "maybe"}).chat.completions.create(
            model="down-model",
            messages=SHORT,
            max_tokens=4,
        )


def _long_chat(sdk: openai.OpenAI, **extra: Any) -> Any:
    return sdk.chat.completions.with_raw_response.create(
        model="small-model",
        messages=[{"role": "user", "content": LONG}],
        max_tokens=8,
        **extra,
    )


def test_context_length_goes_to_context_fallbacks_after_one_attempt(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    raw = _long_chat(_openai(gateway))
    assert raw.parse().model == "big-model"
    assert raw.headers["x-gateway-pool"] == "big"
    assert raw.headers["x-gateway-attempts"] == "2"  # one on the small model, one on the big
    (refused,) = backends["small"].requests()
    assert refused["outcome"] == "error"
    assert len(backends["big"].requests()) == 1
    assert backends["backup"].requests() == []  # not an unavailable pool: never `fallbacks`
    assert (
        _metric(
            gateway,
            "gateway_fallbacks_total",
            **{"from": "small", "to": "big"},
            reason="context_length",
        )
        >= 1
    )


def test_context_length_in_anthropic_words(gateway: Gateway, backends: dict[str, Backend]) -> None:
    raw = _anthropic(gateway).messages.with_raw_response.create(
        model="small-model", max_tokens=8, messages=[{"role": "user", "content": LONG}]
    )
    assert raw.parse().model == "big-model"
    assert len(backends["small"].requests()) == 1


def test_a_short_prompt_stays_on_its_model(gateway: Gateway, backends: dict[str, Backend]) -> None:
    raw = _openai(gateway).chat.completions.with_raw_response.create(
        model="small-model",
        messages=SHORT,
        max_tokens=4,
    )
    assert raw.parse().model == "small-model"
    assert raw.headers["x-gateway-pool"] == "small"
    assert raw.headers["x-gateway-fallbacks"] == "0"
    assert raw.headers["x-gateway-attempts"] == "1"


def test_content_policy_refusal_is_the_answer(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    reason = "Your request was rejected as a result of our safety system."
    backends["small"].set_faults(error_rate=1.0, error_status=400, error_message=reason)
    with pytest.raises(openai.BadRequestError) as caught:
        _openai(gateway).chat.completions.create(
            model="small-model",
            messages=SHORT,
            max_tokens=4,
        )
    assert reason in str(caught.value)
    assert len(backends["small"].requests()) == 1  # no retry
    assert backends["backup"].requests() == [] and backends["big"].requests() == []


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_key_is_the_answer(
    gateway: Gateway, backends: dict[str, Backend], status: int
) -> None:
    backends["small"].set_faults(error_rate=1.0, error_status=status, error_message="bad key")
    with pytest.raises(openai.APIStatusError) as caught:
        _openai(gateway).chat.completions.create(
            model="small-model",
            messages=SHORT,
            max_tokens=4,
        )
    assert caught.value.status_code == status
    assert len(backends["small"].requests()) == 1
    assert backends["backup"].requests() == []


def test_a_fallbacks_refusal_never_hides_the_first_failure(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    backends["small"].set_faults(error_rate=1.0, error_status=503, error_message="small is down")
    backends["backup"].set_faults(error_rate=1.0, error_status=400, error_message="backup says no")
    with pytest.raises(openai.APIStatusError) as caught:
        _openai(gateway).chat.completions.create(
            model="small-model",
            messages=SHORT,
            max_tokens=4,
        )
    assert caught.value.status_code == 503
    assert "small is down" in str(caught.value)
    assert caught.value.response.headers["x-gateway-pool"] == "small"
    assert caught.value.response.headers["x-gateway-fallbacks"] == "1"
    assert len(backends["backup"].requests()) == 1


def test_rate_limited_after_retries_falls_back(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    backends["small"].set_faults(rate_limit_rate=1.0, retry_after=3600)
    raw = _openai(gateway).chat.completions.with_raw_response.create(
        model="small-model",
        messages=SHORT,
        max_tokens=4,
    )
    assert raw.parse().model == "backup-model"
    assert raw.headers["x-gateway-pool"] == "backup"
    assert (
        _metric(
            gateway,
            "gateway_fallbacks_total",
            **{"from": "small", "to": "backup"},
            reason="rate_limited",
        )
        >= 1
    )
    # Its instance asked for a pause longer than any backoff: the request was handed over
    # at once instead of waiting it out. Reached with the clients' own keys (no
    # `credentials`), the pause does not hold another request off it: that one is asked
    # (its key may not be the one limited), is refused too, and is handed over at once.
    assert len(backends["small"].requests()) == 1
    again = _openai(gateway).chat.completions.with_raw_response.create(
        model="small-model", messages=SHORT, max_tokens=4
    )
    assert again.headers["x-gateway-pool"] == "backup"
    assert len(backends["small"].requests()) == 2


def test_a_stream_whose_pool_dies_mid_way_is_continued_on_the_fallback(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    lone = start_backend("lone", ["lone-model"], "--ttft", "0.01", "--per-token", "0.05")
    gw = None
    try:
        policy = f"""
{LOOPBACK_LISTENERS}
pools:
  lone:
    models: [lone-model]
    instances: [{{name: l1, url: "{lone.url}"}}]
    fallbacks: [backup]
  backup:
    models: [backup-model]
    instances: [{{name: b1, url: "{backends["backup"].url}"}}]
"""
        gw = start(tmp_path / "policy.yaml", policy)
        body = {"model": "lone-model", "messages": SHORT, "max_tokens": 30, "stream": True}
        pieces: list[str] = []
        events: list[dict[str, Any]] = []
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30) as got:
            assert got.headers["x-gateway-pool"] == "lone"
            for line in got.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    pieces.append("[DONE]")
                    continue
                event = json.loads(line[6:])
                events.append(event)
                delta = event["choices"][0]["delta"] if event.get("choices") else {}
                if delta.get("content"):
                    pieces.append(delta["content"])
                    if len(pieces) == 3:
                        lone.proc.signal(signal.SIGKILL)  # its only instance dies mid-stream
        assert pieces[-1] == "[DONE]"
        assert not any("error" in event for event in events)
        assert len(pieces) == 31  # 30 tokens, whole, then [DONE]
        (continued,) = backends["backup"].requests()
        assert continued["model"] == "backup-model"
    finally:
        if gw is not None:
            gw.stop()
        lone.stop()


def test_an_isolated_pool_goes_to_its_fallback_before_panicking(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    """Nothing admitting: the fallback answers, the isolated instance is not asked (no panic
    routing while a fallback can answer); when the fallback fails too, the pool panics as it
    would without fallbacks, and its instance answers."""
    operator = f"{gateway.admin_url}/admin/instances/iso/i1"
    assert httpx.post(f"{operator}/isolate", timeout=5).json()["state"] == "ISOLATED"
    try:
        sdk = _openai(gateway)
        raw = sdk.chat.completions.with_raw_response.create(
            model="iso-model", messages=SHORT, max_tokens=4
        )
        assert raw.parse().model == "backup-model"
        assert backends["big"].requests() == []  # never asked in panic
        backends["backup"].set_faults(error_rate=1.0, error_status=503)
        raw = sdk.chat.completions.with_raw_response.create(
            model="iso-model", messages=SHORT, max_tokens=4
        )
        assert raw.parse().model == "iso-model"  # the last resort: its own pool, in panic
        assert raw.headers["x-gateway-pool"] == "iso"
        assert raw.headers["x-gateway-fallbacks"] == "1"
        assert len(backends["big"].requests()) == 1
    finally:
        httpx.post(f"{operator}/restore", timeout=5)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_an_openai_request_is_answered_by_an_anthropic_pool(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    sdk = _openai(gateway)
    messages = [{"role": "system", "content": "be brief"}, *SHORT]
    raw = sdk.chat.completions.with_raw_response.create(
        model="oa-model", messages=messages, max_tokens=5, tools=TOOLS, stop=["END"]
    )
    completion = raw.parse()
    assert raw.headers["x-gateway-pool"] == "claude"
    assert completion.object == "chat.completion"
    assert completion.model == "claude-model"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    stream = sdk.chat.completions.create(
        model="oa-model",
        messages=messages,
        max_tokens=6,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens == 6
    sent = [r for r in backends["cross"].requests() if r["model"] == "claude-model"]
    assert len(sent) == 2 and {r["path"] for r in sent} == {"/v1/messages"}


def test_an_anthropic_request_is_answered_by_an_openai_pool(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    client = _anthropic(gateway)
    tools = [{"name": "weather", "description": "d", "input_schema": {"type": "object"}}]
    raw = client.messages.with_raw_response.create(
        model="an-model",
        max_tokens=5,
        system="be brief",
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
    )
    message = raw.parse()
    assert raw.headers["x-gateway-pool"] == "gpt"
    assert message.type == "message" and message.model == "gpt-model"
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5
    with client.messages.stream(
        model="an-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}], tools=tools
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.model == "gpt-model" and final.stop_reason == "max_tokens"
    sent = [r for r in backends["cross"].requests() if r["model"] == "gpt-model"]
    assert len(sent) == 2 and {r["path"] for r in sent} == {"/v1/chat/completions"}


def test_what_cannot_be_translated_skips_that_fallback_visibly(gateway: Gateway) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        _openai(gateway).chat.completions.create(
            model="oa-model", messages=SHORT, max_tokens=4, n=2
        )
    assert caught.value.status_code in (502, 503)  # the pool's own failure
    assert caught.value.response.headers["x-gateway-pool"] == "openai-down"
    assert (
        _metric(
            gateway,
            "gateway_fallback_skips_total",
            **{"from": "openai-down", "to": "claude"},
            reason="untranslatable",
        )
        >= 1
    )


def test_a_pool_of_the_other_family_asked_directly_is_translated(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    """`api` states a pool's family: a client of the other one is translated there too, with
    no fallback involved; a route that is not translated is refused clearly."""
    completion = _openai(gateway).chat.completions.create(
        model="claude-model", messages=SHORT, max_tokens=3
    )
    assert completion.object == "chat.completion" and completion.model == "claude-model"
    message = _anthropic(gateway).messages.create(
        model="gpt-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.type == "message" and message.model == "gpt-model"
    paths = {r["model"]: r["path"] for r in backends["cross"].requests()}
    assert paths == {"claude-model": "/v1/messages", "gpt-model": "/v1/chat/completions"}
    with pytest.raises(openai.NotFoundError) as caught:
        _openai(gateway).completions.create(model="claude-model", prompt="hi", max_tokens=3)
    assert "speaks the anthropic API" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as refused:
        _openai(gateway).chat.completions.create(
            model="claude-model", messages=SHORT, max_tokens=3, n=2
        )
    assert "cannot express this request" in str(refused.value)


def test_what_could_act_twice_is_handed_over_only_if_it_never_ran(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    """A background Responses API request its pool answered 500 may have started its job:
    the 500 is the answer, not a second job on a fallback. One no instance took goes on."""
    backends["small"].set_faults(error_rate=1.0, error_status=500, error_message="started?")
    body = {"model": "small-model", "input": "hello", "background": True}
    answer = httpx.post(f"{gateway.url}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 500 and "started?" in answer.text
    assert len(backends["small"].requests()) == 1
    assert backends["backup"].requests() == []
    gone = httpx.post(
        f"{gateway.url}/v1/responses", json={**body, "model": "down-model"}, timeout=30
    )
    assert gone.status_code == 200 and gone.headers["x-gateway-pool"] == "backup"
