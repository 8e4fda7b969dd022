"""The hand-written OTLP span encoder against the SDK's own encoder, and its exporter end to end.

Every case builds spans with a real `TracerProvider` (or, for values the SDK API cannot carry,
`ReadableSpan`s by hand), encodes them with both encoders and requires the decoded requests to
be equal: same messages, same fields present.
"""

from __future__ import annotations

import difflib
import enum
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as sdk_encode_spans,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import TraceState

from gateway.telemetry.otlp_encoder import FastOtlpSpanExporter, OtlpSpanEncoder, encode_spans
from tests.otlp_receiver import OtlpReceiver, find

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACESTATE = "vendor=opaque,other=x1"


# --- helpers ----------------------------------------------------------------------------------


class Collector:
    """A local TracerProvider whose finished spans are kept in memory."""

    def __init__(
        self,
        resource: Resource | None = None,
        span_limits: SpanLimits | None = None,
    ) -> None:
        self.memory = InMemorySpanExporter()
        self.provider = TracerProvider(
            resource=resource or Resource.create({"service.name": "gateway-test"}),
            span_limits=span_limits,
            shutdown_on_exit=False,
        )
        self.provider.add_span_processor(SimpleSpanProcessor(self.memory))

    def tracer(self, name: str = "gateway", version: str | None = "1.0.0", **kw: Any) -> Any:
        return self.provider.get_tracer(name, version, **kw)

    @property
    def spans(self) -> list[ReadableSpan]:
        return list(self.memory.get_finished_spans())


def assert_same_request(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """Our bytes decode to the SDK encoder's message; with a fresh and with a warm encoder."""
    expected = sdk_encode_spans(spans)
    for encoded in (OtlpSpanEncoder().encode(spans), encode_spans(spans), encode_spans(spans)):
        actual = ExportTraceServiceRequest.FromString(encoded)
        if actual != expected:
            diff = "\n".join(
                difflib.unified_diff(
                    str(expected).splitlines(),
                    str(actual).splitlines(),
                    "SDK encoder",
                    "otlp_encoder",
                    lineterm="",
                )
            )
            pytest.fail(f"decoded requests differ:\n{diff}", pytrace=False)
    return expected


def remote_parent_context() -> Any:
    return TraceContextTextMapPropagator().extract(
        {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    )


def hand_built(
    attributes: dict[Any, Any] | None = None,
    *,
    name: str = "hand built",
    scope: InstrumentationScope | None = None,
    resource: Resource | None = None,
    **kw: Any,
) -> ReadableSpan:
    """A ReadableSpan straight from the constructor: values the SDK API would clean up."""
    return ReadableSpan(
        name=name,
        context=SpanContext(0x1234, 0x5678, is_remote=False, trace_flags=TraceFlags(1)),
        resource=resource or Resource({"service.name": "hand"}),
        attributes=attributes,
        instrumentation_scope=scope,
        **kw,
    )


# --- spans from the SDK -----------------------------------------------------------------------


def test_empty_batch() -> None:
    assert encode_spans([]) == b""
    assert_same_request([])


def test_root_and_child_spans_of_every_kind_and_status() -> None:
    collector = Collector()
    tracer = collector.tracer()
    with tracer.start_as_current_span("POST /v1/chat/completions", kind=SpanKind.SERVER) as root:
        root.set_attribute("http.request.method", "POST")
        root.set_status(Status(StatusCode.OK))
        with tracer.start_as_current_span("attempt", kind=SpanKind.CLIENT) as child:
            child.set_status(Status(StatusCode.ERROR, "upstream answered 503"))
        with tracer.start_as_current_span("internal"):
            pass  # UNSET status
        with tracer.start_as_current_span("produce", kind=SpanKind.PRODUCER) as span:
            span.set_status(StatusCode.ERROR)  # an error without a message
        with tracer.start_as_current_span("consume", kind=SpanKind.CONSUMER) as span:
            span.set_status(Status(StatusCode.OK, "ignored: only errors keep a message"))
    spans = collector.spans
    assert len(spans) == 5
    request = assert_same_request(spans)
    decoded = request.resource_spans[0].scope_spans[0].spans
    assert {span.kind for span in decoded} == {1, 2, 3, 4, 5}
    assert sum(1 for span in decoded if span.parent_span_id) == 4


def test_remote_parent_and_trace_state() -> None:
    collector = Collector()
    tracer = collector.tracer()
    with (
        tracer.start_as_current_span(
            "from a caller", context=remote_parent_context(), kind=SpanKind.SERVER
        ),
        tracer.start_as_current_span("local child", kind=SpanKind.CLIENT),
    ):
        pass
    request = assert_same_request(collector.spans)
    by_name = {span.name: span for span in request.resource_spans[0].scope_spans[0].spans}
    server = by_name["from a caller"]
    assert server.parent_span_id.hex() == "b7ad6b7169203331"
    assert server.trace_state == "vendor=opaque,other=x1"
    assert server.flags == 0x300  # has is-remote, is remote
    assert by_name["local child"].flags == 0x100


def test_every_attribute_type() -> None:
    collector = Collector()
    with collector.tracer().start_as_current_span("typed") as span:
        span.set_attributes(
            {
                "str": "value",
                "str.empty": "",
                "bool.true": True,
                "bool.false": False,
                "int.zero": 0,
                "int.small": 7,
                "int.negative": -1,
                "int.big": 2**40 + 3,
                "int.max": 2**63 - 1,
                "int.min": -(2**63),
                "int.u32": 2**32,
                "float": 12.5,
                "float.zero": 0.0,
                "float.negative": -1e-300,
                "float.inf": float("inf"),
                "bytes": b"\x00\xff raw",
                "bytes.empty": b"",
                "list.str": ["a", "b", ""],
                "list.bool": [True, False],
                "list.int": [1, -2, 2**50],
                "list.float": [0.5, -2.25],
                "list.bytes": [b"\x01", b""],
                "list.empty": [],
                "tuple.str": ("x", "y"),
            }
        )
    request = assert_same_request(collector.spans)
    attributes = request.resource_spans[0].scope_spans[0].spans[0].attributes
    assert len(attributes) == 24


def test_values_the_sdk_encoder_handles_in_its_own_way() -> None:
    """None, mappings, mixed lists; values it cannot encode are left out, attribute by attribute."""
    collector = Collector()
    with collector.tracer().start_as_current_span("odd") as span:
        span.set_attribute("none", None)
        span.set_attribute("mapping", {"a": 1, "b": ["x", None], "c": {"d": b"e"}})
        span.set_attribute("mixed", ["a", 1, 2.5, True, None])
        span.set_attribute("too.big", 2**64)
        span.set_attribute("too.small", -(2**63) - 1)
        span.set_attribute("list.too.big", [1, 2**63])
        span.set_attribute("after", "kept")
    request = assert_same_request(collector.spans)
    keys = [kv.key for kv in request.resource_spans[0].scope_spans[0].spans[0].attributes]
    assert keys == ["none", "mapping", "mixed", "after"]


def test_non_ascii_text_everywhere() -> None:
    collector = Collector(resource=Resource.create({"service.name": "passerelle-é"}))
    tracer = collector.tracer("portée", "v✓")
    with tracer.start_as_current_span("requête 🚀", kind=SpanKind.SERVER) as span:
        span.set_attribute("clé.ü", "valeur — 日本語 🎉")
        span.set_attribute("liste", ["ß", "中文", "😀"])
        span.add_event("événement", {"détail": "ok ✓"})
        span.set_status(Status(StatusCode.ERROR, "échec ✗ 💥"))
    assert_same_request(collector.spans)


def test_events_and_links() -> None:
    collector = Collector()
    tracer = collector.tracer()
    with tracer.start_as_current_span("earlier") as earlier:
        pass
    remote = SpanContext(
        0xABC,
        0xDEF,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "v1")]),
    )
    links = [
        Link(earlier.get_span_context(), {"link.kind": "follows", "n": 2}),
        Link(remote),
    ]
    with tracer.start_as_current_span("linked", links=links) as span:
        span.add_event("no attributes")
        span.add_event("with attributes", {"delay_ms": 40, "reason": "upstream 503"})
        span.add_event("explicit time", {"x": [1.5, 2.5]}, timestamp=1_700_000_000_123_456_789)
        span.add_event("", {"empty": "name"})
    request = assert_same_request(collector.spans)
    linked = request.resource_spans[0].scope_spans[0].spans[1]
    assert [link.flags for link in linked.links] == [0x100, 0x300]
    assert len(linked.events) == 4


def test_dropped_counts() -> None:
    limits = SpanLimits(
        max_span_attributes=2,
        max_events=1,
        max_links=1,
        max_event_attributes=1,
        max_link_attributes=1,
        max_attribute_length=5,
    )
    collector = Collector(span_limits=limits)
    tracer = collector.tracer()
    other = SpanContext(0x99, 0x98, is_remote=False)
    # Full lists drop their oldest entries: the last event and link are the ones kept.
    links = [Link(other, {"c": 3}), Link(other, {"a": 1, "b": 2})]
    with tracer.start_as_current_span("limited", links=links) as span:
        span.set_attributes({"one": "truncated value", "two": 2, "three": 3, "four": 4})
        span.add_event("first")
        span.add_event("second")
        span.add_event("third", {"x": 1, "y": 2, "z": 3})
    request = assert_same_request(collector.spans)
    decoded = request.resource_spans[0].scope_spans[0].spans[0]
    assert decoded.dropped_attributes_count == 2
    assert decoded.dropped_events_count == 2
    assert decoded.dropped_links_count == 1
    assert decoded.events[0].dropped_attributes_count == 2
    assert decoded.links[0].dropped_attributes_count == 1


def test_two_resources_and_two_scopes_interleaved() -> None:
    first = Collector(
        resource=Resource.create({"service.name": "a", "pod": "a-1"}, schema_url="https://s/1")
    )
    second = Collector(resource=Resource.create({"service.name": "b", "replicas": 3}))
    # An equal but distinct Resource: the SDK encoder groups it with `first`'s.
    twin = Collector(
        resource=Resource.create({"service.name": "a", "pod": "a-1"}, schema_url="https://s/1")
    )
    tracers = [
        first.tracer("gateway", "1.0"),
        first.tracer("gateway.upstream", None, schema_url="https://scope/1"),
        second.tracer("gateway", "1.0", attributes={"scope.attr": "x", "n": 1}),
        second.tracer("other"),
        twin.tracer("gateway", "1.0"),
        first.tracer("gateway", "1.0"),  # a new scope object equal to the first one
    ]
    for round_ in range(3):
        for index, tracer in enumerate(tracers):
            with tracer.start_as_current_span(f"span {round_}.{index}") as span:
                span.set_attribute("round", round_)
    batch = sorted(
        first.spans + second.spans + twin.spans,
        key=lambda span: (span.name.split(".")[0], span.name),
    )
    request = assert_same_request(batch)
    assert len(request.resource_spans) == 2
    assert [len(rs.scope_spans) for rs in request.resource_spans] == [2, 2]
    assert request.resource_spans[0].schema_url == "https://s/1"


def test_a_large_batch_of_gateway_like_spans() -> None:
    """Many spans, repeating and unique values: exercises the encoder's memos and their reset."""
    collector = Collector()
    tracer = collector.tracer()
    encoder = OtlpSpanEncoder()
    for batch in range(3):
        for i in range(400):
            with tracer.start_as_current_span("POST /v1/chat/completions", kind=SpanKind.SERVER):
                span = trace.get_current_span()
                span.set_attributes(
                    {
                        "http.request.method": "POST",
                        "http.response.status_code": 200 if i % 7 else 503,
                        "gateway.request_id": f"req-{batch}-{i}",
                        "gateway.sequence": batch * 1000 + i,
                        "gateway.stream": i % 2 == 0,
                        "gateway.ttft_ms": i / 3,
                        "gateway.unique.a": f"a{batch}-{i}",
                        "gateway.unique.b": f"b{batch}-{i}",
                        "gateway.unique.c": f"c{batch}-{i}",
                    }
                )
                span.add_event("tier selected", {"gateway.tier": "primary", "i": i})
                with tracer.start_as_current_span("attempt", kind=SpanKind.CLIENT) as child:
                    child.set_attribute("gateway.instance", f"i-{i % 5}")
                    child.set_attribute("gateway.payload", "x" * (i * 50))  # long strings
        spans = collector.spans
        collector.memory.clear()
        expected = sdk_encode_spans(spans)
        assert ExportTraceServiceRequest.FromString(encoder.encode(spans)) == expected
        assert_same_request(spans)


def test_long_values_need_multi_byte_lengths() -> None:
    collector = Collector()
    with collector.tracer().start_as_current_span("n" * 300) as span:
        span.set_attribute("k" * 200, "v" * 20_000)
        span.set_attribute("list", ["w" * 150] * 200)
    assert_same_request(collector.spans)


# --- hand-built spans -------------------------------------------------------------------------


class Color(enum.IntEnum):
    RED = 5


class Label(str):
    pass


class Ratio(float):
    pass


def test_hand_built_spans_with_unusual_values(caplog: pytest.LogCaptureFixture) -> None:
    scope = InstrumentationScope("hand", "0.1", "https://scope", {"scope.key": [1, 2]})
    spans = [
        hand_built(
            {
                "": "empty key",
                "int.subclass": Color.RED,
                "bool.subclass.free": True,
                "str.subclass": Label("label"),
                "float.subclass": Ratio(0.25),
                "bytearray": bytearray(b"ab"),
                "nested": {"inner": {"deeper": [("t", 1), []]}},
                "unsupported": object(),
                "surrogate": "\ud800",
                7: "non-string key",
                "last": "kept",
            },
            scope=scope,
        ),
        hand_built(None, name="", kind=SpanKind.CLIENT),  # no scope, no name, no times
        hand_built(
            {"a": 1},
            name="times",
            start_time=1,
            end_time=None,
            events=[Event("no time", {"b": 2}, timestamp=0)],
            status=Status(StatusCode.ERROR),
            parent=SpanContext(0x1234, 0x1, is_remote=True),
        ),
        hand_built({}, name="end only", start_time=None, end_time=2**64 - 1),
    ]
    with caplog.at_level(logging.ERROR):
        request = assert_same_request(spans)
    keys = [kv.key for kv in request.resource_spans[0].scope_spans[0].spans[0].attributes]
    assert "unsupported" not in keys
    assert "surrogate" not in keys
    assert keys[-1] == "last"


def test_a_batch_that_cannot_be_encoded_raises() -> None:
    bad = ReadableSpan(name="no context", context=None)
    with pytest.raises(ValueError, match="no span context"):
        encode_spans([bad])


# --- the exporter -----------------------------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def emit_gateway_spans(tracer: Any) -> None:
    with tracer.start_as_current_span(
        "POST /v1/chat/completions", context=remote_parent_context(), kind=SpanKind.SERVER
    ) as root:
        root.set_attribute("http.request.method", "POST")
        root.set_attribute("http.response.status_code", 200)
        root.add_event("tier selected", {"gateway.tier": "primary"})
        with tracer.start_as_current_span("upstream attempt", kind=SpanKind.CLIENT) as child:
            child.set_attribute("gateway.backend", "b1")
            child.set_attribute("gateway.attempt", 2)
            child.set_attribute("gateway.hedged", True)
            child.set_attribute("gateway.ewma_ms", 12.5)
            child.set_attribute("gateway.tiers", ["fast", "slow"])
            child.set_status(Status(StatusCode.ERROR, "backend failed"))


def test_exporter_end_to_end(receiver: OtlpReceiver) -> None:
    exporter = FastOtlpSpanExporter(endpoint=receiver.traces_url)
    collector = Collector(resource=Resource.create({"service.name": "e2e"}))
    collector.provider.add_span_processor(SimpleSpanProcessor(exporter))
    emit_gateway_spans(collector.tracer("gateway.test", "1.2.3"))

    assert receiver.wait_for(lambda spans: len(spans) == 2, 5.0)
    spans = receiver.spans
    (server,) = find(spans, kind="SERVER")
    (client,) = find(spans, kind="CLIENT")
    assert server.name == "POST /v1/chat/completions"
    assert server.attributes == {"http.request.method": "POST", "http.response.status_code": 200}
    assert server.parent_span_id == "b7ad6b7169203331"
    assert server.events == [("tier selected", {"gateway.tier": "primary"})]
    assert client.parent_span_id == server.span_id
    assert client.attributes == {
        "gateway.backend": "b1",
        "gateway.attempt": 2,
        "gateway.hedged": True,
        "gateway.ewma_ms": 12.5,
        "gateway.tiers": ["fast", "slow"],
    }
    assert (client.status_code, client.status_message) == ("ERROR", "backend failed")
    assert client.resource["service.name"] == "e2e"
    assert client.scope == "gateway.test"
    # Each export carried exactly what the SDK's encoder would have sent for that span.
    finished = collector.spans
    for body, span in zip(receiver.raw_bodies, finished, strict=True):
        assert ExportTraceServiceRequest.FromString(body) == sdk_encode_spans([span])
    collector.provider.shutdown()


def export_directly(
    exporter: FastOtlpSpanExporter, emit: Callable[[Any], None] = emit_gateway_spans
) -> SpanExportResult:
    collector = Collector()
    emit(collector.tracer())
    return exporter.export(collector.spans)


def test_exporter_drops_a_batch_over_the_size_limit(receiver: OtlpReceiver) -> None:
    exporter = FastOtlpSpanExporter(endpoint=receiver.traces_url, max_request_size=64)
    assert export_directly(exporter) is SpanExportResult.FAILURE
    assert receiver.raw_bodies == []
    exporter.shutdown()  # type: ignore[no-untyped-call]


def test_exporter_reports_encoding_failures_and_shutdown(receiver: OtlpReceiver) -> None:
    exporter = FastOtlpSpanExporter(endpoint=receiver.traces_url)
    bad = ReadableSpan(name="no context", context=None)
    assert exporter.export([bad]) is SpanExportResult.FAILURE
    assert export_directly(exporter) is SpanExportResult.SUCCESS
    exporter.shutdown()  # type: ignore[no-untyped-call]
    assert export_directly(exporter) is SpanExportResult.FAILURE
    assert len(receiver.raw_bodies) == 1


def test_the_gateway_exports_over_http_with_the_fast_encoder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.telemetry.tracing import _exporter

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    exporter = _exporter("otlp")
    try:
        assert isinstance(exporter, FastOtlpSpanExporter)
    finally:
        exporter.shutdown()


def test_grpc_is_chosen_by_the_standard_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )

    from gateway.telemetry.otlp_json import JsonOtlpSpanExporter
    from gateway.telemetry.tracing import _exporter

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    exporter = _exporter("otlp")
    try:
        assert isinstance(exporter, GrpcExporter)
    finally:
        exporter.shutdown()
    # The traces' own variable wins over the general one.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    exporter = _exporter("otlp")
    try:
        assert isinstance(exporter, JsonOtlpSpanExporter)
    finally:
        exporter.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/thrift")
    with pytest.raises(ValueError, match="is not supported: use http/protobuf, http/json or grpc"):
        _exporter("otlp")
