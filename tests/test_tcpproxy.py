"""The fault-injecting TCP proxy, run as a real process between httpx and fake vLLM backends."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from loadtests.chaos.tcpproxy import FaultError, FaultProxy
from loadtests.procs import ManagedProcess, python_module, wait_until

CHAT = "/v1/chat/completions"


def start_backend(name: str, models: str, per_token: str) -> ManagedProcess:
    return ManagedProcess(
        python_module(
            "loadtests.fake_vllm",
            *("--port", "0", "--name", name, "--models", models),
            *("--ttft", "0", "--per-token", per_token),
        )
    )


def start_proxy(upstream_port: int) -> ManagedProcess:
    return ManagedProcess(
        python_module(
            "loadtests.chaos.tcpproxy",
            *("--listen-port", "0", "--upstream", f"127.0.0.1:{upstream_port}"),
            *("--control-port", "0", "--seed", "1"),
        )
    )


@pytest.fixture(scope="module")
def backend_a() -> Iterator[ManagedProcess]:
    proc = start_backend("a", "m", "0")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def backend_b() -> Iterator[ManagedProcess]:
    """Streams one token every 10 ms, and serves a model `a` does not."""
    proc = start_backend("b", "m,b-only", "0.01")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def proxy_proc(backend_a: ManagedProcess) -> Iterator[ManagedProcess]:
    proc = start_proxy(backend_a.port())
    yield proc
    assert proc.stop() == 0, proc.output()


@dataclass
class Proxy:
    proc: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proc.port()}"

    def control(self, method: str, path: str, body: Any = None) -> httpx.Response:
        url = f"http://127.0.0.1:{self.proc.port('control')}{path}"
        if isinstance(body, bytes):
            return httpx.request(method, url, content=body, timeout=5, trust_env=False)
        return httpx.request(method, url, json=body, timeout=5, trust_env=False)

    def set(self, **faults: Any) -> dict[str, Any]:
        response = self.control("POST", "/faults", faults)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.control("GET", "/stats").json()
        return result

    def client(self, **kwargs: Any) -> httpx.Client:
        """A client of its own, so each test opens its own connections through the proxy."""
        kwargs.setdefault("timeout", 5.0)
        return httpx.Client(base_url=self.url, trust_env=False, **kwargs)


@pytest.fixture
def proxy(proxy_proc: ManagedProcess, backend_a: ManagedProcess) -> Iterator[Proxy]:
    p = Proxy(proxy_proc)
    p.control("POST", "/reset").raise_for_status()
    p.control("POST", "/upstream", {"host": "127.0.0.1", "port": backend_a.port()})
    p.control("GET", "/upstream").raise_for_status()
    yield p
    # Every connection a test opened is gone once its clients are.
    assert wait_until(lambda: p.stats()["active"] == 0, timeout_s=2.0), p.stats()


def chat(max_tokens: int = 5, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": max_tokens, "stream": stream, **extra}


def model_ids(client: httpx.Client) -> set[str]:
    response = client.get("/v1/models")
    response.raise_for_status()
    return {m["id"] for m in response.json()["data"]}


def test_passes_requests_through(proxy: Proxy) -> None:
    before = proxy.stats()
    with proxy.client() as client:
        response = client.post(CHAT, json=chat())
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "length"
        streamed = client.post(CHAT, json=chat(stream=True))
        assert streamed.text.rstrip().endswith("data: [DONE]")
    stats = proxy.stats()
    assert stats["accepted"] == before["accepted"] + 1  # both requests on one connection
    assert stats["bytes_to_upstream"] > before["bytes_to_upstream"]
    assert stats["bytes_to_client"] >= before["bytes_to_client"] + len(response.content)
    assert stats["listening"] is True


def test_latency_delays_both_directions(proxy: Proxy) -> None:
    proxy.set(latency=0.15)
    with proxy.client() as client:
        client.post(CHAT, json=chat()).raise_for_status()  # connection set up
        started = time.monotonic()
        client.post(CHAT, json=chat()).raise_for_status()
        elapsed = time.monotonic() - started
    assert elapsed >= 2 * 0.15 - 0.01  # the request, then the response, each held 0.15 s


def test_jitter_keeps_the_order_of_a_stream(proxy: Proxy, backend_b: ManagedProcess) -> None:
    """Chunks 10 ms apart, each delayed by a random 0-50 ms more: arrival order must hold."""
    proxy.control("POST", "/upstream", {"host": "127.0.0.1", "port": backend_b.port()})
    proxy.set(latency=0.01, jitter=0.05)
    with proxy.client() as client:
        body = client.post(CHAT, json=chat(max_tokens=20, stream=True)).text
    events = [e.removeprefix("data: ") for e in body.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    words = "".join(
        choice["delta"].get("content") or ""
        for event in events[:-1]
        for choice in json.loads(event)["choices"]
    )
    assert len(words.split()) == 20


def test_bandwidth_caps_each_direction(proxy: Proxy) -> None:
    proxy.set(bandwidth=100_000)
    prompt = "x " * 100_000  # a 200 KB request body
    with proxy.client() as client:
        started = time.monotonic()
        response = client.post(CHAT, json=chat(messages=[{"role": "user", "content": prompt}]))
        elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert elapsed >= 1.5


def test_refuse_refuses_new_connections_and_keeps_open_ones(proxy: Proxy) -> None:
    with proxy.client() as open_client:
        open_client.post(CHAT, json=chat()).raise_for_status()
        proxy.set(mode="refuse")
        # Refused outright: a connect left to time out would raise TimeoutError here and
        # httpx's ConnectTimeout (not a ConnectError) below.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.proc.port()), timeout=2).close()
        with proxy.client() as client, pytest.raises(httpx.ConnectError):
            client.post(CHAT, json=chat())
        assert proxy.stats()["listening"] is False
        # A keep-alive connection accepted before is not affected.
        open_client.post(CHAT, json=chat()).raise_for_status()
    proxy.set(mode="pass")
    with proxy.client() as client:
        client.post(CHAT, json=chat()).raise_for_status()  # listening again, same port


def test_reset_cuts_an_in_flight_stream(proxy: Proxy, backend_b: ManagedProcess) -> None:
    proxy.control("POST", "/upstream", {"host": "127.0.0.1", "port": backend_b.port()})
    resets_before = proxy.stats()["resets"]
    received = b""
    with proxy.client() as client:
        with (
            pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)),
            client.stream("POST", CHAT, json=chat(max_tokens=200, stream=True)) as response,
        ):
            for chunk in response.iter_raw():
                if not received:
                    proxy.set(mode="reset")  # 2 s of stream still to come
                received += chunk
        assert b"[DONE]" not in received
        # New connections are reset too.
        with pytest.raises(httpx.TransportError):
            client.post(CHAT, json=chat())
    assert proxy.stats()["resets"] >= resets_before + 2


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_reset_after_bytes_sends_exactly_that_many_then_rst(proxy: Proxy) -> None:
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    received = b""
    with socket.create_connection(("127.0.0.1", proxy.proc.port()), timeout=5) as sock:
        sock.sendall(request)
        assert len(read_response(sock)) > 100
        # Counted from when it is set, also on a connection that already carried bytes.
        proxy.set(reset_after_bytes=100)
        sock.sendall(request)
        with pytest.raises(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    assert len(received) == 100
    assert received.startswith(b"HTTP/1.1 200")


def test_blackhole_swallows_requests_until_it_ends(proxy: Proxy) -> None:
    timeout = httpx.Timeout(5.0, read=0.5)
    with proxy.client(timeout=timeout) as old, proxy.client(timeout=timeout) as new:
        old.post(CHAT, json=chat()).raise_for_status()
        proxy.set(mode="blackhole")
        with pytest.raises(httpx.ReadTimeout):
            old.post(CHAT, json=chat())  # an open connection goes silent
        with pytest.raises(httpx.ReadTimeout):
            new.post(CHAT, json=chat())  # a new one is accepted, then nothing
        proxy.set(mode="pass")
        new.post(CHAT, json=chat()).raise_for_status()


def test_set_upstream_repoints_new_connections(
    proxy: Proxy, backend_a: ManagedProcess, backend_b: ManagedProcess
) -> None:
    with proxy.client() as before:
        assert model_ids(before) == {"m"}
        response = proxy.control(
            "POST", "/upstream", {"host": "127.0.0.1", "port": backend_b.port()}
        )
        assert response.json() == {"host": "127.0.0.1", "port": backend_b.port()}
        with proxy.client() as after:
            assert model_ids(after) == {"m", "b-only"}
        assert model_ids(before) == {"m"}  # its connection still goes to a
    assert proxy.control("GET", "/upstream").json()["port"] == backend_b.port()


def test_faults_merge_and_reset(proxy: Proxy) -> None:
    proxy.set(latency=0.01)
    merged = proxy.set(jitter=0.02, bandwidth=1e6)
    assert merged == {
        "latency": 0.01,
        "jitter": 0.02,
        "bandwidth": 1_000_000,
        "mode": "pass",
        "reset_after_bytes": 0,
    }
    assert proxy.control("GET", "/faults").json() == merged
    reset = proxy.control("POST", "/reset").json()
    assert reset["latency"] == 0 and reset["jitter"] == 0 and reset["bandwidth"] == 0


@pytest.mark.parametrize(
    "body",
    [
        {"latency": -1},
        {"latency": "0.1"},
        {"latency": True},
        b'{"jitter": 1e999}',  # infinity
        b"{nope",
        {"bandwidth": 1.5},
        {"bandwidth": -5},
        {"mode": "sideways"},
        {"reset_after_bytes": "10"},
        {"latency": 0.1, "nope": 1},  # the valid part is not applied either
        [1, 2],
        "pass",
    ],
)
def test_bad_faults_get_400_and_change_nothing(proxy: Proxy, body: Any) -> None:
    before = proxy.control("GET", "/faults").json()
    response = proxy.control("POST", "/faults", body)
    assert response.status_code == 400, response.text
    assert "error" in response.json()
    assert proxy.control("GET", "/faults").json() == before


def test_bad_control_requests(proxy: Proxy, backend_a: ManagedProcess) -> None:
    for body in ({"host": "", "port": 1}, {"host": "h", "port": 70000}, {"host": "h"}, {"x": 1}):
        assert proxy.control("POST", "/upstream", body).status_code == 400, body
    assert proxy.control("GET", "/upstream").json()["port"] == backend_a.port()
    assert proxy.control("GET", "/nope").status_code == 404
    assert proxy.control("GET", "/reset").status_code == 405


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stops_cleanly_closing_connections(backend_a: ManagedProcess, sig: int) -> None:
    proc = start_proxy(backend_a.port())
    try:
        with socket.create_connection(("127.0.0.1", proc.port()), timeout=5) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            proc.signal(sig)
            assert proc.proc.wait(5) == 0, proc.output()
            while sock.recv(65536):  # closed by the proxy: the read ends
                pass
    finally:
        assert proc.stop() == 0, proc.output()


async def echo_server(tag: bytes) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(tag + data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def exchange(port: int, message: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(message)
    await writer.drain()
    answer = await reader.read(65536)
    writer.close()
    return answer


async def test_in_process_api() -> None:
    first, second = await echo_server(b"1:"), await echo_server(b"2:")
    async with first, second:
        proxy = FaultProxy("127.0.0.1", first.sockets[0].getsockname()[1])
        await proxy.start()
        try:
            assert await exchange(proxy.port, b"hi") == b"1:hi"
            with pytest.raises(FaultError):
                await proxy.set_faults(latency=0.1, mode="bogus")
            assert proxy.faults.latency == 0
            proxy.set_upstream("127.0.0.1", second.sockets[0].getsockname()[1])
            await proxy.set_faults(latency=0.05)
            started = time.monotonic()
            assert await exchange(proxy.port, b"hi") == b"2:hi"
            assert time.monotonic() - started >= 0.09
            assert proxy.stats()["accepted"] == 2
        finally:
            await proxy.close()
        with pytest.raises(ConnectionRefusedError):
            await exchange(proxy.port, b"hi")
