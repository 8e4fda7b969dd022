"""Structured logs: escaping, both formats, and the access line of a real gateway."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.telemetry.logs import AccessLogSwitch, JsonFormatter, TextFormatter, escape
from loadtests.procs import wait_until
from tests.support import (
    Backend,
    Gateway,
    pool_policy,
    running_backends,
    start_gateway,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
EVIL_MODEL = 'evil\nFAKE 200 model="x"\x1b[31m'


def record(message: str, **fields: object) -> logging.LogRecord:
    rec = logging.LogRecord("gateway.access", logging.INFO, __file__, 1, message, (), None)
    rec.fields = fields
    return rec


def test_escape_keeps_a_value_on_one_line_and_in_one_field() -> None:
    assert escape("plain") == "plain"
    assert escape("two words") == '"two words"'
    assert escape("a=b") == '"a=b"'
    assert escape("") == '""'
    assert escape('x\n"y"\x1b\\') == '"x\\n\\"y\\"\\x1b\\\\"'


def test_text_lines_carry_escaped_fields() -> None:
    line = TextFormatter().format(record("access", status=404, model=EVIL_MODEL, ok=False))
    assert "\n" not in line and "\x1b" not in line
    assert line.endswith('status=404 model="evil\\nFAKE 200 model=\\"x\\"\\x1b[31m" ok=false')


def test_json_lines_are_one_object_each() -> None:
    line = JsonFormatter().format(record("access", status=404, model=EVIL_MODEL))
    assert "\n" not in line and "\x1b" not in line
    data = json.loads(line)
    assert data["msg"] == "access" and data["logger"] == "gateway.access"
    assert data["model"] == EVIL_MODEL and data["status"] == 404
    assert data["ts"].endswith("Z")


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("a",), ["m"], "--ttft", "0.01", "--per-token", "0.001")


def gateway_with(tmp_path: Path, backends: dict[str, Backend], telemetry: str) -> Gateway:
    policy = pool_policy(backends, top=f"telemetry: {telemetry}")
    return start_gateway(tmp_path / "policy.yaml", policy)


def access_lines(gateway: Gateway) -> list[str]:
    return [line for line in gateway.proc.lines if "gateway.access" in line]


def test_json_access_log_of_a_real_gateway(tmp_path: Path, backends: dict[str, Backend]) -> None:
    gw = gateway_with(tmp_path, backends, "{log_format: json, access_log: true}")
    try:
        ok = httpx.post(f"{gw.url}/v1/chat/completions", json=BODY, timeout=10)
        bad = httpx.post(
            f"{gw.url}/v1/chat/completions", json={**BODY, "model": EVIL_MODEL}, timeout=10
        )
        assert (ok.status_code, bad.status_code) == (200, 404)
    finally:
        gw.stop()
    lines = [json.loads(line) for line in gw.proc.lines if line.startswith("{")]
    ready = [line for line in lines if line["msg"] == "gateway READY"]
    assert ready and "data" in ready[0]
    access = [line for line in lines if line["logger"] == "gateway.access"]
    assert len(access) == 2
    served, refused = access
    assert served["status"] == 200 and served["pool"] == "chat" and served["model"] == "m"
    assert served["instance"] == "a" and served["attempts"] == 1
    assert served["streamed"] is False and served["duration_s"] >= served["ttfb_s"] > 0
    assert refused["status"] == 404 and refused["model"] == EVIL_MODEL


def test_the_access_log_is_off_by_default(tmp_path: Path, backends: dict[str, Backend]) -> None:
    gw = gateway_with(tmp_path, backends, "{}")
    try:
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=BODY, timeout=10).is_success
    finally:
        gw.stop()
    assert access_lines(gw) == []
    assert any("gateway READY data=" in line for line in gw.proc.lines)


def test_text_access_log_escapes_client_values(
    tmp_path: Path, backends: dict[str, Backend]
) -> None:
    gw = gateway_with(tmp_path, backends, "{access_log: true}")
    try:
        httpx.post(f"{gw.url}/v1/chat/completions", json={**BODY, "model": EVIL_MODEL}, timeout=10)
    finally:
        gw.stop()
    (line,) = access_lines(gw)
    assert "status=404" in line and '"evil\\nFAKE 200' in line
    assert not any(line.startswith("FAKE") for line in gw.proc.lines)


async def test_turning_the_access_log_off_writes_its_buffer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A reload's switch: the log turned off writes what it holds and keeps no flush timer;
    the one turned on keeps the format chosen at startup."""
    switch = AccessLogSwitch("json", True)
    try:
        first = switch.current
        assert first is not None
        first.write({"status": 200})
        assert first._timer is not None  # the batch waits for its flush
        assert switch.set(True) is first  # no change, no new log
        assert switch.set(False) is None and switch.current is None
        assert first._timer is None
        (line,) = capsys.readouterr().err.splitlines()
        assert json.loads(line)["status"] == 200
        second = switch.set(True)
        assert second is not None and second is not first and switch.current is second
        second.write({"status": 201})
        second.flush()
        assert json.loads(capsys.readouterr().err)["status"] == 201
    finally:
        switch.set(False)


def test_a_client_leaving_mid_stream_is_told_in_the_access_line(
    tmp_path: Path, backends: dict[str, Backend]
) -> None:
    """Its status went out with the first byte (200, as Envoy logs it), and the line says the
    client left before the end: a stream it did not take whole is not a plain 200."""
    gw = gateway_with(tmp_path, backends, "{log_format: json, access_log: true}")
    try:
        stream = {**BODY, "stream": True, "max_tokens": 4000}  # about 4 s at 1 ms a token
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=stream, timeout=10) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
        # The client is gone: its line is written once the gateway sees it.
        assert wait_until(lambda: access_lines(gw), 10.0)
        whole = httpx.post(f"{gw.url}/v1/chat/completions", json=BODY, timeout=10)
        assert whole.status_code == 200
    finally:
        gw.stop()
    left, taken = [json.loads(line) for line in access_lines(gw)]
    assert left["status"] == 200 and left["streamed"] is True and left["client_left"] is True
    assert taken["status"] == 200 and "client_left" not in taken
