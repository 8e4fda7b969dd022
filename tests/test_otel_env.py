"""The standard OTEL_* variables: the exporter (`OTEL_TRACES_EXPORTER`), OTLP/JSON
(`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json`) and the propagators (`OTEL_PROPAGATORS`),
end to end through a gateway process and a real OTLP receiver, and the refusals of what the
gateway cannot honour."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanKind

from gateway.config.models import TelemetryPolicy
from gateway.telemetry import tracing as tracing_module
from gateway.telemetry.otlp_encoder import FastOtlpSpanExporter
from gateway.telemetry.otlp_json import encode_json
from gateway.telemetry.tracing import TracingConfigError, setup_tracing
from tests.otlp_receiver import OtlpReceiver, _parse_otlp_json
from tests.support import Backend, Gateway, pool_policy, running_backends, start_gateway

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("a",), ["m"], "--ttft", "0", "--per-token", "0")


@pytest.fixture(autouse=True)
def clean_backends(backends: dict[str, Backend]) -> None:
    for backend in backends.values():
        backend.reset()


def the_request(backend: Backend) -> dict[str, str]:
    """The headers of the one chat request the backend got."""
    (record,) = [r for r in backend.requests() if r["path"] == "/v1/chat/completions"]
    headers: dict[str, str] = record["headers"]
    return headers


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


def gateway_with(tmp_path: Path, backends: dict[str, Backend], **env: str) -> Gateway:
    policy = pool_policy(backends, top="telemetry: {tracing: true}")
    settings = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_TRACES_SAMPLER": "always_on", **env}
    return start_gateway(tmp_path / "policy.yaml", policy, settings)


class _Kept(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: object) -> SpanExportResult:
        self.spans.extend(spans)  # type: ignore[call-overload]
        return SpanExportResult.SUCCESS


def test_the_json_body_is_the_protobuf_request_in_otlp_json() -> None:
    kept = _Kept()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("server", kind=SpanKind.SERVER) as server:
        server.set_attributes({"s": "x", "i": 2**40, "f": 0.5, "b": True, "l": ["a", "b"]})
        server.add_event("retry scheduled", {"gateway.attempt": 1})
        linked = server.get_span_context()
        with tracer.start_as_current_span("attempt", kind=SpanKind.CLIENT, links=[Link(linked)]):
            pass
    body = encode_json(kept.spans)
    # Ids in hex, as OTLP/JSON has them (the receiver refuses anything else), enums as numbers.
    assert b'"kind":2' in body and b'"kind":3' in body
    assert f'"traceId":"{linked.trace_id:032x}"'.encode() in body
    received = ExportTraceServiceRequest()
    _parse_otlp_json(body, received)
    assert received == encode_spans(kept.spans)


def one_request(
    tmp_path: Path,
    backends: dict[str, Backend],
    receiver: OtlpReceiver,
    headers: dict[str, str] | None = None,
    spans: int = 2,
    **env: str,
) -> dict[str, str]:
    """One chat request through a gateway with these OTEL_* settings, once `spans` spans have
    arrived (the gateway stopped, so nothing more comes); the headers its backend got."""
    gateway = gateway_with(
        tmp_path, backends, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.traces_url, **env
    )
    try:
        response = httpx.post(f"{gateway.url}/v1/chat/completions", json=BODY, headers=headers)
        assert response.status_code == 200
        assert receiver.wait_for(lambda received: len(received) >= spans, timeout_s=10)
    finally:
        gateway.stop()  # flushes what was queued
    return the_request(backends["a"])


def test_spans_go_out_as_otlp_json_when_asked(
    tmp_path: Path, backends: dict[str, Backend], receiver: OtlpReceiver
) -> None:
    one_request(
        tmp_path,
        backends,
        receiver,
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/json",
        OTEL_EXPORTER_OTLP_HEADERS="x-tenant=acme",
    )
    assert set(receiver.media_types) == {"application/json"}
    server = next(s for s in receiver.spans if s.kind == "SERVER")
    (attempt,) = [s for s in receiver.spans if s.kind == "CLIENT"]
    assert attempt.parent_span_id == server.span_id and attempt.trace_id == server.trace_id
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert attempt.attributes["gen_ai.usage.output_tokens"] == 3


def test_b3_headers_are_read_from_the_client_and_sent_to_the_backend(
    tmp_path: Path, backends: dict[str, Backend], receiver: OtlpReceiver
) -> None:
    trace_id, client_span = "463ac35c9f6413ad48485a3953bb6124", "a2fb4a1d1a96d312"
    # Debug-flagged (sampled, as B3 says), with the client's own parent named.
    sent = {
        "x-b3-traceid": trace_id,
        "x-b3-spanid": client_span,
        "x-b3-parentspanid": "00f067aa0ba902b7",
        "x-b3-flags": "1",
    }
    headers = one_request(tmp_path, backends, receiver, sent, OTEL_PROPAGATORS="b3multi")
    server = next(s for s in receiver.spans if s.kind == "SERVER")
    (attempt,) = [s for s in receiver.spans if s.kind == "CLIENT"]
    assert server.trace_id == trace_id and server.parent_span_id == client_span
    # The backend hears of the attempt's span, in the same format, and of nothing the client
    # sent about its own (no stale parent, no second context), nor any W3C header.
    assert headers["x-b3-traceid"] == trace_id
    assert headers["x-b3-spanid"] == attempt.span_id
    assert "x-b3-parentspanid" not in headers and "x-b3-flags" not in headers
    assert headers.get("x-b3-sampled") == "1"
    assert "traceparent" not in headers


PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_baggage_goes_through_by_default(
    tmp_path: Path, backends: dict[str, Backend], receiver: OtlpReceiver
) -> None:
    sent = {"traceparent": PARENT, "baggage": "tenant=acme,tier=gold"}
    headers = one_request(tmp_path, backends, receiver, sent)
    assert headers["baggage"] == "tenant=acme,tier=gold"
    assert headers["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    assert headers["traceparent"].split("-")[2] != "b7ad6b7169203331"  # the attempt's span


def test_no_exporter_means_no_tracing(
    tmp_path: Path, backends: dict[str, Backend], receiver: OtlpReceiver
) -> None:
    sent = {"traceparent": PARENT}
    headers = one_request(tmp_path, backends, receiver, sent, spans=0, OTEL_TRACES_EXPORTER="none")
    assert receiver.spans == []
    # Not traced: the client's own context goes on untouched, as through any plain proxy.
    assert headers["traceparent"] == PARENT


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("OTEL_TRACES_EXPORTER", "zipkin", "OTEL_TRACES_EXPORTER: 'zipkin' is not supported"),
        ("OTEL_PROPAGATORS", "tracecontext,xray", "OTEL_PROPAGATORS: 'xray' is not installed"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/xml", "'http/xml' is not supported"),
        ("GATEWAY_OTLP_ENCODER", "cython", "GATEWAY_OTLP_ENCODER: 'cython' is not supported"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(TracingConfigError, match=says):
        setup_tracing(TelemetryPolicy(tracing=True))


def test_a_console_exporter_and_a_none_propagator_are_honoured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_PROPAGATORS", "none")
    tracing = setup_tracing(TelemetryPolicy(tracing=True))
    assert tracing is not None
    assert tracing.trace_headers == frozenset()
    parent = tracing.extract([(b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")])
    assert not trace.get_current_span(parent).get_span_context().is_valid
    tracing.provider.shutdown()


def test_a_gateway_refusing_its_environment_says_why_and_exits(
    tmp_path: Path, backends: dict[str, Backend]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(pool_policy(backends, top="telemetry: {tracing: true}"))
    ran = subprocess.run(
        [sys.executable, "-m", "gateway", "run", "--policy", str(policy)],
        env={"PATH": "/usr/bin:/bin", "OTEL_PROPAGATORS": "xray"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 1
    assert "OTEL_PROPAGATORS: 'xray' is not installed" in ran.stderr


@pytest.mark.parametrize(("encoder", "fast"), [(None, True), ("fast", True), ("sdk", False)])
def test_the_sdk_encoder_is_used_when_asked_for(
    monkeypatch: pytest.MonkeyPatch, encoder: str | None, fast: bool
) -> None:
    """`GATEWAY_OTLP_ENCODER=sdk`: the SDK's stock OTLP/HTTP exporter, encoder and all (to
    compare their costs, or to rule the gateway's encoder out); else the gateway's."""
    if encoder is None:
        monkeypatch.delenv("GATEWAY_OTLP_ENCODER", raising=False)
    else:
        monkeypatch.setenv("GATEWAY_OTLP_ENCODER", encoder)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    exporter = tracing_module._exporter("otlp")
    try:
        assert isinstance(exporter, OTLPSpanExporter)
        assert isinstance(exporter, FastOtlpSpanExporter) is fast
    finally:
        exporter.shutdown()
