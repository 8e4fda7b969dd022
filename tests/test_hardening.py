"""Connection hardening end to end: a real gateway process and raw sockets.

Slowloris and slow-body connections are closed (408) while normal traffic flows, oversized
headers / URIs are refused (431 / 414), a connection cap answers a fast 503, and
X-Forwarded-For is believed only from trusted proxies. Each refusal is counted by reason
(`/admin/state`'s `ingress.refusals`, `gateway_ingress_refusals_total`).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.ingress.forwarded import TrustedProxies
from gateway.ingress.headers import split_request_headers
from gateway.ingress.refusals import REASONS
from loadtests.procs import wait_until
from tests.support import Backend, Gateway, pool_policy, running_backends, start_gateway

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 1.0
MARGIN_S = 1.0
MAX_CONNECTIONS = 20
LIMITS = f"""
limits:
  header_timeout: {int(HEADER_TIMEOUT_S * 1000)}ms
  body_timeout: {int(BODY_TIMEOUT_S * 1000)}ms
  max_header_bytes: 4KiB
  max_headers: 20
  max_uri_bytes: 1KiB
"""
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("a",), ["m"], "--ttft", "0", "--per-token", "0")


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    policy = pool_policy(backends, top=LIMITS)
    gw = start_gateway(tmp_path_factory.mktemp("hardening") / "policy.yaml", policy)
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def clean_backends(backends: dict[str, Backend]) -> None:
    for backend in backends.values():
        backend.reset()


def _refusals(gateway: Gateway) -> dict[str, int]:
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
    refusals: dict[str, int] = state["ingress"]["refusals"]
    return refusals


class _Counted:
    """The refusals counted while the block ran, by reason (the module's gateway is shared)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._before: dict[str, int] = {}
        self.delta: dict[str, int] = {}

    def __enter__(self) -> _Counted:
        self._before = _refusals(self._gateway)
        return self

    def __exit__(self, *exc: object) -> None:
        after = _refusals(self._gateway)
        self.delta = {r: n - self._before[r] for r, n in after.items() if n != self._before[r]}


def _port(gateway: Gateway) -> int:
    return gateway.proc.port("data")


def _connect(gateway: Gateway, timeout_s: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", _port(gateway)), timeout=timeout_s)


def _request(
    path: str = "/v1/chat/completions", extra: bytes = b"", body: bytes | None = None
) -> bytes:
    payload = json.dumps(BODY).encode() if body is None else body
    return (
        b"POST "
        + path.encode()
        + b" HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        + extra
        + b"content-length: %d\r\n\r\n" % len(payload)
        + payload
    )


def _read_response(sock: socket.socket) -> bytes:
    """One response (Content-Length framed), or what came before the server closed."""
    return _read_responses(sock, 1)[0]


def _read_responses(sock: socket.socket, count: int) -> list[bytes]:
    """`count` responses in a row (pipelined ones may arrive in one read), each Content-Length
    framed; the last one is what came before the server closed, if it closed early."""
    responses: list[bytes] = []
    data = b""
    while len(responses) < count:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")[1:]
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            if len(body) >= length:
                end = len(head) + len(sep) + length
                responses.append(data[:end])
                data = data[end:]
                continue
        try:
            part = sock.recv(65536)
        except ConnectionResetError:
            part = b""
        if not part:
            responses.append(data)
            break
        data += part
    return responses


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def _error_code(response: bytes) -> str:
    code: str = json.loads(response.partition(b"\r\n\r\n")[2])["error"]["code"]
    return code


def _closed_within(sock: socket.socket, timeout_s: float) -> tuple[bool, bytes]:
    """Wait (bounded) for the server to close; returns (closed, what it sent)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while part := sock.recv(65536):
            data += part
    except TimeoutError:
        return False, data
    except ConnectionResetError:
        pass
    return True, data


def _trickle(
    gateway: Gateway, sock: socket.socket, payload: bytes, step: int, client: httpx.Client
) -> tuple[int, bytes, int]:
    """Send `payload` `step` bytes every 0.1 s, one normal request between two sends, until the
    gateway closes the connection. Returns (bytes sent until then, what it sent back, normal
    OKs)."""
    sock.settimeout(0.1)
    ok = 0
    sent = 0
    received = b""
    for offset in range(0, len(payload), step):
        try:
            sock.sendall(payload[offset : offset + step])
            sent = offset + step
            part = sock.recv(65536)
        except TimeoutError:
            response = client.post("/v1/chat/completions", json=BODY)
            assert response.status_code == 200
            ok += 1
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        received += part
        if not part:
            break
        _closed, rest = _closed_within(sock, MARGIN_S)
        received += rest
        break
    return min(sent, len(payload)), received, ok


def test_slowloris_is_closed_with_408_while_normal_traffic_flows(gateway: Gateway) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n" + b"x-slow: " + b"a" * 200
    with (
        _Counted(gateway) as counted,
        _connect(gateway) as sock,
        httpx.Client(base_url=gateway.url, timeout=10) as client,
    ):
        sent, received, ok = _trickle(gateway, sock, head, 1, client)
    assert counted.delta == {"header_timeout": 1}
    # Cut while the head was still arriving (it takes 20 s at this pace): the deadline runs
    # from the connection's start, each trickled byte does not move it.
    assert sent < len(head)
    assert _status(received) == 408
    assert _error_code(received) == "request_timeout"
    assert ok >= 1  # normal requests were served meanwhile (how many: the machine's pace)


def test_slow_body_is_closed_with_408_while_normal_traffic_flows(gateway: Gateway) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 1000\r\n\r\n"
    with (
        _Counted(gateway) as counted,
        _connect(gateway) as sock,
        httpx.Client(base_url=gateway.url, timeout=10) as client,
    ):
        sock.sendall(head)
        sent, received, ok = _trickle(gateway, sock, b"x" * 1000, 10, client)
    assert counted.delta == {"body_timeout": 1}
    # Cut while the body was still arriving (it takes 10 s at this pace): the deadline runs
    # from the end of the headers, each trickled chunk does not move it.
    assert sent < 1000
    assert _status(received) == 408
    assert ok >= 1


def test_a_silent_connection_is_closed_without_an_answer(gateway: Gateway) -> None:
    with _Counted(gateway) as counted, _connect(gateway) as sock:
        started = time.monotonic()
        closed, received = _closed_within(sock, HEADER_TIMEOUT_S + MARGIN_S)
    assert closed and received == b""
    assert counted.delta == {}  # nothing was refused: nobody asked
    assert time.monotonic() - started >= HEADER_TIMEOUT_S * 0.8


def test_an_idle_keep_alive_connection_outlives_the_header_timeout(gateway: Gateway) -> None:
    with _connect(gateway) as sock:
        for _ in range(2):
            sock.sendall(_request())
            assert _status(_read_response(sock)) == 200
            time.sleep(HEADER_TIMEOUT_S * 2)  # idle between requests: uvicorn's keep-alive


def test_a_header_too_large_gets_431(gateway: Gateway) -> None:
    with _Counted(gateway) as counted, _connect(gateway) as sock:
        sock.sendall(_request(extra=b"x-big: " + b"a" * 5000 + b"\r\n"))
        response = _read_response(sock)
    assert _status(response) == 431
    assert _error_code(response) == "headers_too_large"
    assert counted.delta == {"headers_too_large": 1}
    assert b"connection: close" in response


def test_a_header_that_never_ends_gets_431(gateway: Gateway) -> None:
    """The parser buffers an unfinished header: the raw head is capped too."""
    with _Counted(gateway) as counted, _connect(gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nx-big: " + b"a" * 20_000)
        closed, response = _closed_within(sock, MARGIN_S)
    assert closed and _status(response) == 431
    assert counted.delta == {"headers_too_large": 1}


def test_pipelined_requests_are_served_and_capped_alike(gateway: Gateway) -> None:
    with _connect(gateway) as sock:
        sock.sendall(_request() + _request())
        assert [_status(r) for r in _read_responses(sock, 2)] == [200, 200]
        # A pipelined head over the cap (its start in the chunk that ended the previous
        # request): refused too; with responses still owed, the connection is just closed.
        with _Counted(gateway) as counted:
            sock.sendall(_request() + _request(extra=b"x-big: " + b"a" * 5000 + b"\r\n"))
            closed, received = _closed_within(sock, MARGIN_S)
    assert closed
    assert b"431" not in received
    assert counted.delta == {"headers_too_large": 1}  # refused, if unanswered


def test_too_many_headers_get_431(gateway: Gateway) -> None:
    extra = b"".join(b"x-h%d: 1\r\n" % i for i in range(30))
    with _Counted(gateway) as counted, _connect(gateway) as sock:
        sock.sendall(_request(extra=extra))
        response = _read_response(sock)
    assert _status(response) == 431
    assert counted.delta == {"too_many_headers": 1}


def test_headers_within_the_caps_pass(gateway: Gateway) -> None:
    extra = b"".join(b"x-h%d: %s\r\n" % (i, b"a" * 150) for i in range(15))
    with _Counted(gateway) as counted, _connect(gateway) as sock:
        sock.sendall(_request(path="/v1/chat/completions?" + "q" * 900, extra=extra))
        assert _status(_read_response(sock)) == 200
    assert counted.delta == {}


def test_a_long_uri_gets_414(gateway: Gateway) -> None:
    with _Counted(gateway) as counted, _connect(gateway) as sock:
        sock.sendall(_request(path="/v1/chat/completions?" + "q" * 2000))
        response = _read_response(sock)
    assert _status(response) == 414
    assert _error_code(response) == "uri_too_long"
    assert b"x-gateway-error: uri_too_long\r\n" in response  # the gateway's, not a backend's
    assert counted.delta == {"uri_too_long": 1}


def test_x_forwarded_for_from_an_untrusted_peer_is_replaced(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    headers = {"x-forwarded-for": "203.0.113.7", "x-forwarded-proto": "https"}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=BODY, headers=headers)
    assert response.status_code == 200
    (record,) = backends["a"].requests()
    assert record["headers"]["x-forwarded-for"] == "127.0.0.1"
    assert record["headers"]["x-forwarded-proto"] == "http"


def test_connection_cap_answers_a_fast_503_and_recovers(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    top = f"limits: {{max_connections: {MAX_CONNECTIONS}}}"
    gw = start_gateway(tmp_path / "policy.yaml", pool_policy(backends, top=top))
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = _connect(gw)
            held.append(sock)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
            assert _status(_read_response(sock)) == 200  # kept alive, idle
        with _connect(gw) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
            response = _read_response(extra)
        assert _status(response) == 503
        assert _error_code(response) == "too_many_connections"
        assert b"retry-after: 1" in response
        # Answered while every held connection stayed open: the refusal did not wait for a
        # slot to free up, nor close anyone else's connection to make one.
        for sock in held:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
            assert _status(_read_response(sock)) == 200
        # Counted on /metrics too, every reason exported from the start (a fresh gateway).
        metrics = httpx.get(f"{gw.admin_url}/metrics", timeout=5).text
        (family,) = [
            f
            for f in text_string_to_metric_families(metrics)
            if f.name == "gateway_ingress_refusals"
        ]
        counts = {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
        assert counts == {reason: 1.0 if reason == "over_capacity" else 0.0 for reason in REASONS}
        assert _refusals(gw) == {reason: int(n) for reason, n in counts.items()}
        for sock in held[:5]:
            sock.close()
        del held[:5]

        def served() -> bool:
            with _connect(gw) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
                return _status(_read_response(sock)) == 200

        assert wait_until(served, timeout_s=5.0, interval_s=0.05)
    finally:
        for sock in held:
            sock.close()
        gw.stop()


def test_x_forwarded_for_from_a_trusted_proxy_is_kept(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    top = """
limits: {trusted_proxies: [127.0.0.1/32]}
telemetry: {access_log: true, log_format: json}
"""
    gw = start_gateway(tmp_path / "policy.yaml", pool_policy(backends, top=top))
    try:
        headers = {"x-forwarded-for": "203.0.113.7, 127.0.0.1", "x-forwarded-proto": "https"}
        response = httpx.post(f"{gw.url}/v1/chat/completions", json=BODY, headers=headers)
        assert response.status_code == 200
    finally:
        gw.stop()
    (record,) = backends["a"].requests()
    assert record["headers"]["x-forwarded-for"] == "203.0.113.7, 127.0.0.1, 127.0.0.1"
    assert record["headers"]["x-forwarded-proto"] == "https"
    lines = [json.loads(line) for line in gw.proc.lines if line.startswith("{")]
    (access,) = [line for line in lines if line["logger"] == "gateway.access"]
    assert access["client"] == "203.0.113.7"  # the rightmost untrusted address


def test_trusted_proxies_units() -> None:
    trusted = TrustedProxies(["10.0.0.0/8", "::1/128"])
    assert "10.1.2.3" in trusted and "[::1]:80" in trusted and "::ffff:10.0.0.1" in trusted
    assert "192.0.2.1" not in trusted and "unknown" not in trusted
    assert trusted.client("192.0.2.1, 10.0.0.2", "10.0.0.1") == "192.0.2.1"
    assert trusted.client("10.0.0.3, 10.0.0.2", "10.0.0.1") == "10.0.0.3"
    assert not TrustedProxies([])
    out = split_request_headers([(b"x-forwarded-for", b"1.2.3.4")], "10.0.0.9", "http", trusted)
    assert out.client == "1.2.3.4"
    assert ("x-forwarded-for", "1.2.3.4, 10.0.0.9") in out.forward
    spoofed = split_request_headers([(b"x-forwarded-for", b"1.2.3.4")], "192.0.2.1", "http")
    assert spoofed.client == "192.0.2.1"
    assert ("x-forwarded-for", "192.0.2.1") in spoofed.forward
