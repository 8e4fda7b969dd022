"""Traces end to end: a gateway process exporting with the real OTLP exporter to an in-test
receiver on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.procs import wait_until
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support import (
    Backend,
    Gateway,
    closed_port,
    pool_policy,
    running_backends,
    start_gateway,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CANARY = "sk-canary-7f3a9c0d1e"


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("good", "bad"), ["m"], "--ttft", "0.01", "--per-token", "0.001")


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


def traced_gateway(
    tmp_path: Path, backends: dict[str, Backend], traces_url: str, sampler: str = "always_on"
) -> Gateway:
    policy = pool_policy(
        backends,
        "breaker: {consecutive_failures: 1000, error_rate: 1.0}",
        top="telemetry: {service_name: gw-under-test, tracing: true, access_log: true}",
    )
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": traces_url,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "",
        "OTEL_TRACES_SAMPLER": sampler,
    }
    return start_gateway(tmp_path / "policy.yaml", policy, env)


@pytest.fixture
def gateway(
    tmp_path: Path, backends: dict[str, Backend], receiver: OtlpReceiver
) -> Iterator[Gateway]:
    gw = traced_gateway(tmp_path, backends, receiver.traces_url)
    yield gw
    gw.stop()


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return sorted(
        (s for s in spans if s.parent_span_id == parent.span_id), key=lambda s: s.start_ns
    )


def test_a_retried_request_is_one_server_span_with_two_attempts(
    backends: dict[str, Backend], gateway: Gateway, receiver: OtlpReceiver
) -> None:
    backends["bad"].set_faults(error_rate=1.0, error_status=503)
    try:
        for _ in range(40):  # the balancer picks at random: wait for a request bad answered first
            response = httpx.post(
                f"{gateway.url}/v1/chat/completions",
                json=BODY,
                headers={"authorization": f"Bearer {CANARY}"},
                timeout=10,
            )
            assert response.status_code == 200
            if response.headers["x-gateway-attempts"] == "2":
                break
        assert response.headers["x-gateway-attempts"] == "2"
        bad_sent = [r["headers"].get("traceparent", "") for r in backends["bad"].requests()]
    finally:
        backends["bad"].reset()

    def retried_server_span(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
        return next(
            (s for s in spans if s.kind == "SERVER" and s.attributes.get("gateway.attempts") == 2),
            None,
        )

    assert receiver.wait_for(
        lambda spans: (
            (server := retried_server_span(spans)) is not None and len(children(spans, server)) == 2
        ),
        timeout_s=10,
    )
    spans = receiver.spans
    server = retried_server_span(spans)
    assert server is not None
    assert server.name == "POST /v1/chat/completions" and server.is_root
    assert server.resource["service.name"] == "gw-under-test"
    assert server.attributes["http.request.method"] == "POST"
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.request.model"] == "m"
    assert server.attributes["gateway.pool"] == "chat"
    assert server.attributes["gateway.instance"] == "good"
    assert server.attributes["gateway.streamed"] is False
    assert server.attributes["gateway.time_to_first_byte_s"] > 0
    assert "retry scheduled" in server.event_names()
    retry = next(e for e in server.events if e[0] == "retry scheduled")
    assert retry[1]["gateway.retry.reason"] == "http_503"
    first, second = children(spans, server)
    assert (first.kind, second.kind) == ("CLIENT", "CLIENT")
    assert first.attributes["gateway.instance"] == "bad"
    assert first.attributes["gateway.attempt"] == 1
    assert first.attributes["gateway.outcome"] == "http_503"
    assert first.attributes["error.type"] == "503"  # the conventions' form: the status code
    assert first.status_code == "ERROR"
    assert first.attributes["http.response.status_code"] == 503
    assert second.attributes["gateway.instance"] == "good"
    assert second.attributes["gateway.attempt"] == 2
    assert second.attributes["gateway.outcome"] == "ok"
    assert second.status_code != "ERROR"
    for attempt in (first, second):
        assert attempt.attributes["gateway.timeout.first_byte_s"] > 0
        assert attempt.attributes["gateway.timeout.connect_s"] > 0
        assert attempt.end_ns <= server.end_ns
    # Each backend got the traceparent of the attempt that called it.
    sent = backends["good"].requests()[-1]["headers"]
    assert sent["traceparent"].startswith(f"00-{server.trace_id}-{second.span_id}-")
    assert any(t.startswith(f"00-{server.trace_id}-{first.span_id}-") for t in bad_sent)
    # The access line names the trace, so logs lead to it (written in batches: it may follow
    # the span).
    assert wait_until(
        lambda: any(f"trace_id={server.trace_id}" in line for line in gateway.proc.lines),
        timeout_s=10,
    )
    # The client's credentials are in no span.
    assert not any(CANARY.encode() in body for body in receiver.raw_bodies)
    assert CANARY not in gateway.proc.output()


def test_an_incoming_traceparent_is_continued(
    gateway: Gateway, receiver: OtlpReceiver, backends: dict[str, Backend]
) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={**BODY, "stream": True},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=1"},
        timeout=10,
    )
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    assert receiver.wait_for(
        lambda spans: any(s.trace_id == trace_id and s.kind == "CLIENT" for s in spans), 10
    )
    spans = [s for s in receiver.spans if s.trace_id == trace_id]
    server = next(s for s in spans if s.kind == "SERVER")
    assert server.parent_span_id == parent_id
    assert server.attributes["gateway.streamed"] is True
    attempt = next(s for s in spans if s.kind == "CLIENT")
    assert attempt.parent_span_id == server.span_id
    # The stream's spans end with the stream, after the server span's first byte.
    assert attempt.end_ns > attempt.start_ns
    # Upstream got our attempt's context (the caller's tracestate travels with it).
    instance = attempt.attributes["gateway.instance"]
    sent = backends[str(instance)].requests()[-1]["headers"]
    assert sent["traceparent"].startswith(f"00-{trace_id}-{attempt.span_id}-")
    assert sent.get("tracestate") == "vendor=1"


def test_a_dead_collector_does_not_stop_the_gateway(
    tmp_path: Path, backends: dict[str, Backend]
) -> None:
    dead = f"http://127.0.0.1:{closed_port()}/v1/traces"
    gw = traced_gateway(tmp_path, backends, dead)
    try:
        with httpx.Client(timeout=10) as client:
            statuses = [
                client.post(f"{gw.url}/v1/chat/completions", json=BODY).status_code
                for _ in range(200)
            ]
        assert statuses == [200] * 200
        assert httpx.get(f"{gw.admin_url}/healthz", timeout=5).status_code == 200
    finally:
        exit_code = gw.proc.stop()
    # The last flush goes nowhere, and the exporter would retry it for a minute: the gateway
    # exited by itself all the same (0), rather than being killed once stop() ran out of
    # patience (-9).
    assert exit_code == 0


def test_an_unsampled_request_records_nothing_but_passes_its_context_on(
    tmp_path: Path, backends: dict[str, Backend], receiver: OtlpReceiver
) -> None:
    gw = traced_gateway(tmp_path, backends, receiver.traces_url, sampler="always_off")
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    try:
        for _ in range(5):
            response = httpx.post(
                f"{gw.url}/v1/chat/completions",
                json=BODY,
                headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
                timeout=10,
            )
            assert response.status_code == 200
    finally:
        gw.stop()  # flushes whatever was queued
    assert receiver.spans == []
    sent = [r["headers"].get("traceparent", "") for b in backends.values() for r in b.requests()]
    ours = [t for t in sent if t.startswith(f"00-{trace_id}-")]
    assert len(ours) == 5 and all(t.endswith("-00") for t in ours)


def test_a_resumed_stream_is_one_server_span_with_a_resume_event(
    backends: dict[str, Backend], gateway: Gateway, receiver: OtlpReceiver
) -> None:
    # Both instances cut their next stream after 2 tokens: two resumes, then whole.
    for backend in backends.values():
        backend.set_faults(die_next=1, die_after=2)
    try:
        body = {**BODY, "max_tokens": 8, "stream": True}
        response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in response.text
    finally:
        for backend in backends.values():
            backend.reset()

    def resumed(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
        return next(
            (s for s in spans if s.kind == "SERVER" and "stream resumed" in s.event_names()), None
        )

    assert receiver.wait_for(
        lambda spans: (server := resumed(spans)) is not None and len(children(spans, server)) == 3,
        timeout_s=10,
    )
    server = resumed(receiver.spans)
    assert server is not None
    assert server.attributes["gateway.resumes"] == 2
    assert server.attributes["gateway.attempts"] == 3
    events = [attrs for name, attrs in server.events if name == "stream resumed"]
    assert [e["gateway.resume.reason"] for e in events] == ["reset", "reset"]
    assert [e["gateway.resume.count"] for e in events] == [1, 2]
    # An attempt span each: the two that broke, and the one that finished the stream.
    attempts = children(receiver.spans, server)
    assert [a.status_code == "ERROR" for a in attempts] == [True, True, False]
    # The access line tells of the resumes (the headers went out before them).
    assert wait_until(
        lambda: any(
            f"trace_id={server.trace_id}" in line and "resumes=2" in line
            for line in gateway.proc.lines
        ),
        timeout_s=10,
    )
