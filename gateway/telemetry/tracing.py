"""OpenTelemetry traces: set up from the policy and the standard `OTEL_*` variables.

One SERVER span per client request (opened by the data plane, current for the whole request, so
the layers can add events to it) and one CLIENT span per upstream attempt (`AttemptSpans`), whose
context is sent to the backend. Spans end when the answer does: a stream's spans end at its
last byte. Nothing here records headers or bodies, so no Authorization or API key can reach a
span. With `telemetry.tracing: false` none of this is built and the request path does not branch
into it.

The standard variables, as the OpenTelemetry SDKs read them:

- `OTEL_TRACES_EXPORTER`: `otlp` (the default), `console` (spans as JSON on stdout), `none`
  (no tracing at all), or several, comma-separated.
- `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`: `http/protobuf` (the
  default), `http/json` or `grpc`; endpoint, headers, timeout and compression from the usual
  `OTEL_EXPORTER_OTLP_*` variables.
- `OTEL_PROPAGATORS`: the context formats read from a client and sent to a backend:
  `tracecontext,baggage` by default; `b3` and `b3multi` (Zipkin, Istio) too, or `none`.
- `OTEL_TRACES_SAMPLER` / `_ARG`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
  `OTEL_SDK_DISABLED`, `OTEL_BSP_*`.

A value the gateway cannot honour stops it at start, with the variable named. Spans go through a
`BatchSpanProcessor`: a bounded queue (`OTEL_BSP_MAX_QUEUE_SIZE`, 2048) exported from its own
thread, dropping spans when full, so a dead collector neither slows nor grows the gateway.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.b3 import B3MultiFormat
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace import Tracer

from gateway.config.models import TelemetryPolicy
from gateway.core.breaker import Transition

DEFAULT_PROPAGATORS = "tracecontext,baggage"
# Which encoder writes the spans' OTLP/protobuf bodies: the gateway's (`fast`, the default) or
# the SDK's own (`sdk`).
ENCODER_VARIABLE = "GATEWAY_OTLP_ENCODER"


class TracingConfigError(ValueError):
    """The OTEL_* environment asks for something the gateway cannot do."""


class Tracing:
    """The tracer the data plane and the layers use, the provider to flush at exit, and the
    propagation: the context read from a client's headers (`extract`), and the headers that
    carry an attempt's context to its backend (`inject`, in place of the client's
    `trace_headers`)."""

    def __init__(
        self, provider: TracerProvider, propagator: TextMapPropagator | None = None
    ) -> None:
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("gateway")
        self.propagator = propagator if propagator is not None else propagators()
        self.trace_headers = _replaced_headers(self.propagator)

    def extract(self, raw_headers: Iterable[tuple[bytes, bytes]]) -> Context | None:
        """The caller's context (W3C `traceparent`, B3...): the propagators read what they
        look for among all its headers (B3's `x-b3-flags` is not among the ones they write)."""
        carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in raw_headers}
        return self.propagator.extract(carrier)

    def inject(self, context: Context) -> list[tuple[str, str]]:
        """The headers that carry `context` (the attempt's span) to the backend."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=context)
        return list(carrier.items())

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
    exporters = _names("OTEL_TRACES_EXPORTER", "otlp")
    if processor is None and exporters == ["none"]:
        return None  # asked for no export: no span is built either
    propagator = propagators()
    # OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) wins over the policy.
    resource = Resource.create({})
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    if not named:
        resource = resource.merge(Resource({SERVICE_NAME: policy.service_name}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # closed by `close`
    if processor is not None:
        provider.add_span_processor(processor)
    else:
        for name in exporters:
            provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    return Tracing(provider, propagator)


# Every header of Zipkin's formats, single and multi: a client's are all replaced by the
# attempt's, so the backend never sees two contexts (or the client's span as its parent). The
# propagator reads the flags but never writes them, and neither reads nor writes the parent.
_B3_HEADERS = frozenset(
    (
        B3MultiFormat.SINGLE_HEADER_KEY,
        B3MultiFormat.TRACE_ID_KEY,
        B3MultiFormat.SPAN_ID_KEY,
        B3MultiFormat.SAMPLED_KEY,
        B3MultiFormat.FLAGS_KEY,
        "x-b3-parentspanid",
    )
)


def _replaced_headers(propagator: TextMapPropagator) -> frozenset[str]:
    """The client's headers an attempt sends its own in place of: what the propagators
    write, and the whole of a format they write a part of."""
    fields = set(propagator.fields)
    if fields & _B3_HEADERS:
        fields |= _B3_HEADERS
    return frozenset(fields)


def _names(variable: str, default: str) -> list[str]:
    """A comma-separated list variable's names, lowercased, without blanks or repeats."""
    raw = os.environ.get(variable, "").strip() or default
    names = list(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    return names or [default]


def propagators() -> TextMapPropagator:
    """The propagators `OTEL_PROPAGATORS` names (tracecontext and baggage by default), found
    as the SDKs find them: by their `opentelemetry_propagator` entry points."""
    found: list[TextMapPropagator] = []
    for name in _names("OTEL_PROPAGATORS", DEFAULT_PROPAGATORS):
        if name == "none":
            continue
        points = list(entry_points(group="opentelemetry_propagator", name=name))
        if not points:
            raise TracingConfigError(
                f"OTEL_PROPAGATORS: {name!r} is not installed "
                "(tracecontext, baggage, b3, b3multi or none)"
            )
        found.append(points[0].load()())
    return CompositePropagator(found)


def _exporter(name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER: {name!r} is not supported (otlp, console or none)"
        )
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
    if protocol == "http/json":
        from gateway.telemetry.otlp_json import JsonOtlpSpanExporter

        return JsonOtlpSpanExporter()
    if protocol != "http/protobuf":
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL={protocol!r} is not supported: "
            "use http/protobuf, http/json or grpc"
        )
    encoder = os.environ.get(ENCODER_VARIABLE, "fast").strip() or "fast"
    if encoder not in ("fast", "sdk"):
        raise TracingConfigError(f"{ENCODER_VARIABLE}: {encoder!r} is not supported (fast or sdk)")
    if encoder == "fast":
        # The stock exporter with a body encoder five times faster (the stock one costs about
        # 50 µs of this process's CPU per span). It leans on the exporter's internals: with an
        # SDK whose internals differ, the stock exporter is used, as it is when asked for
        # (`sdk`: to compare their costs, or to rule this one out).
        try:
            from gateway.telemetry.otlp_encoder import fast_exporter
        except ImportError:
            pass
        else:
            exporter = fast_exporter()
            if exporter is not None:
                return exporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


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
