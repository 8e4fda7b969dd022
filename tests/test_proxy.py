"""The proxy end to end: real fake-vLLM backends and a real gateway process on loopback."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtests.fake_vllm.responses import text
from tests.support import Backend, Gateway, closed_port, raw_http, start_backend, start_gateway

ADMIN_TOKEN = "admin-secret-token"


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    started = {
        "a": start_backend("a", ["chat-model", "short-model"], "--ttft", "0", "--per-token", "0"),
        "b": start_backend("b", ["chat-model"], "--ttft", "0", "--per-token", "0"),
        "c": start_backend("c", ["embed-model"], "--ttft", "0", "--per-token", "0"),
    }
    yield started
    for backend in started.values():
        backend.stop()


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    a, b, c = backends["a"].url, backends["b"].url, backends["c"].url
    policy = f"""
listen: 127.0.0.1:0
admin: {{listen: 127.0.0.1:0, token_env: TEST_GATEWAY_ADMIN_TOKEN}}
limits: {{max_request_bytes: 64KiB}}
pools:
  chat:
    models: [chat-model]
    instances:
      - {{name: a, url: "{a}"}}
      - {{name: b, url: "{b}"}}
    hedging: false  # attempts counted here are the requests' own (tests/test_hedge.py)
  embed:
    models: [embed-model]
    instances: [{{name: c, url: "{c}"}}]
  short:
    models: [short-model]
    instances: [{{name: a-short, url: "{a}"}}]
    timeouts: {{initial: 400ms, initial_per_token: 1ms, floor: 100ms}}
  dead:
    models: [dead-model]
    instances: [{{name: nobody, url: "http://127.0.0.1:{closed_port()}"}}]
    health: {{enabled: false}}  # so the refusal reaches the request path
"""
    gw = start_gateway(
        tmp_path_factory.mktemp("gw") / "policy.yaml",
        policy,
        env={"TEST_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN},
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


def chat(model: str = "chat-model", **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"] and error["type"]
    # The gateway's own answer says so in a header too, whatever the route's error shape.
    assert response.headers["x-gateway-error"] == code


# --- routing -----------------------------------------------------------------------------------


def test_routes_by_model_across_two_pools(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    seen = []
    for _ in range(20):
        response = client.post("/v1/chat/completions", json=chat(max_tokens=3))
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
        assert response.headers["x-gateway-attempts"] == "1"
        seen.append(response.headers["x-gateway-instance"])
    assert set(seen) == {"a", "b"}  # the chat pool's instances, balanced
    embedded = client.post("/v1/embeddings", json={"model": "embed-model", "input": ["x", "y"]})
    assert embedded.status_code == 200
    assert embedded.headers["x-gateway-instance"] == "c"
    assert len(embedded.json()["data"]) == 2
    completion = client.post("/v1/completions", json={"model": "chat-model", "prompt": "hi"})
    assert completion.status_code == 200

    a_paths = [r["path"] for r in backends["a"].requests()]
    c_log = backends["c"].requests()
    assert a_paths.count("/v1/chat/completions") == seen.count("a")
    assert [(r["path"], r["model"]) for r in c_log] == [("/v1/embeddings", "embed-model")]


def test_models_lists_every_pool(client: httpx.Client) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    ids = {m["id"] for m in response.json()["data"]}
    assert ids == {"chat-model", "embed-model", "short-model", "dead-model"}


def test_body_is_forwarded_byte_for_byte(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    # Odd spacing, key order and escapes must survive: the gateway never re-encodes a body.
    raw = (
        b'{ "messages":[{"content":"caf\\u00e9 \xf0\x9f\x98\x80","role":"user"}] ,'
        b'"model" : "embed-model","input":"x"}'
    )
    response = client.post(
        "/v1/embeddings", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200
    (record,) = backends["c"].requests()
    assert record["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert int(record["headers"]["content-length"]) == len(raw)


def test_query_string_is_forwarded_as_sent(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    body = b'{"model":"embed-model","input":"x"}'
    response = client.post(
        "/v1/embeddings?api-version=2024-10&x=%20a%2Fb",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200
    (record,) = backends["c"].requests()
    assert record["path"] == "/v1/embeddings"
    assert record["query"] == "api-version=2024-10&x=%20a%2Fb"  # not re-encoded either


# --- streaming ---------------------------------------------------------------------------------


def test_stream_arrives_incrementally(client: httpx.Client, backends: dict[str, Backend]) -> None:
    for backend in (backends["a"], backends["b"]):
        backend.set_faults(per_token=0.05)
    arrivals: list[tuple[float, str]] = []
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=10)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic(), line[6:]))
    assert arrivals[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in arrivals[:-1]]
    assert len(chunks) >= 10
    # Ten tokens at 50 ms each: the first chunk must reach the client long before the last.
    assert arrivals[-1][0] - arrivals[0][0] >= 0.3


def _dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body, whole (to its last chunk), as its bytes."""
    out = bytearray()
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(out)
        out += body[:size]
        assert body[size : size + 2] == b"\r\n", "a chunk's framing is broken"
        body = body[size + 2 :]


def test_a_client_slow_to_read_gets_every_event_in_order(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    """A long stream sent at once to a client that does not read for a while (a small receive
    buffer, a pause): the gateway's writes back up, and the relay waits for the client instead
    of writing past it. Once the client reads, it gets every event in order, nothing twice."""
    tokens = 3000
    request = json.dumps(chat(stream=True, max_tokens=tokens)).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(20)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(request), request)
        )
        data = sock.recv(4096)
        time.sleep(1.0)  # the engine sends all of it meanwhile
        while not data.endswith(b"\r\n0\r\n\r\n"):
            more = sock.recv(65536)
            assert more, "the stream ended before its last chunk"
            data += more
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    events = [e for e in _dechunk(body).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    content = "".join(
        json.loads(e.removeprefix("data: "))["choices"][0]["delta"].get("content") or ""
        for e in events[:-1]
        if json.loads(e.removeprefix("data: "))["choices"]
    )
    assert content == text(tokens)


def test_client_disconnect_mid_stream_cancels_upstream(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    for backend in (backends["a"], backends["b"]):
        backend.set_faults(per_token=0.2)
    with (
        httpx.Client(base_url=gateway.url, timeout=20) as http,
        http.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=100)
        ) as response,
    ):
        instance = response.headers["x-gateway-instance"]
        next(response.iter_lines())
    # Closing the client closed the connection: the backend must see its request cancelled.
    # Waited for longer than the whole generation (100 tokens at 0.2 s: 20 s), so the outcome
    # is known either way: "cancelled" (cut short), not "ok" (left to run to its end).
    (record,) = backends[instance].requests(wait_for=1, timeout_s=30)
    assert record["outcome"] == "cancelled"
    state = admin_state(gateway)
    assert all(i["in_flight"] == 0 for i in state["pools"]["chat"]["instances"])


def test_client_disconnect_while_waiting_cancels_upstream(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    for backend in (backends["a"], backends["b"]):
        backend.set_faults(ttft=30)
    with httpx.Client(base_url=gateway.url, timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=chat())
    # The attempt (and, if the gateway gave up on the first instance before the client left,
    # its retry on the other one) must be cancelled, not left to generate for nobody.
    busy = [b for b in ("a", "b") if backends[b].requests()]
    assert busy
    for name in busy:
        records = backends[name].requests(wait_for=len(backends[name].requests()), timeout_s=10)
        assert {record["outcome"] for record in records} == {"cancelled"}, records


def test_backend_dying_mid_stream_on_every_attempt_ends_with_error_event(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    for backend in (backends["a"], backends["b"]):
        backend.set_faults(die_rate=1.0, die_after=3, per_token=0.01)
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=20)) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "upstream_reset"
    # Resumed three times (the most allowed), each attempt dying after 3 tokens: 12 tokens
    # came through, each once and in order, then the error event.
    chunks = [json.loads(e) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text(12)
    assert len({c["id"] for c in chunks}) == 1


# --- headers -----------------------------------------------------------------------------------


def test_request_headers_hop_by_hop_and_forwarding(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    response = client.post(
        "/v1/embeddings",
        json={"model": "embed-model", "input": "x"},
        headers={
            "authorization": "Bearer sk-client-key",
            "connection": "keep-alive, x-hop-custom",
            "x-hop-custom": "must not pass",
            "keep-alive": "timeout=5",
            "te": "trailers",
            "proxy-authorization": "Basic abc",
            "x-gateway-timeout": "10",
            "x-gateway-priority": "batch",
            "x-forwarded-for": "203.0.113.7",
            "x-custom-end-to-end": "kept",
        },
    )
    assert response.status_code == 200
    (record,) = backends["c"].requests()
    sent = record["headers"]
    assert sent["authorization"] == "Bearer sk-client-key"
    assert sent["x-custom-end-to-end"] == "kept"
    # No trusted proxies configured: the client's own X-Forwarded-For is replaced by its address.
    assert sent["x-forwarded-for"] == "127.0.0.1"
    assert sent["x-forwarded-proto"] == "http"
    assert sent["host"] == backends["c"].url.removeprefix("http://")
    for gone in (
        "x-hop-custom",
        "keep-alive",
        "te",
        "proxy-authorization",
        "x-gateway-timeout",
        "x-gateway-priority",
    ):
        assert gone not in sent, gone
    assert "connection" not in sent or sent["connection"].lower() == "keep-alive"
    assert sent["user-agent"].startswith("python-httpx")  # the client's, not one of ours
    assert response.headers["x-gateway-instance"] == "c"
    assert (
        "transfer-encoding" not in response.headers
        or response.headers["transfer-encoding"] == "chunked"
    )


def test_absolute_form_target_stays_on_the_policy_backend(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    body = b'{"model":"embed-model","input":"x"}'
    reply = raw_http(
        int(gateway.url.rsplit(":", 1)[1]),
        b"POST http://evil.example:9999/v1/embeddings HTTP/1.1\r\nHost: evil.example:9999\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (len(body), body),
    )
    assert reply.startswith(b"HTTP/1.1 200"), reply
    (record,) = backends["c"].requests()
    assert record["path"] == "/v1/embeddings"
    assert record["headers"]["host"] == backends["c"].url.removeprefix("http://")


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../v1/chat/completions",
        "/v1/chat/completions/../../admin/state",
        "/v1/chat/completions/",
        "//v1/chat/completions",
        "/v1/chat/completions%2F..%2F..%2Fhealth",
    ],
)
def test_paths_are_matched_exactly(
    gateway: Gateway, path: str, backends: dict[str, Backend]
) -> None:
    body = b'{"model":"chat-model"}'
    reply = raw_http(
        int(gateway.url.rsplit(":", 1)[1]),
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (path.encode(), len(body), body),
    )
    assert reply.startswith(b"HTTP/1.1 404"), reply
    assert backends["a"].requests() == [] and backends["b"].requests() == []


def test_request_smuggling_is_rejected(gateway: Gateway, backends: dict[str, Backend]) -> None:
    smuggled = b"GET /admin/state HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    reply = raw_http(
        int(gateway.url.rsplit(":", 1)[1]),
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%s" % (len(body), body),
    )
    assert reply.startswith(b"HTTP/1.1 400"), reply
    assert reply.count(b"HTTP/1.1") == 1


# --- errors made by the gateway ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"{not json", "malformed"),
        (b"[1, 2]", "non-object"),
        (b'"just a string"', "non-object"),
        (b"[" * 20_000 + b"]" * 20_000, "deeply nested"),
        (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "deeply nested object"),
        (b'{"messages": []}', "missing model"),
        (b'{"model": 42}', "model not a string"),
        (b'{"model": "chat-model", "stream": "yes"}', "stream not a boolean"),
        (b'{"model": "chat-model", "max_tokens": -1}', "negative max_tokens"),
        (b"\xff\xfe{}", "not utf-8"),
        (b"", "empty"),
    ],
)
def test_bad_bodies_are_400(client: httpx.Client, body: bytes, why: str) -> None:
    response = client.post("/v1/chat/completions", content=body)
    assert_error(response, 400, "invalid_request")


def test_unknown_model_is_404(client: httpx.Client) -> None:
    assert_error(client.post("/v1/chat/completions", json=chat("gpt-9")), 404, "model_not_found")


def test_unknown_path_and_wrong_method(client: httpx.Client) -> None:
    # Proxied: vLLM's routes and any POST under /v1/; nothing else.
    assert_error(client.post("/v3/rerank", json=chat()), 404, "not_found")
    assert_error(client.post("/admin/state", json=chat()), 404, "not_found")
    assert_error(client.get("/v1/chat/completions"), 405, "method_not_allowed")
    assert_error(client.get("/v1/some/plugin"), 404, "not_found")


def test_declared_oversized_body_is_413_before_it_is_sent(gateway: Gateway) -> None:
    # Only the headers go out; the gateway must answer without waiting for 1 MB that never comes.
    reply = raw_http(
        int(gateway.url.rsplit(":", 1)[1]),
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n",
        timeout_s=5,
    )
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert b'"code":"request_too_large"' in reply


def test_chunked_oversized_body_is_413(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "chat-model", "pad": "'
        for _ in range(200):
            yield b"x" * 1024
        yield b'"}'

    response = client.post("/v1/chat/completions", content=chunks())
    assert_error(response, 413, "request_too_large")


def test_body_just_under_the_limit_passes(client: httpx.Client) -> None:
    pad = "x" * (64 * 1024 - 200)
    response = client.post("/v1/embeddings", json={"model": "embed-model", "input": pad})
    assert response.status_code == 200


def test_refused_connection_is_502(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=chat("dead-model"))
    assert_error(response, 502, "upstream_connect_failed")
    assert response.headers["x-gateway-attempts"] == "3"  # the first tier's two retries


def test_backend_reset_before_the_body_is_complete_is_502(
    client: httpx.Client, backends: dict[str, Backend]
) -> None:
    for backend in (backends["a"], backends["b"]):
        backend.set_faults(die_rate=1.0, die_after=2)
    response = client.post("/v1/chat/completions", json=chat(max_tokens=20))
    assert_error(response, 502, "upstream_reset")


def test_hung_backend_is_504_after_the_first_byte_timeout(
    gateway: Gateway, client: httpx.Client, backends: dict[str, Backend]
) -> None:
    backends["a"].set_faults(hang_rate=1.0)
    before = first_byte_timeouts(gateway, "short", "a-short")
    started = time.monotonic()
    response = client.post("/v1/chat/completions", json=chat("short-model", max_tokens=16))
    elapsed = time.monotonic() - started
    assert_error(response, 504, "upstream_timeout")
    # One attempt, given up after the first-byte timeout of an unlearned instance, not before
    # (the whole answer is fetched as a stream, `resume.whole_answers`, whose first byte is its
    # first token: 400 ms). No other instance to go to, and asking `a` again, silent since,
    # would only wait out another whole timeout.
    assert response.headers["x-gateway-attempts"] == "1"
    assert elapsed >= 0.4
    # Ended by that first-byte timeout, counted against the instance.
    assert first_byte_timeouts(gateway, "short", "a-short") == before + 1
    records = backends["a"].requests(wait_for=1)
    assert [r["outcome"] for r in records] == ["cancelled"]  # the attempt was closed


@pytest.mark.parametrize("status", [503, 429, 500])
def test_backend_errors_pass_through_unchanged(
    client: httpx.Client, backends: dict[str, Backend], status: int
) -> None:
    backends["c"].set_faults(error_rate=1.0, error_status=status)
    response = client.post("/v1/embeddings", json={"model": "embed-model", "input": "x"})
    assert response.status_code == status
    assert response.headers["x-gateway-instance"] == "c"
    # The backend's answer, not the gateway's: not marked as the gateway's own error.
    assert "x-gateway-error" not in response.headers
    assert response.json()["error"]["message"] == "injected error"
    # A backend's 404 for a model it does not serve is the backend's answer, relayed as is.
    backends["c"].reset()
    response = client.post("/v1/embeddings", json={"model": "embed-model", "input": "x"})
    assert response.status_code == 200


# --- health and admin --------------------------------------------------------------------------


def admin_state(gateway: Gateway) -> dict[str, object]:
    response = httpx.get(
        f"{gateway.admin_url}/admin/state",
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=5,
    )
    response.raise_for_status()
    result: dict[str, object] = response.json()
    return result


def first_byte_timeouts(gateway: Gateway, pool: str, instance: str) -> int:
    """The first-byte timeouts /admin/state counts against `instance` (blamed or not)."""
    pools: dict[str, Any] = admin_state(gateway)["pools"]  # type: ignore[assignment]
    (found,) = [i for i in pools[pool]["instances"] if i["name"] == instance]
    return sum(t["count"] for t in found["timeouts_by_phase"] if t["phase"] == "first_byte")


def test_health_and_readiness(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    detail = ready.json()
    assert detail["pools"]["chat"] is True and detail["pools"]["embed"] is True
    # Ready only when every pool can take traffic (earlier tests may have isolated one).
    assert (ready.status_code == 200) == all(detail["pools"].values()) == detail["ready"]


def test_admin_requires_the_token(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).status_code == 401
    wrong = httpx.get(
        f"{gateway.admin_url}/admin/state", headers={"authorization": "Bearer nope"}, timeout=5
    )
    assert wrong.status_code == 401
    state = admin_state(gateway)
    names = [i["name"] for i in state["pools"]["chat"]["instances"]]  # type: ignore[index]
    assert names == ["a", "b"]


def test_admin_plane_is_not_on_the_data_port(client: httpx.Client) -> None:
    assert client.get("/admin/state").status_code == 404
