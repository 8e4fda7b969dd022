"""OTLP/HTTP with JSON bodies (`OTEL_EXPORTER_OTLP_PROTOCOL=http/json`), for collectors and
proxies that take only JSON.

The body is the OTLP/JSON mapping of the same `ExportTraceServiceRequest` the SDK's encoder
builds: protobuf's JSON mapping (lowerCamelCase keys, 64-bit integers as decimal strings),
except where OTLP departs from it: enums as integers, and trace and span ids as hex strings
rather than base64. It costs several times the protobuf encoding per span: a collector that
takes protobuf is the better choice when it can be had.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any, Final

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan

from gateway.telemetry.otlp_encoder import FastOtlpSpanExporter

JSON_CONTENT_TYPE: Final = "application/json"
# The bytes fields OTLP/JSON writes as hex: a span's ids, its parent's, its links'.
_IDS: Final = ("traceId", "spanId", "parentSpanId")


def _hex_ids(item: dict[str, Any]) -> None:
    for key in _IDS:
        value = item.get(key)
        if value is not None:
            item[key] = base64.b64decode(value).hex()


def encode_json(spans: Sequence[ReadableSpan]) -> bytes:
    """The OTLP/JSON body of an export of `spans`."""
    message = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for resource_spans in message.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _hex_ids(span)
                for link in span.get("links", ()):
                    _hex_ids(link)
    return json.dumps(message, separators=(",", ":")).encode()


class JsonOtlpSpanExporter(FastOtlpSpanExporter):
    """The OTLP/HTTP span exporter (its configuration, client, retries and limits), sending
    OTLP/JSON."""

    def __init__(self) -> None:
        # Added to the configured headers (OTEL_EXPORTER_OTLP_HEADERS stay), replacing only
        # the protobuf content type.
        super().__init__(headers={"content-type": JSON_CONTENT_TYPE})

    def _encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        return encode_json(spans)
