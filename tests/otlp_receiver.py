"""A real OTLP/HTTP trace receiver on loopback, so tests can assert on the spans an
OpenTelemetry OTLP exporter sends.

It speaks both flavours of OTLP/HTTP: `POST /v1/traces` with
`Content-Type: application/x-protobuf` or `application/json` (optionally `Content-Encoding: gzip`
or `deflate`), and answers 200 with an empty `ExportTraceServiceResponse` in the request's
encoding. A JSON body must follow OTLP/JSON where it departs from protobuf's JSON mapping: trace
and span ids as hex strings (a base64 id is refused, as a collector would misread it), enums as
integers. Every received span is kept as a plain `ReceivedSpan`, and each body's media type in
`media_types`.

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.traces_url}
        ...
        assert receiver.wait_for(lambda spans: len(find(spans, kind="SERVER")) == 1, 5.0)
"""

from __future__ import annotations

import base64
import gzip
import http.server
import json
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from google.protobuf.json_format import ParseDict, ParseError  # type: ignore[import-untyped]
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

TRACES_PATH = "/v1/traces"
PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
JSON_CONTENT_TYPE = "application/json"
_ID_HEX_LENGTHS = {"traceId": 32, "spanId": 16, "parentSpanId": 16}
MAX_BODY_BYTES = 64 * 1024 * 1024

_KIND_PREFIX = "SPAN_KIND_"
_STATUS_PREFIX = "STATUS_CODE_"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as received, decoded into plain Python values."""

    name: str
    kind: str  # "SERVER", "CLIENT", "INTERNAL", "PRODUCER", "CONSUMER" or "UNSPECIFIED"
    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    parent_span_id: str  # 16 lowercase hex digits, or "" for a root span
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status_code: str = "UNSET"  # "UNSET", "OK" or "ERROR"
    status_message: str = ""
    start_ns: int = 0
    end_ns: int = 0
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""

    @property
    def is_root(self) -> bool:
        return self.parent_span_id == ""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]


def decode_any_value(value: AnyValue) -> Any:
    """An OTLP `AnyValue` as a Python value (arrays as lists, key-value lists as dicts)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "string_value":
        return value.string_value
    if which == "bool_value":
        return value.bool_value
    if which == "int_value":
        return value.int_value
    if which == "double_value":
        return value.double_value
    if which == "bytes_value":
        return value.bytes_value
    if which == "array_value":
        return [decode_any_value(item) for item in value.array_value.values]
    if which == "kvlist_value":
        return decode_attributes(value.kvlist_value.values)
    # string_value_strindex only appears with a dictionary-encoded payload (profiles).
    return getattr(value, which)


def decode_attributes(attributes: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: decode_any_value(kv.value) for kv in attributes}


def _enum_name(name_of: Callable[[int], str], value: int, prefix: str) -> str:
    try:
        name = str(name_of(value))
    except ValueError:
        return str(value)
    return name.removeprefix(prefix)


def _decode_span(span: Span, resource: dict[str, Any], scope: str) -> ReceivedSpan:
    return ReceivedSpan(
        name=span.name,
        kind=_enum_name(Span.SpanKind.Name, span.kind, _KIND_PREFIX),
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        attributes=decode_attributes(span.attributes),
        events=[(event.name, decode_attributes(event.attributes)) for event in span.events],
        status_code=_enum_name(Status.StatusCode.Name, span.status.code, _STATUS_PREFIX),
        status_message=span.status.message,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        resource=dict(resource),
        scope=scope,
    )


def decode_request(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = decode_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.name
            spans.extend(_decode_span(span, resource, scope) for span in scope_spans.spans)
    return spans


class BadRequest(Exception):
    """The request is not a well-formed OTLP/HTTP protobuf trace export."""


def _decompress(body: bytes, encoding: str) -> bytes:
    encoding = encoding.strip().lower()
    try:
        if encoding in ("", "identity"):
            return body
        if encoding == "gzip":
            return gzip.decompress(body)
        if encoding == "deflate":
            return zlib.decompress(body)
    except (OSError, EOFError, zlib.error) as error:
        raise BadRequest(f"cannot decode {encoding} body: {error}") from error
    raise BadRequest(f"unsupported Content-Encoding {encoding!r}")


def _parse_otlp_json(raw: bytes, request: ExportTraceServiceRequest) -> None:
    """An OTLP/JSON body into `request`: its hex ids checked and turned into protobuf's
    JSON mapping (base64) first."""
    try:
        message = json.loads(raw)
        for resource_spans in message.get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    _ids_from_hex(span)
                    for link in span.get("links", []):
                        _ids_from_hex(link)
        ParseDict(message, request)
    except (ValueError, AttributeError, TypeError, ParseError) as error:
        raise BadRequest(f"not an OTLP/JSON ExportTraceServiceRequest: {error}") from error


def _ids_from_hex(item: dict[str, Any]) -> None:
    for key, length in _ID_HEX_LENGTHS.items():
        value = item.get(key)
        if value is None or value == "":
            continue
        if len(value) != length:
            raise ValueError(f"{key} {value!r} is not {length} hex digits")
        item[key] = base64.b64encode(bytes.fromhex(value)).decode()


def span_tree(spans: Iterable[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    """Children by parent span id; root spans are under ""."""
    tree: defaultdict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        tree[span.parent_span_id].append(span)
    return dict(tree)


def find(
    spans: Iterable[ReceivedSpan],
    name: str | None = None,
    kind: str | None = None,
    *,
    where: Mapping[str, Any] | None = None,
    **attrs: Any,
) -> list[ReceivedSpan]:
    """The spans with this name, kind and attribute values (each one given must match).

    Attribute names with dots go in `where`: `find(spans, where={"http.route": "/x"})`.
    """
    wanted = {**(where or {}), **attrs}
    return [
        span
        for span in spans
        if (name is None or span.name == name)
        and (kind is None or span.kind == kind)
        and all(key in span.attributes and span.attributes[key] == v for key, v in wanted.items())
    ]


class OtlpReceiver:
    """An OTLP/HTTP (protobuf) trace receiver on 127.0.0.1, on a port the kernel picks.

    Serves from a background thread until `close()` (or the end of a `with` block).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._spans: list[ReceivedSpan] = []
        self._raw_bodies: list[bytes] = []
        self.media_types: list[str] = []  # of each export received, in order
        self._closed = False
        self._server = self._make_server()
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"otlp-receiver-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def _make_server(self) -> http.server.ThreadingHTTPServer:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            # One request per connection, and a bound on idle reads, so every handler
            # thread ends and `close()` can join them all.
            protocol_version = "HTTP/1.0"
            timeout = 5.0

            def do_POST(self) -> None:
                if self.path.split("?", 1)[0] != TRACES_PATH:
                    self._reply(404, b"not found\n", "text/plain")
                    return
                try:
                    body = self._read_body()
                    payload, media_type = receiver._accept(
                        body,
                        self.headers.get("Content-Type", ""),
                        self.headers.get("Content-Encoding", ""),
                    )
                except BadRequest as error:
                    self._reply(400, f"{error}\n".encode(), "text/plain")
                    return
                self._reply(200, payload, media_type)

            def do_GET(self) -> None:
                self._reply(404, b"not found\n", "text/plain")

            do_PUT = do_GET
            do_DELETE = do_GET
            do_PATCH = do_GET
            do_HEAD = do_GET

            def _read_body(self) -> bytes:
                length_header = self.headers.get("Content-Length")
                if length_header is None:
                    raise BadRequest("Content-Length is required")
                try:
                    length = int(length_header)
                except ValueError:
                    raise BadRequest(f"bad Content-Length {length_header!r}") from None
                if not 0 <= length <= MAX_BODY_BYTES:
                    raise BadRequest(f"bad Content-Length {length}")
                body = self.rfile.read(length)
                if len(body) != length:
                    raise BadRequest("body shorter than Content-Length")
                return body

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = False
        server.block_on_close = True
        return server

    def _accept(self, body: bytes, content_type: str, content_encoding: str) -> tuple[bytes, str]:
        """Decode and store one export; the response body to send back, and its type."""
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type not in (PROTOBUF_CONTENT_TYPE, JSON_CONTENT_TYPE):
            raise BadRequest(f"unsupported Content-Type {content_type!r}")
        raw = _decompress(body, content_encoding)
        if len(raw) > MAX_BODY_BYTES:
            raise BadRequest("decoded body too large")
        request = ExportTraceServiceRequest()
        if media_type == JSON_CONTENT_TYPE:
            _parse_otlp_json(raw, request)
        else:
            try:
                request.ParseFromString(raw)
            except DecodeError as error:
                raise BadRequest(f"not an ExportTraceServiceRequest: {error}") from error
        spans = decode_request(request)
        with self._changed:
            self._raw_bodies.append(raw)
            self.media_types.append(media_type)
            self._spans.extend(spans)
            self._changed.notify_all()
        if media_type == JSON_CONTENT_TYPE:
            return b"{}", JSON_CONTENT_TYPE
        response: bytes = ExportTraceServiceResponse().SerializeToString()
        return response, PROTOBUF_CONTENT_TYPE

    @property
    def endpoint(self) -> str:
        """The base URL, for `OTEL_EXPORTER_OTLP_ENDPOINT` (the exporter appends /v1/traces)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def traces_url(self) -> str:
        """The full URL, for `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTLPSpanExporter`."""
        return f"{self.endpoint}{TRACES_PATH}"

    @property
    def spans(self) -> list[ReceivedSpan]:
        """A copy of every span received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    @property
    def raw_bodies(self) -> list[bytes]:
        """Every accepted export request body, decompressed, in arrival order."""
        with self._lock:
            return list(self._raw_bodies)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 5.0
    ) -> bool:
        """Whether `predicate(spans)` became true within `timeout_s`; re-checked on every export."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(list(self._spans)), timeout_s)

    def wait_for_spans(self, count: int, timeout_s: float = 5.0) -> list[ReceivedSpan]:
        """At least `count` spans within `timeout_s`, or AssertionError."""
        if not self.wait_for(lambda spans: len(spans) >= count, timeout_s):
            raise AssertionError(
                f"expected {count} spans within {timeout_s}s, got {len(self.spans)}: "
                f"{[span.name for span in self.spans]}"
            )
        return self.spans

    def clear(self) -> None:
        with self._changed:
            self._spans.clear()
            self._raw_bodies.clear()
            self.media_types.clear()
            self._changed.notify_all()

    def close(self) -> None:
        """Stop serving, close the socket and join the server and handler threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
