"""The OTLP receiver against the real OpenTelemetry SDK and OTLP/HTTP exporter, in-process."""

from __future__ import annotations

import gzip
import http.client
import socket
import zlib
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, find, span_tree

CANARY = "canary-7f3a9c1e"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def make_provider(exporter: OTLPSpanExporter) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "test-svc"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def emit_request_spans(provider: TracerProvider) -> None:
    """A SERVER span with a CLIENT child carrying typed attributes and an event."""
    tracer = provider.get_tracer("gateway.test", "1.2.3")
    with tracer.start_as_current_span("POST /v1/chat/completions", kind=SpanKind.SERVER) as root:
        root.set_attribute("http.request.method", "POST")
        with tracer.start_as_current_span("upstream attempt", kind=SpanKind.CLIENT) as child:
            child.set_attribute("gateway.backend", "b1")
            child.set_attribute("gateway.attempt", 2)
            child.set_attribute("gateway.hedged", True)
            child.set_attribute("gateway.ewma_ms", 12.5)
            child.set_attribute("gateway.tiers", ["fast", "slow"])
            child.set_attribute("gateway.codes", [200, 503])
            child.set_attribute("gateway.note", CANARY)
            child.add_event("retry", {"reason": "upstream 503", "delay_ms": 40})
            child.set_status(Status(StatusCode.ERROR, "backend failed"))


def post(
    receiver: OtlpReceiver,
    body: bytes,
    *,
    path: str = "/v1/traces",
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", receiver.port, timeout=5)
    try:
        sent = {"Content-Type": "application/x-protobuf"} if headers is None else headers
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def export_and_wait(receiver: OtlpReceiver, exporter: OTLPSpanExporter) -> list[ReceivedSpan]:
    provider = make_provider(exporter)
    try:
        emit_request_spans(provider)
        assert provider.force_flush(5_000)
    finally:
        provider.shutdown()
    return receiver.wait_for_spans(2, timeout_s=5)


def assert_request_spans(spans: list[ReceivedSpan]) -> None:
    [server] = find(spans, kind="SERVER")
    [client] = find(spans, kind="CLIENT")

    assert server.name == "POST /v1/chat/completions"
    assert server.is_root
    assert server.parent_span_id == ""
    assert len(server.trace_id) == 32 and int(server.trace_id, 16)
    assert len(server.span_id) == 16 and server.span_id == server.span_id.lower()
    assert server.attributes == {"http.request.method": "POST"}
    assert server.status_code == "UNSET"

    assert client.name == "upstream attempt"
    assert client.trace_id == server.trace_id
    assert client.parent_span_id == server.span_id
    assert client.attributes == {
        "gateway.backend": "b1",
        "gateway.attempt": 2,
        "gateway.hedged": True,
        "gateway.ewma_ms": 12.5,
        "gateway.tiers": ["fast", "slow"],
        "gateway.codes": [200, 503],
        "gateway.note": CANARY,
    }
    assert client.events == [("retry", {"reason": "upstream 503", "delay_ms": 40})]
    assert client.event_names() == ["retry"]
    assert client.status_code == "ERROR"
    assert client.status_message == "backend failed"
    assert server.start_ns <= client.start_ns <= client.end_ns <= server.end_ns
    assert client.duration_ns >= 0

    for span in (server, client):
        assert span.resource["service.name"] == "test-svc"
        assert span.resource["telemetry.sdk.language"] == "python"
        assert span.scope == "gateway.test"

    assert span_tree(spans) == {"": [server], server.span_id: [client]}


def test_receives_spans_from_the_otlp_http_exporter(receiver: OtlpReceiver) -> None:
    spans = export_and_wait(receiver, OTLPSpanExporter(endpoint=receiver.traces_url, timeout=5))

    assert len(spans) == 2
    assert_request_spans(spans)
    assert len(receiver.raw_bodies) == 1
    assert any(CANARY.encode() in body for body in receiver.raw_bodies)


def test_gzip_compressed_exports(receiver: OtlpReceiver) -> None:
    exporter = OTLPSpanExporter(
        endpoint=receiver.traces_url, timeout=5, compression=Compression.Gzip
    )
    spans = export_and_wait(receiver, exporter)

    assert_request_spans(spans)
    # Stored decompressed, so a test can search it.
    assert any(CANARY.encode() in body for body in receiver.raw_bodies)


def test_base_endpoint_from_the_environment(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)

    assert_request_spans(export_and_wait(receiver, OTLPSpanExporter(timeout=5)))


def test_bad_requests_are_rejected_and_the_receiver_keeps_working(
    receiver: OtlpReceiver,
) -> None:
    # 'n' (0x6e) is field 13 with wire type 6, which does not exist: never a valid message.
    assert post(receiver, b"not a protobuf")[0] == 400
    # Field 1 announces 5 bytes but only 2 follow.
    assert post(receiver, b"\x0a\x05ab")[0] == 400
    bad_gzip = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
    assert post(receiver, b"not gzip", headers=bad_gzip)[0] == 400
    unknown_encoding = {"Content-Type": "application/x-protobuf", "Content-Encoding": "br"}
    assert post(receiver, b"", headers=unknown_encoding)[0] == 400
    assert post(receiver, b"{}", headers={"Content-Type": "text/plain"})[0] == 400
    # OTLP/JSON: ids in hex; one in protobuf's own mapping (base64) is not OTLP/JSON.
    as_json = {"Content-Type": "application/json"}
    base64_id = (
        b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"AAAAAAAAAAAAAAAAAAAAAQ==",'
        b'"spanId":"AAAAAAAAAAE=","name":"x"}]}]}]}'
    )
    assert post(receiver, base64_id, headers=as_json)[0] == 400
    assert post(receiver, b'{"resourceSpans":7}', headers=as_json)[0] == 400
    assert post(receiver, b"{", headers=as_json)[0] == 400
    assert post(receiver, b"", path="/v1/metrics")[0] == 404
    assert post(receiver, b"", method="GET")[0] == 404
    assert receiver.spans == []
    assert receiver.raw_bodies == []

    spans = export_and_wait(receiver, OTLPSpanExporter(endpoint=receiver.traces_url, timeout=5))
    assert_request_spans(spans)


def test_manual_posts_get_an_empty_export_response(receiver: OtlpReceiver) -> None:
    status, body = post(receiver, b"")  # an empty request is a valid, empty export
    assert status == 200
    response = ExportTraceServiceResponse()
    response.ParseFromString(body)
    assert not response.HasField("partial_success")
    assert receiver.raw_bodies == [b""]

    deflate = {
        "Content-Type": "application/x-protobuf; charset=binary",
        "Content-Encoding": "deflate",
    }
    assert post(receiver, zlib.compress(b""), headers=deflate)[0] == 200
    gzipped = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
    assert post(receiver, gzip.compress(b""), headers=gzipped)[0] == 200
    assert receiver.spans == []


def test_wait_for_times_out_and_clear_forgets(receiver: OtlpReceiver) -> None:
    assert not receiver.wait_for(lambda spans: len(spans) > 0, timeout_s=0.05)

    export_and_wait(receiver, OTLPSpanExporter(endpoint=receiver.traces_url, timeout=5))
    assert receiver.wait_for(lambda spans: bool(find(spans, kind="CLIENT")), timeout_s=0.05)

    receiver.clear()
    assert receiver.spans == []
    assert receiver.raw_bodies == []


def test_find_by_name_kind_and_attributes() -> None:
    def span(span_id: str, parent: str, name: str, kind: str, **attrs: object) -> ReceivedSpan:
        return ReceivedSpan(name, kind, "ab" * 16, span_id, parent, attributes=dict(attrs))

    root = span("01" * 8, "", "request", "SERVER", route="/v1/chat")
    first = span("02" * 8, root.span_id, "attempt", "CLIENT", backend="b1", attempt=1)
    second = span("03" * 8, root.span_id, "attempt", "CLIENT", backend="b2", attempt=2)
    spans = [root, first, second]

    assert find(spans, name="attempt") == [first, second]
    assert find(spans, kind="SERVER") == [root]
    assert find(spans, kind="CLIENT", backend="b2") == [second]
    assert find(spans, where={"attempt": 1}) == [first]
    assert find(spans, where={"backend": "b1"}, attempt=2) == []
    assert find(spans, name="attempt", route="/v1/chat") == []
    assert find(spans, missing=None) == []
    assert span_tree(spans) == {"": [root], root.span_id: [first, second]}
    assert span_tree([]) == {}


def test_close_stops_serving_and_is_idempotent() -> None:
    receiver = OtlpReceiver()
    port = receiver.port
    assert post(receiver, b"")[0] == 200
    thread = receiver._thread

    receiver.close()
    receiver.close()

    assert not thread.is_alive()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), 1):
        pass
