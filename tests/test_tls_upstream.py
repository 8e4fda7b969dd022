"""HTTPS upstreams: a real TLS backend on loopback (the fake vLLM app under uvicorn with a
certificate from an in-test CA), and a gateway process trusting that CA through `tls.ca_file`."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from gateway.config import PolicyError, parse_policy
from loadtests.asgi_server import Recorder, ThreadedServer
from loadtests.fake_vllm.app import build_app
from loadtests.fake_vllm.config import FakeConfig
from tests.support import LOOPBACK_LISTENERS, Gateway, start_gateway

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def certs(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("certs")
    server = ca.issue_cert("localhost", "127.0.0.1")
    paths = {
        "ca": folder / "ca.pem",
        "other_ca": folder / "other-ca.pem",
        "chain": folder / "server-chain.pem",
        "key": folder / "server-key.pem",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    trustme.CA().cert_pem.write_to_path(str(paths["other_ca"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    with paths["chain"].open("wb") as out:
        for blob in server.cert_chain_pems:
            out.write(blob.bytes())
    return paths


@pytest.fixture(scope="module")
def backend(certs: dict[str, Path]) -> Iterator[tuple[ThreadedServer, Recorder]]:
    fake = build_app(FakeConfig(name="a", models=("m",), ttft_s=0.005, per_token_s=0.0005))
    recorder = Recorder(fake)
    server = ThreadedServer(recorder, certfile=str(certs["chain"]), keyfile=str(certs["key"]))
    yield server, recorder
    server.stop()


def https_policy(
    port: int, tls: str, pool_settings: str = "", health: str = "{interval: 300ms, timeout: 250ms}"
) -> str:
    return f"""
{LOOPBACK_LISTENERS}
pools:
  chat:
    models: [m]
    instances: [{{name: a, url: "https://localhost:{port}"}}]
    tls: {tls}
    health: {health}
{pool_settings}
"""


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[list[Gateway]]:
    started: list[Gateway] = []
    yield started
    for gw in started:
        gw.stop()


def run(gateways: list[Gateway], tmp_path: Path, policy: str) -> Gateway:
    gw = start_gateway(tmp_path / f"policy-{len(gateways)}.yaml", policy)
    gateways.append(gw)
    return gw


def instance_state(gw: Gateway) -> dict[str, object]:
    state = httpx.get(f"{gw.admin_url}/admin/state", timeout=5).json()
    instance: dict[str, object] = state["pools"]["chat"]["instances"][0]
    return instance


def test_https_upstream_streams_reuses_connections_and_sends_sni(
    tmp_path: Path,
    certs: dict[str, Path],
    backend: tuple[ThreadedServer, Recorder],
    gateways: list[Gateway],
) -> None:
    server, recorder = backend
    gw = run(gateways, tmp_path, https_policy(server.port, f'{{ca_file: "{certs["ca"]}"}}'))
    recorder.requests.clear()
    with httpx.Client(timeout=10) as client:
        assert client.get(f"{gw.url}/readyz").status_code == 200  # health checked over TLS
        for _ in range(12):
            response = client.post(f"{gw.url}/v1/chat/completions", json=BODY)
            assert response.status_code == 200, response.text
            assert response.json()["choices"]
            assert response.headers["x-gateway-instance"] == "a"
        for _ in range(4):
            with client.stream(
                "POST", f"{gw.url}/v1/chat/completions", json={**BODY, "stream": True}
            ) as stream:
                assert stream.status_code == 200
                text = "".join(stream.iter_text())
            assert "data: [DONE]" in text
    proxied = [r for r in recorder.requests if r["path"].startswith("/v1/")]
    assert len(proxied) == 16
    # Sequential requests share kept-alive TLS connections (one per pool and host, plus
    # perhaps one the health checker had open at the time).
    assert len(recorder.connections("/v1/")) <= 3
    assert "localhost" in server.sni  # SNI: the URL's host name
    health = instance_state(gw)["health"]
    assert isinstance(health, dict)
    assert health["healthy"] is True and health["reason"] == "HTTP 200"


def test_untrusted_certificate_is_a_connect_failure(
    tmp_path: Path,
    certs: dict[str, Path],
    backend: tuple[ThreadedServer, Recorder],
    gateways: list[Gateway],
) -> None:
    server, _ = backend
    tls = f'{{ca_file: "{certs["other_ca"]}"}}'
    # Health checks on: the instance never passes one, so it takes no traffic.
    checked = run(gateways, tmp_path, https_policy(server.port, tls))
    assert httpx.get(f"{checked.url}/readyz", timeout=5).status_code == 503
    health = instance_state(checked)["health"]
    assert isinstance(health, dict)
    assert health["healthy"] is not True
    assert "Certificate" in str(health["reason"])
    refused = httpx.post(f"{checked.url}/v1/chat/completions", json=BODY, timeout=10)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_instance_available"

    # Health checks off: every attempt fails in the handshake, a connect failure (502).
    unchecked = run(gateways, tmp_path, https_policy(server.port, tls, health="{enabled: false}"))
    response = httpx.post(f"{unchecked.url}/v1/chat/completions", json=BODY, timeout=10)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_connect_failed"
    metrics = httpx.get(f"{unchecked.admin_url}/metrics", timeout=5).text
    assert 'outcome="connect_failure"' in metrics


def test_a_hanging_handshake_is_a_connect_timeout(
    tmp_path: Path, certs: dict[str, Path], gateways: list[Gateway]
) -> None:
    # The kernel completes the TCP handshake for a listening socket nobody accepts from:
    # the ClientHello is never answered.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        settings = """    timeouts: {connect: 300ms, initial: 20s}
    retries: {tiers: [{below: 1.0, max_retries: 0, backoff: 10ms, k: [1.0, 1.0]}]}"""
        policy = https_policy(
            port, f'{{ca_file: "{certs["ca"]}"}}', settings, health="{enabled: false}"
        )
        gw = run(gateways, tmp_path, policy)
        response = httpx.post(f"{gw.url}/v1/chat/completions", json=BODY, timeout=15)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "upstream_timeout"
        # The connect timeout ended the one attempt, not the 20 s first-byte one.
        metrics = httpx.get(f"{gw.admin_url}/metrics", timeout=5).text
        timeouts = {
            phase: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("gateway_timeouts_total{")
            for phase in ("connect", "first_byte", "idle")
            if f'phase="{phase}"' in line
        }
        assert timeouts.get("connect") == 1
        assert timeouts.get("first_byte", 0) == 0


def test_verify_false_works_and_warns(
    tmp_path: Path, backend: tuple[ThreadedServer, Recorder], gateways: list[Gateway]
) -> None:
    server, _ = backend
    gw = run(gateways, tmp_path, https_policy(server.port, "{verify: false}"))
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=BODY, timeout=10)
    assert response.status_code == 200
    assert "TLS certificate verification is off" in gw.proc.output()


def test_default_tls_rejects_a_private_ca(
    tmp_path: Path, backend: tuple[ThreadedServer, Recorder], gateways: list[Gateway]
) -> None:
    """Without a `tls` section, https:// instances are verified against the system's CAs."""
    server, _ = backend
    policy = https_policy(server.port, "{verify: true}", health="{enabled: false}")
    gw = run(gateways, tmp_path, policy)
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=BODY, timeout=10)
    assert response.status_code == 502


def test_tls_policy_errors(tmp_path: Path) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    base = """pools:
  chat:
    models: [m]
    instances: [{name: a, url: "https://localhost:8443"}]
    tls: {ca_file: "%s"}
"""
    for path, message in (
        (tmp_path / "missing.pem", "does not exist"),
        (not_pem, "holds no valid PEM certificate"),
    ):
        with pytest.raises(PolicyError) as caught:
            parse_policy(base % path, "p.yaml")
        assert str(caught.value).startswith("p.yaml:5: pools.chat.tls: CA file")
        assert message in str(caught.value)
    with pytest.raises(PolicyError, match="verify"):
        parse_policy(base.replace('ca_file: "%s"', "verify: maybe"), "p.yaml")


def test_a_rotated_ca_file_is_a_changed_pool(tmp_path: Path, ca: trustme.CA) -> None:
    from gateway.reload import diff_policies

    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    text = f"""pools:
  chat:
    models: [m]
    instances: [{{name: a, url: "https://localhost:8443"}}]
    tls: {{ca_file: "{ca_path}"}}
"""
    before = parse_policy(text)
    assert diff_policies(before, parse_policy(text)).empty
    trustme.CA().cert_pem.write_to_path(str(ca_path))
    diff = diff_policies(before, parse_policy(text))
    assert diff.pools_changed == ["chat"] and not diff.restart_required
    json.dumps(diff.summary())  # still plain data
