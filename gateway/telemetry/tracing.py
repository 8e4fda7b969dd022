"""OpenTelemetry traces: set up from the policy and the standard `OTEL_*` variables.

One SERVER span per client request (opened by the data plane, current for the whole request, so
the layers can add events to it) and one CLIENT span per upstream attempt (`AttemptSpans`), whose
W3C context is sent to the backend. Spans end when the answer does: a stream's spans end at its
last byte. Nothing here records headers or bodies, so no Authorization or API key can reach a
span. With `telemetry.tracing: false` none of this is built and the request path does not branch
into it.

The exporter: OTLP over HTTP/protobuf (the OpenTelemetry default), or gRPC when
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` says `grpc`; endpoint,
headers, timeout and compression from the usual `OTEL_EXPORTER_OTLP_*` variables; sampler from
`OTEL_TRACES_SAMPLER` / `_ARG`. Spans go through a `BatchSpanProcessor`: a bounded queue
(`OTEL_BSP_MAX_QUEUE_SIZE`, 2048) exported from its own thread, dropping spans when full, so a
dead collector neither slows nor grows the gateway.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config.models import TelemetryPolicy
from gateway.core.breaker import Transition

PROPAGATOR = TraceContextTextMapPropagator()
# W3C trace context headers: replaced by the attempt's own context when tracing is on.
TRACE_HEADERS = frozenset(PROPAGATOR.fields)


class TracingConfigError(ValueError):
    """The OTEL_* environment asks for something the gateway cannot do."""


class Tracing:
    """The tracer the data plane and the layers use, and the provider to flush at exit."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("gateway")

    async def close(self, timeout_s: float = 3.0) -> None:
        """Export what is queued, for at most `timeout_s`: a dead collector (the exporter
        retries for up to a minute) must not hold up the process's exit."""
        done = threading.Event()

        def shutdown() -> None:
            try:
                self.provider.shutdown()
            finally:
                done.set()

        threading.Thread(target=shutdown, name="otel-shutdown", daemon=True).start()
        await asyncio.to_thread(done.wait, timeout_s)


def setup_tracing(
    policy: TelemetryPolicy, processor: SpanProcessor | None = None
) -> Tracing | None:
    """The tracing the policy asks for; None when off (or `OTEL_SDK_DISABLED=true`).

    `processor` replaces the batch exporter (tests use it to look at spans in-process).
    """
    if not policy.tracing or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    # OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) wins over the policy.
    resource = Resource.create({})
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    if not named:
        resource = resource.merge(Resource({SERVICE_NAME: policy.service_name}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # closed by `close`
    provider.add_span_processor(processor or BatchSpanProcessor(_exporter()))
    return Tracing(provider)


def _exporter() -> SpanExporter:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    if protocol != "http/protobuf":
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL={protocol!r} is not supported: "
            "use grpc or http/protobuf"
        )
    try:
        # The stock exporter with a body encoder five times faster (the stock one costs about
        # 50 µs of this process's CPU per span). It leans on the exporter's internals: with an
        # SDK whose internals differ, the stock exporter is used.
        from gateway.telemetry.otlp_encoder import FastOtlpSpanExporter

        exporter = FastOtlpSpanExporter()
        _ = (exporter._client, exporter._metrics, exporter._max_request_size)
        return exporter
    except (ImportError, AttributeError):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()


def incoming_context(raw_headers: Iterable[tuple[bytes, bytes]]) -> Context | None:
    """The caller's W3C trace context (`traceparent`, `tracestate`), if it sent one."""
    found: dict[str, str] = {}
    for name, value in raw_headers:
        if name in (b"traceparent", b"tracestate"):
            found[name.decode()] = value.decode("latin-1")
    if "traceparent" not in found:
        return None
    return PROPAGATOR.extract(found)


def context_headers(context: Context) -> list[tuple[str, str]]:
    """The W3C headers that carry `context` (the attempt's span) to the backend."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=context)
    return list(carrier.items())


def traced_transitions(
    record: Callable[[str, Transition], None],
) -> Callable[[str, Transition], None]:
    """`record` that also marks a breaker transition on the span of the request causing it."""

    def record_and_mark(pool: str, transition: Transition) -> None:
        record(pool, transition)
        if transition.suppressed:
            name = "instance isolation suppressed"
        elif transition.to == "ADMITTING":
            name = "instance restored"
        else:
            name = "instance isolated"
        trace.get_current_span().add_event(
            name,
            {
                "gateway.pool": pool,
                "gateway.instance": transition.instance,
                "gateway.breaker.from": transition.state_from,
                "gateway.breaker.to": transition.to,
                "gateway.breaker.reason": transition.reason,
            },
        )

    return record_and_mark
