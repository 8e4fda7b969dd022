"""Upstream credentials per pool, client authentication, and secrets kept out of every output.

The backend is an in-test uvicorn app that records the headers it receives; the gateway runs as
a process with debug logs, access lines and tracing to a real OTLP receiver."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from gateway.config import PolicyError, parse_policy
from gateway.ingress.auth import ClientAuth, presented_key
from gateway.reload import diff_policies
from loadtests.asgi_server import Recorder, ThreadedServer
from loadtests.procs import gateway_process, wait_until
from tests.otlp_receiver import OtlpReceiver
from tests.support import LOOPBACK_LISTENERS, Gateway

ENV_SECRET = "sk-upstream-env-canary-51c9"
FILE_SECRET = "sk-upstream-file-canary-8d2e"
ROTATED_SECRET = "sk-upstream-rotated-canary-0b7a"
CLIENT_KEYS = ("gw-client-key-one", "gw-client-key-two")
COMPLETION = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


async def echo_backend(scope: Scope, receive: Receive, send: Send) -> None:
    """/health and /metrics answer 200 (the latter with an engine gauge, so it is read every
    interval); any POST gets a small chat completion."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["method"] == "POST":
        body = COMPLETION
    else:
        body = b"vllm:num_requests_waiting 0\n" if scope["path"] == "/metrics" else b"ok"
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def backend() -> Iterator[tuple[ThreadedServer, Recorder]]:
    recorder = Recorder(echo_backend)
    server = ThreadedServer(recorder)
    yield server, recorder
    server.stop()


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


def policy_text(port: int, secret_file: Path, keys_file: Path) -> str:
    url = f"http://127.0.0.1:{port}"
    return f"""
{LOOPBACK_LISTENERS}
telemetry: {{tracing: true, access_log: true}}
auth: {{api_keys_file: "{keys_file}"}}
pools:
  envpool:
    models: [m-env]
    instances: [{{name: a, url: "{url}"}}]
    credentials: {{header: X-Api-Key, from_env: TEST_UPSTREAM_KEY}}
    health: {{interval: 200ms, timeout: 150ms}}
    admission: {{vllm_signals: {{interval: 200ms}}}}
  filepool:
    models: [m-file]
    instances: [{{name: b, url: "{url}"}}]
    credentials: {{header: authorization, from_file: "{secret_file}"}}
  plainpool:
    models: [m-plain]
    instances: [{{name: c, url: "{url}"}}]
"""


@pytest.fixture
def setup(
    tmp_path: Path, backend: tuple[ThreadedServer, Recorder], receiver: OtlpReceiver
) -> Iterator[dict[str, Any]]:
    server, recorder = backend
    secret_file = tmp_path / "upstream-secret"
    secret_file.write_text(FILE_SECRET + "\n")  # as a Kubernetes Secret file
    keys_file = tmp_path / "client-keys"
    keys_file.write_text(f"# clients\n{CLIENT_KEYS[0]}\n\n{CLIENT_KEYS[1]}\n")
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(policy_text(server.port, secret_file, keys_file))
    env = {
        "TEST_UPSTREAM_KEY": ENV_SECRET,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.traces_url,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    gw = Gateway(gateway_process(policy_path, env, "--log-level", "debug"))
    recorder.requests.clear()
    yield {
        "gw": gw,
        "recorder": recorder,
        "receiver": receiver,
        "secret_file": secret_file,
        "keys_file": keys_file,
    }
    gw.stop()


def chat(gw: Gateway, model: str, headers: dict[str, str]) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=10)


def last_upstream_headers(recorder: Recorder) -> dict[str, list[str]]:
    request = [r for r in recorder.requests if r["path"] == "/v1/chat/completions"][-1]
    received: dict[str, list[str]] = {}
    for name, value in request["headers"]:
        received.setdefault(name, []).append(value)
    return received


def test_the_pool_credential_replaces_the_client_key(setup: dict[str, Any]) -> None:
    gw, recorder = setup["gw"], setup["recorder"]
    bearer = {"authorization": f"Bearer {CLIENT_KEYS[0]}"}

    assert chat(gw, "m-env", {**bearer, "x-api-key": "client-sent-this"}).status_code == 200
    sent = last_upstream_headers(recorder)
    assert sent["x-api-key"] == [ENV_SECRET]
    assert "authorization" not in sent

    assert chat(gw, "m-file", {"x-api-key": CLIENT_KEYS[1]}).status_code == 200
    sent = last_upstream_headers(recorder)
    assert sent["authorization"] == [f"Bearer {FILE_SECRET}"]  # trailing newline stripped
    assert "x-api-key" not in sent

    # Client authentication on, no pool credential: the client's gateway key stays here.
    assert chat(gw, "m-plain", bearer).status_code == 200
    sent = last_upstream_headers(recorder)
    assert "authorization" not in sent and "x-api-key" not in sent
    everything = json.dumps(recorder.requests)
    assert CLIENT_KEYS[0] not in everything and CLIENT_KEYS[1] not in everything

    # Health checks and vLLM scrapes carry the pool's credential too.
    def checked(path: str) -> bool:
        return any(
            r["path"] == path and ("x-api-key", ENV_SECRET) in r["headers"]
            for r in list(recorder.requests)
        )

    assert wait_until(lambda: checked("/health") and checked("/metrics"), timeout_s=5)


def test_client_authentication(setup: dict[str, Any]) -> None:
    gw = setup["gw"]
    for headers in (
        {},
        {"authorization": "Bearer wrong-key"},
        {"x-api-key": "wrong-key"},
        {"authorization": CLIENT_KEYS[0]},  # no Bearer scheme
        {"authorization": f"Bearer {CLIENT_KEYS[0]}x"},
    ):
        response = chat(gw, "m-env", headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.headers["x-gateway-error"] == "invalid_api_key"
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    for headers in ({"authorization": f"bearer {CLIENT_KEYS[1]}"}, {"x-api-key": CLIENT_KEYS[0]}):
        assert chat(gw, "m-env", headers).status_code == 200, headers
    assert httpx.get(f"{gw.url}/v1/models", timeout=5).status_code == 401
    models = httpx.get(f"{gw.url}/v1/models", headers={"x-api-key": CLIENT_KEYS[1]}, timeout=5)
    assert models.status_code == 200 and models.json()["data"]
    assert httpx.get(f"{gw.url}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{gw.url}/readyz", timeout=5).status_code == 200


def test_secrets_never_leave_in_logs_spans_metrics_or_state(setup: dict[str, Any]) -> None:
    gw, receiver = setup["gw"], setup["receiver"]
    for model in ("m-env", "m-file", "m-plain"):
        assert chat(gw, model, {"authorization": f"Bearer {CLIENT_KEYS[0]}"}).status_code == 200
    assert chat(gw, "m-env", {"x-api-key": "wrong-key-canary"}).status_code == 401
    assert chat(gw, "m-env", {}).status_code == 401  # no key at all
    assert chat(gw, "nope", {"x-api-key": CLIENT_KEYS[1]}).status_code == 404
    assert receiver.wait_for(lambda spans: sum(s.kind == "SERVER" for s in spans) >= 4)
    admin = {
        "metrics": httpx.get(f"{gw.admin_url}/metrics", timeout=5).text,
        "state": httpx.get(f"{gw.admin_url}/admin/state", timeout=5).text,
    }
    # Both 401s counted, on /metrics and /admin/state alike.
    assert 'gateway_ingress_refusals_total{reason="unauthorized"} 2.0' in admin["metrics"]
    assert json.loads(admin["state"])["ingress"]["refusals"]["unauthorized"] == 2
    # The operator sees where each pool's credential comes from, not what it is.
    pools = json.loads(admin["state"])["pools"]
    assert {name: pool["credentials"] for name, pool in pools.items()} == {
        "envpool": {"header": "x-api-key", "source": "env:TEST_UPSTREAM_KEY"},
        "filepool": {"header": "authorization", "source": f"file:{setup['secret_file']}"},
        "plainpool": None,
    }
    reload = httpx.post(f"{gw.admin_url}/admin/reload", timeout=10)
    assert reload.status_code == 200
    gw.stop()
    outputs = {
        "logs": gw.proc.output(),
        "spans": b"".join(receiver.raw_bodies).decode("latin-1"),
        **admin,
    }
    assert "access" in outputs["logs"] or "status=200" in outputs["logs"]
    # The 401s have their access lines, like every request answered before routing.
    lines = outputs["logs"].splitlines()
    refused = [line for line in lines if "gateway.access" in line and "status=401" in line]
    assert len(refused) == 2, refused
    assert all("path=/v1/chat/completions" in line for line in refused)
    assert all("client=127.0.0.1" in line for line in refused)
    # Two within the summary interval: one WARNING line for them (the first), the rest counted.
    summaries = [
        line
        for line in lines
        if "requests refused by the ingress" in line and "reason=unauthorized" in line
    ]
    assert len(summaries) == 1 and "WARNING" in summaries[0], summaries
    for where, text in outputs.items():
        for secret in (ENV_SECRET, FILE_SECRET, *CLIENT_KEYS, "wrong-key-canary"):
            assert secret not in text, (where, secret)


def test_rotation_by_reload(setup: dict[str, Any]) -> None:
    gw, recorder = setup["gw"], setup["recorder"]
    setup["secret_file"].write_text(ROTATED_SECRET + "\n")
    setup["keys_file"].write_text("gw-client-key-three\n")
    result = httpx.post(f"{gw.admin_url}/admin/reload", timeout=10).json()
    assert result["reloaded"] is True, result
    assert result["changes"]["pools_changed"] == ["filepool"]
    assert result["changes"]["auth"] == ["api_keys"]
    assert chat(gw, "m-file", {"x-api-key": CLIENT_KEYS[0]}).status_code == 401
    assert chat(gw, "m-file", {"x-api-key": "gw-client-key-three"}).status_code == 200
    assert last_upstream_headers(recorder)["authorization"] == [f"Bearer {ROTATED_SECRET}"]

    # A secret file gone at reload: refused, the old policy (and credential) keep serving.
    setup["secret_file"].unlink()
    refused = httpx.post(f"{gw.admin_url}/admin/reload", timeout=10)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert "pools.filepool.credentials: credential file" in error and "does not exist" in error
    assert chat(gw, "m-file", {"x-api-key": "gw-client-key-three"}).status_code == 200
    assert last_upstream_headers(recorder)["authorization"] == [f"Bearer {ROTATED_SECRET}"]


POLICY = """pools:
  p:
    models: [m]
    instances: [{name: a, url: "http://127.0.0.1:8000"}]
    credentials: %s
"""


def test_policy_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SURELY_UNSET_KEY", raising=False)
    monkeypatch.setenv("KEY_WITH_ACCENT", "clé-secrète")
    cases = {
        "{from_env: KEY_WITH_ACCENT}": (
            "environment variable KEY_WITH_ACCENT holds characters outside ASCII"
        ),
        "{header: x-api-key, from_env: SURELY_UNSET_KEY}": (
            "p.yaml:5: pools.p.credentials: environment variable SURELY_UNSET_KEY "
            "(the pool's credential) is not set or empty"
        ),
        f'{{from_file: "{tmp_path / "absent"}"}}': (
            f"p.yaml:5: pools.p.credentials: credential file '{tmp_path / 'absent'}' does not exist"
        ),
        "{header: x-api-key}": "give exactly one of from_env or from_file",
        "{header: host, from_env: HOME}": "the header 'host' cannot carry a credential",
        "{header: x-gateway-key, from_env: HOME}": "cannot carry a credential",
    }
    for credentials, message in cases.items():
        with pytest.raises(PolicyError) as caught:
            parse_policy(POLICY % credentials, "p.yaml")
        assert message in str(caught.value), str(caught.value)

    empty = tmp_path / "keys"
    empty.write_text("# nobody yet\n\n")
    auth_cases = {
        f'{{api_keys_file: "{empty}"}}': "holds no key",
        "{api_keys_env: SURELY_UNSET_KEY}": "environment variable SURELY_UNSET_KEY",
        "{}": "give exactly one of api_keys_env or api_keys_file",
    }
    base = POLICY % "{from_env: HOME}"
    for auth, message in auth_cases.items():
        with pytest.raises(PolicyError) as caught:
            parse_policy(base + f"auth: {auth}\n", "p.yaml")
        assert "p.yaml:6: auth: " in str(caught.value) and message in str(caught.value)


def test_secrets_are_not_in_dumps_and_rotation_is_a_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_CRED", "value-one")
    monkeypatch.setenv("TEST_KEYS", "k1, k2")
    text = POLICY % "{header: x-api-key, from_env: TEST_CRED}" + "auth: {api_keys_env: TEST_KEYS}\n"
    before = parse_policy(text)
    assert before.auth is not None and before.auth.keys == ("k1", "k2")
    credentials = before.pools["p"].credentials
    assert credentials is not None and credentials.source == "env:TEST_CRED"
    shown = repr(before) + json.dumps(before.model_dump(mode="json"))
    assert "value-one" not in shown and "k1" not in shown
    assert diff_policies(before, parse_policy(text)).empty
    monkeypatch.setenv("TEST_CRED", "value-two")
    monkeypatch.setenv("TEST_KEYS", "k3")
    diff = diff_policies(before, parse_policy(text))
    assert diff.pools_changed == ["p"] and diff.auth_changed and not diff.restart_required


def test_client_auth_unit() -> None:
    assert presented_key([(b"authorization", b"Bearer abc")]) == b"abc"
    assert presented_key([(b"authorization", b"Basic abc"), (b"x-api-key", b"k")]) == b"k"
    assert presented_key([(b"x-api-key", b" k ")]) == b"k"
    assert presented_key([]) is None
    auth = ClientAuth()
    assert not auth.enabled
    policy = parse_policy(POLICY % "{from_env: HOME}" + "auth: {api_keys_env: HOME}\n").auth
    auth.update(policy)
    assert auth.enabled
    assert policy is not None
    key = policy.keys[0].encode()
    assert auth.allows([(b"x-api-key", key)])
    assert not auth.allows([(b"x-api-key", key + b"x")])
    assert not auth.allows([(b"authorization", b"Bearer ")])
    auth.update(None)
    assert not auth.enabled
