"""Every model route, end to end: a gateway process in front of fake vLLMs serving vLLM's other
routes (the Responses API, audio forms, tokenizer, pooling, score and rerank) and one route the
gateway does not know. Each request goes to its model's pool; what a route may be retried for,
how its stream ends and what its latency teaches follow the route."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import (
    Backend,
    Gateway,
    closed_port,
    pool_policy,
    raw_http,
    start_backends,
    start_gateway,
    stop_backends,
)

FAST = ("--ttft", "0", "--per-token", "0")


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    started: dict[str, Backend] = {}
    try:
        started |= start_backends(("a", "b"), ["m"], *FAST)
        started |= start_backends(("w",), ["whisper"], *FAST)
        started |= start_backends(("r",), ["ranker"], *FAST)
        started |= start_backends(("e",), ["e"], *FAST)
        yield started
    finally:
        stop_backends(started)


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    url = {name: backend.url for name, backend in backends.items()}
    policy = f"""
listen: 127.0.0.1:0
admin: {{listen: 127.0.0.1:0}}
limits: {{max_request_bytes: 8MiB}}
pools:
  chat:
    models: [m]
    instances: [{{name: a, url: "{url["a"]}"}}, {{name: b, url: "{url["b"]}"}}]
    hedging: false
  audio:
    models: [whisper]
    instances: [{{name: w, url: "{url["w"]}"}}]
  rank:
    models: [ranker]
    instances: [{{name: r, url: "{url["r"]}"}}]
  edge:
    models: [e]
    instances:
      - {{name: nobody, url: "http://127.0.0.1:{closed_port()}"}}
      - {{name: e, url: "{url["e"]}"}}
    health: {{enabled: false}}  # so refused connections reach the request path
    hedging: false
  hosted:
    models: [h]
    instances: [{{name: provider, url: "{url["e"]}"}}]
    credentials: {{from_env: HOSTED_KEY}}
    health: {{enabled: false}}
"""
    gw = start_gateway(
        tmp_path_factory.mktemp("gw") / "policy.yaml", policy, env={"HOSTED_KEY": "sk-operator"}
    )
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def clean_backends(backends: dict[str, Backend]) -> None:
    for backend in backends.values():
        backend.reset()


@pytest.fixture
def client(gateway: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        yield http


def _without_times(answer: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in answer.items() if key not in ("created", "created_at")}


# (path, body, backend of the model's pool)
KNOWN = [
    ("/tokenize", {"model": "m", "prompt": "one two three"}, ("a", "b")),
    ("/detokenize", {"model": "m", "tokens": [1, 2, 3]}, ("a", "b")),
    ("/pooling", {"model": "ranker", "input": ["a b", "c"]}, ("r",)),
    ("/classify", {"model": "ranker", "input": "good day"}, ("r",)),
    ("/score", {"model": "ranker", "text_1": "a b", "text_2": ["a", "c"]}, ("r",)),
    ("/v1/score", {"model": "ranker", "text_1": "a b", "text_2": "b"}, ("r",)),
    ("/rerank", {"model": "ranker", "query": "a", "documents": ["a b", "c"]}, ("r",)),
    ("/v1/rerank", {"model": "ranker", "query": "a", "documents": ["c", "a"], "top_n": 1}, ("r",)),
    ("/v2/rerank", {"model": "ranker", "query": "x", "documents": ["x", "y"]}, ("r",)),
    ("/v1/embeddings", {"model": "m", "input": "seven"}, ("a", "b")),
    ("/v1/responses", {"model": "m", "input": "hello there", "max_output_tokens": 5}, ("a", "b")),
]


@pytest.mark.parametrize(("path", "body", "pool"), KNOWN, ids=[case[0] for case in KNOWN])
def test_each_known_route_reaches_its_models_pool_with_the_backends_answer(
    client: httpx.Client,
    backends: dict[str, Backend],
    path: str,
    body: dict[str, Any],
    pool: tuple[str, ...],
) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    served_by = response.headers["x-gateway-instance"]
    assert served_by in pool
    (record,) = backends[served_by].requests()
    assert (record["path"], record["model"]) == (path, body["model"])
    direct = httpx.post(backends[served_by].url + path, json=body, timeout=10)
    if path == "/v1/responses":  # its ids are the backend's own, one per answer
        assert (
            response.json()["output"][0]["content"][0]["text"]
            == (direct.json()["output"][0]["content"][0]["text"])
        )
        assert response.json()["usage"] == direct.json()["usage"]
    else:
        assert _without_times(response.json()) == _without_times(direct.json())


def test_models_lists_every_pools_models_and_each_can_be_read(client: httpx.Client) -> None:
    listed = client.get("/v1/models").json()
    owners = {model["id"]: model["owned_by"] for model in listed["data"]}
    assert owners == {"m": "chat", "whisper": "audio", "ranker": "rank", "e": "edge", "h": "hosted"}
    one = client.get("/v1/models/whisper")
    assert one.status_code == 200
    assert one.json() == {"id": "whisper", "object": "model", "created": 0, "owned_by": "audio"}
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert client.post("/v1/models/whisper").status_code == 405


def multipart(
    fields: dict[str, str], file: bytes, boundary: str = "gatewayBoundary7MA4YWxk"
) -> tuple[bytes, str]:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        f"Content-Type: audio/wav\r\n\r\n".encode()
        + file
        + b"\r\n"
    ]
    for name, value in fields.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
        parts.append(f"{head}{value}\r\n".encode())
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def test_an_audio_form_goes_to_its_models_pool_byte_for_byte(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    # Random bytes hold every sequence a parser could trip on, boundary look-alikes included.
    audio = os.urandom(3 * 1024 * 1024)
    body, content_type = multipart({"model": "whisper", "language": "en"}, audio)
    response = client.post(
        "/v1/audio/transcriptions", content=body, headers={"content-type": content_type}
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-gateway-instance"] == "w"
    assert len(response.json()["text"].split()) == 64
    (record,) = backends["w"].requests()
    assert record["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert record["model"] == "whisper"

    # Streamed (the form's `stream` field): chunks as they came, ending with [DONE].
    body, content_type = multipart({"stream": "true", "model": "whisper"}, audio[:2048])
    with client.stream(
        "POST", "/v1/audio/translations", content=body, headers={"content-type": content_type}
    ) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        text = streamed.read().decode()
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [c["object"] for c in chunks] == ["translation.chunk"] * 8
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "content_type", "says"),
    [
        (b"--x\r\n", "multipart/form-data", "boundary"),
        (multipart({"model": "whisper"}, b"abc")[0][:-20], None, "cut short"),
        (multipart({"model": "whisper", "stream": "maybe"}, b"abc")[0], None, "'stream'"),
        (multipart({"model": "w" * 2000}, b"abc")[0], None, "too long"),
        (b"not a form", None, "not valid multipart"),
    ],
)
def test_a_broken_form_is_a_400_that_says_why(
    client: httpx.Client,
    backends: dict[str, Backend],
    body: bytes,
    content_type: str | None,
    says: str,
) -> None:
    content_type = content_type or "multipart/form-data; boundary=gatewayBoundary7MA4YWxk"
    response = client.post(
        "/v1/audio/transcriptions", content=body, headers={"content-type": content_type}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert says in response.json()["error"]["message"]
    assert backends["w"].requests() == []


def test_a_request_naming_no_model_goes_to_the_only_pool_or_is_told_to_name_one(
    client: httpx.Client, backends: dict[str, Backend], tmp_path: Path
) -> None:
    refused = client.post("/tokenize", json={"prompt": "a b"})
    assert refused.status_code == 400
    assert "names no model" in refused.json()["error"]["message"]
    form, content_type = multipart({}, b"abc")
    refused = client.post(
        "/v1/audio/transcriptions", content=form, headers={"content-type": content_type}
    )
    assert refused.status_code == 400
    # A gateway of one pool (the sidecar): the engine's default model answers, as direct.
    policy = pool_policy({"a": backends["a"]}).replace("models: [m]", "models: [m, m-alias]")
    sidecar = start_gateway(tmp_path / "policy.yaml", policy)
    try:
        with httpx.Client(base_url=sidecar.url, timeout=20) as http:
            for path, body in (
                ("/tokenize", {"prompt": "a b"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                answered = http.post(path, json=body)
                assert answered.status_code == 200, answered.text
            # A route without a body (the Responses API's cancel) reaches the engine, whose
            # own answer comes back (this one has no such response: its 404, not the gateway's).
            cancel = http.post("/v1/responses/resp_0a1b/cancel")
            assert cancel.status_code == 404 and "x-gateway-error" not in cancel.headers
            assert "/v1/responses/resp_0a1b/cancel" in cancel.json()["error"]["message"]
            # A route the gateway does not know must name its model, even here.
            unnamed = http.post("/v1/_fake/echo", json={"x": 1})
            assert unnamed.status_code == 400 and "names no model" in unnamed.text
            # vLLM's run-time LoRA administration is never proxied, model or not.
            lora = {"model": "m", "lora_name": "x", "lora_path": "/tmp/x"}
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                refused = http.post(path, json=lora)
                assert refused.status_code == 404 and refused.headers["x-gateway-error"]
            metrics = httpx.get(f"{sidecar.admin_url}/metrics", timeout=5).text
    finally:
        sidecar.stop()
    logged = backends["a"].requests()
    assert [(r["path"], r["model"]) for r in logged] == [
        ("/tokenize", "m"),
        ("/v1/chat/completions", "m"),
    ]
    # Counted under the pool's first model, not an empty label nor another alias.
    counted = [line for line in metrics.splitlines() if line.startswith("gateway_requests_total{")]
    assert counted and all('model="m"' in line for line in counted)


def test_a_responses_stream_is_relayed_whole_and_a_cut_one_ends_with_its_error_event(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    kinds = [
        event.type
        for event in sdk.responses.create(model="m", input="hi", max_output_tokens=3, stream=True)
    ]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.output_text.delta") == 3
    assert kinds[-1] == "response.completed"

    # Both instances cut their next stream after 2 tokens: the Responses API cannot be
    # continued elsewhere, so the client gets what came and the API's own error event.
    for name in ("a", "b"):
        backends[name].set_faults(die_next=1, die_after=2)
    with httpx.Client(timeout=20) as http:
        body = {"model": "m", "input": "hi", "max_output_tokens": 6, "stream": True}
        text = http.post(f"{gateway.url}/v1/responses", json=body).text
    blocks = [block.split("\n", 1) for block in text.strip().split("\n\n")]
    names = [name.removeprefix("event: ") for name, _ in blocks]
    datas = [json.loads(data.removeprefix("data: ")) for _, data in blocks]
    assert names.count("response.output_text.delta") == 2
    assert names[-1] == "error" and "[DONE]" not in text
    assert datas[-1]["sequence_number"] == datas[-2]["sequence_number"] + 1
    assert datas[-1]["code"] == "upstream_reset"
    # The SDK reads it as the API's error event, not as a broken stream.
    for name in ("a", "b"):
        backends[name].set_faults(die_next=1, die_after=2)
    said = list(sdk.responses.create(model="m", input="hi", max_output_tokens=6, stream=True))
    assert said[-1].type == "error"


def test_a_known_route_is_retried_and_an_unknown_one_only_when_never_sent(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    backends["r"].set_faults(error_rate=1.0, error_status=500)
    known = client.post("/rerank", json={"model": "ranker", "query": "a", "documents": ["a"]})
    assert known.status_code == 500
    attempts = int(known.headers["x-gateway-attempts"])
    assert attempts >= 2  # a lone instance is asked again after a transient failure
    unknown = client.post("/v1/_fake/echo", json={"model": "ranker"})
    assert unknown.status_code == 500  # the backend's own answer, relayed
    assert unknown.headers["x-gateway-attempts"] == "1"
    assert len(backends["r"].requests()) == attempts + 1

    # A refused connection sent nothing: the unknown route goes to the next instance.
    served = []
    for _ in range(20):
        echoed = client.post("/v1/_fake/echo", json={"model": "e", "n": 1})
        assert echoed.status_code == 200, echoed.text
        assert echoed.json()["path"] == "/v1/_fake/echo"
        served.append(int(echoed.headers["x-gateway-attempts"]))
    assert max(served) == 2 and len(backends["e"].requests()) == 20


def test_a_responses_request_that_could_act_twice_is_never_sent_twice(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    for name in ("a", "b"):
        backends[name].set_faults(error_rate=1.0, error_status=500)
    plain = {"model": "m", "input": "x"}
    cases = [
        (plain, True),
        ({**plain, "tools": [{"type": "function", "name": "f", "parameters": {}}]}, True),
        ({**plain, "background": True}, False),  # runs on after its answer: once only
        ({**plain, "tools": [{"type": "web_search"}]}, False),  # the server's own tool
    ]
    for body, retried in cases:
        response = client.post("/v1/responses", json=body)
        assert response.status_code == 500
        assert (int(response.headers["x-gateway-attempts"]) > 1) is retried, body


def test_an_unknown_route_never_reaches_a_pool_with_credentials(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    refused = client.post("/v1/_fake/echo", json={"model": "h"})
    assert refused.status_code == 404 and refused.headers["x-gateway-error"] == "not_found"
    assert "credentials" in refused.json()["error"]["message"]
    assert backends["e"].requests() == []
    # Its fields are the backend's to judge: only `model` is the gateway's business there.
    odd = client.post("/v1/_fake/echo", json={"model": "e", "stream": "yes", "max_tokens": "x"})
    assert odd.status_code == 200, odd.text


def test_an_unknown_routes_stream_is_relayed_as_it_comes_and_aborted_when_cut(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    body = {"model": "ranker", "stream": True}
    streamed = client.post("/v1/_fake/echo", json=body)
    parts = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.strip()]
    assert [part["part"] for part in parts] == [0, 1, 2]
    assert "[DONE]" not in streamed.text  # nothing of another protocol added

    backends["r"].set_faults(die_rate=1.0)
    received = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream("POST", "/v1/_fake/echo", json=body) as cut,
    ):
        for chunk in cut.iter_raw():
            received += chunk
    # What came went through; no event the client's protocol does not have was made up.
    assert received.count(b"data: ") == 2
    assert b"error" not in received


def test_routes_the_latency_model_does_not_describe_teach_it_nothing(
    gateway: Gateway, client: httpx.Client
) -> None:
    def learned() -> dict[str, tuple[int, int]]:
        state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
        return {
            i["name"]: (i["ewma"]["ttfb"]["samples"], i["ewma"]["service"]["samples"])
            for i in state["pools"]["chat"]["instances"]
        }

    before = learned()
    for _ in range(10):
        assert client.post("/tokenize", json={"model": "m", "prompt": "a"}).status_code == 200
        assert client.post("/v1/_fake/echo", json={"model": "m"}).status_code == 200
    assert learned() == before
    # An embedding is a prefill the model describes: it teaches it.
    assert client.post("/v1/embeddings", json={"model": "m", "input": "x"}).status_code == 200
    after = learned()
    assert sum(ttfb for ttfb, _ in after.values()) == sum(t for t, _ in before.values()) + 1


@pytest.mark.parametrize(
    "path", ["/v1//x", "/v1/./x", "/v1/%2e%2e/admin", "/v1/x/..", "/v1/x%00", "/v1/" + "x" * 300]
)
def test_a_path_under_v1_is_proxied_only_as_it_stands(
    gateway: Gateway, backends: dict[str, Backend], path: str
) -> None:
    body = b'{"model":"m"}'
    reply = raw_http(
        int(gateway.url.rsplit(":", 1)[1]),
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (path.encode(), len(body), body),
    )
    assert reply.startswith(b"HTTP/1.1 404"), reply
    assert backends["a"].requests() == [] and backends["b"].requests() == []
