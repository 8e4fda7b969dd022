"""OTLP/protobuf encoding of finished spans, written straight to the wire format.

The OTLP/HTTP exporter builds one protobuf message object per span, attribute, event and value,
then serializes the tree: about 100 µs of Python per span, on the interpreter lock the event loop
needs. `encode_spans` writes the same `ExportTraceServiceRequest` as bytes directly: varints,
fixed-width little-endian integers and length-prefixed submessages, with the encoded resource
and instrumentation scope of each span kept between batches (they are the same on every span).

The output decodes to exactly the message the SDK's encoder
(`opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans`) builds, including its
choices that are not in the OTLP specification:

- spans are grouped by resource, then by instrumentation scope, with the SDK's dictionary
  semantics (equal objects share a group, groups in order of first appearance);
- a span's `flags` carry only the "has is-remote" bit, plus "is remote" when its parent is
  remote; the W3C trace flags are not copied. A link's flags are derived the same way from the
  linked context;
- a link's trace state is not sent; a span's is, as `key=value` pairs joined by commas;
- `parent_span_id` is present whenever the span has a parent context;
- `resource`, `scope`, `status` and every attribute's `value` are always present, even empty;
- an attribute whose value cannot be encoded (an unsupported type, an integer outside int64, a
  string that is not valid UTF-8) is left out, with the error logged; an error anywhere else
  fails the whole batch.

`FastOtlpSpanExporter` is the OTLP/HTTP span exporter with this encoder in place of the SDK's.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, cast

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.http._common import (
    RequestPayloadTooLargeError,
    _is_request_too_large,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_STATUS_CODE
from opentelemetry.trace import SpanContext, SpanKind

__all__ = ["FastOtlpSpanExporter", "OtlpSpanEncoder", "encode_spans", "fast_exporter"]

_logger = logging.getLogger(__name__)

# --- wire-format primitives -------------------------------------------------------------------
#
# A field is a key varint, (field_number << 3) | wire_type, then its value: wire type 0 is a
# varint, 1 eight little-endian bytes, 2 a varint length then that many bytes (strings, bytes,
# submessages, one element of a repeated submessage field), 5 four little-endian bytes.

_ONE_BYTE: Final = tuple(bytes((n,)) for n in range(0x80))
_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1
_pack_double: Final = struct.Struct("<d").pack
_pack_key_fixed64: Final = struct.Struct("<BQ").pack  # a one-byte key, then the value
_pack_two_fixed64: Final = struct.Struct("<BQBQ").pack


def _varint(n: int) -> bytes:
    """A non-negative integer as a base-128 varint, least significant group first."""
    if n < 0x80:
        return _ONE_BYTE[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _utf8(text: object) -> bytes:
    """A string field's bytes; like protobuf, accepts `str` or UTF-8 `bytes`."""
    if isinstance(text, str):
        return text.encode()
    if isinstance(text, bytes):
        text.decode()  # raises on invalid UTF-8, as protobuf does
        return text
    raise TypeError(f"{text!r} has type {type(text).__name__}, but expected str or bytes")


# Keys of fields used below: _KEY_<message>_<field>, as wire bytes.
# ExportTraceServiceRequest
_KEY_REQUEST_RESOURCE_SPANS: Final = b"\x0a"  # 1, message
# ResourceSpans / ScopeSpans (same numbers)
_KEY_GROUP_HEAD: Final = b"\x0a"  # 1, resource / scope, message
_KEY_GROUP_ITEMS: Final = b"\x12"  # 2, scope_spans / spans, message
_KEY_GROUP_SCHEMA_URL: Final = b"\x1a"  # 3, schema_url, string
# Resource
_KEY_RESOURCE_ATTRIBUTES: Final = b"\x0a"  # 1, KeyValue
# InstrumentationScope
_KEY_SCOPE_NAME: Final = b"\x0a"  # 1, string
_KEY_SCOPE_VERSION: Final = b"\x12"  # 2, string
_KEY_SCOPE_ATTRIBUTES: Final = b"\x1a"  # 3, KeyValue
# Span
_KEY_SPAN_TRACE_ID: Final = b"\x0a\x10"  # 1, bytes, always 16 long
_KEY_SPAN_SPAN_ID: Final = b"\x12\x08"  # 2, bytes, always 8 long
_KEY_SPAN_TRACE_STATE: Final = b"\x1a"  # 3, string
_KEY_SPAN_PARENT_SPAN_ID: Final = b"\x22\x08"  # 4, bytes, always 8 long
_KEY_SPAN_NAME: Final = b"\x2a"  # 5, string
_KEY_SPAN_START: Final = 0x39  # 7, fixed64
_KEY_SPAN_END: Final = 0x41  # 8, fixed64
_KEY_SPAN_ATTRIBUTES: Final = b"\x4a"  # 9, KeyValue
_KEY_SPAN_DROPPED_ATTRIBUTES: Final = b"\x50"  # 10, uint32
_KEY_SPAN_EVENTS: Final = b"\x5a"  # 11, Event
_KEY_SPAN_DROPPED_EVENTS: Final = b"\x60"  # 12, uint32
_KEY_SPAN_LINKS: Final = b"\x6a"  # 13, Link
_KEY_SPAN_DROPPED_LINKS: Final = b"\x70"  # 14, uint32
_KEY_SPAN_STATUS: Final = b"\x7a"  # 15, Status
# Span.Event
_KEY_EVENT_TIME: Final = 0x09  # 1, fixed64
_KEY_EVENT_NAME: Final = b"\x12"  # 2, string
_KEY_EVENT_ATTRIBUTES: Final = b"\x1a"  # 3, KeyValue
_KEY_EVENT_DROPPED_ATTRIBUTES: Final = b"\x20"  # 4, uint32
# Span.Link
_KEY_LINK_ATTRIBUTES: Final = b"\x22"  # 4, KeyValue
_KEY_LINK_DROPPED_ATTRIBUTES: Final = b"\x28"  # 5, uint32
# Status
_KEY_STATUS_MESSAGE: Final = b"\x12"  # 2, string
_KEY_STATUS_CODE: Final = b"\x18"  # 3, enum
# KeyValue
_KEY_KV_KEY: Final = b"\x0a"  # 1, string
_KEY_KV_VALUE: Final = b"\x12"  # 2, AnyValue
# AnyValue (a oneof: the member present is written even when it is the zero value)
_KEY_ANY_STRING: Final = b"\x0a"  # 1, string
_KEY_ANY_BOOL: Final = b"\x10"  # 2, bool
_KEY_ANY_INT: Final = b"\x18"  # 3, int64
_KEY_ANY_DOUBLE: Final = b"\x21"  # 4, double
_KEY_ANY_ARRAY: Final = b"\x2a"  # 5, ArrayValue
_KEY_ANY_KVLIST: Final = b"\x32"  # 6, KeyValueList
_KEY_ANY_BYTES: Final = b"\x3a"  # 7, bytes
# ArrayValue / KeyValueList
_KEY_LIST_VALUES: Final = b"\x0a"  # 1, AnyValue / KeyValue

_ANY_TRUE: Final = _KEY_ANY_BOOL + b"\x01"
_ANY_FALSE: Final = _KEY_ANY_BOOL + b"\x00"
_ANY_SMALL_INT: Final = tuple(_KEY_ANY_INT + _ONE_BYTE[n] for n in range(0x80))
_EMPTY_MESSAGE: Final = b"\x00"  # the length of a present but empty submessage

# Span.SpanKind: SPAN_KIND_INTERNAL = 1 ... SPAN_KIND_CONSUMER = 5 (field 6, enum).
_SPAN_KIND: Final[dict[SpanKind, bytes]] = {
    SpanKind.INTERNAL: b"\x30\x01",
    SpanKind.SERVER: b"\x30\x02",
    SpanKind.CLIENT: b"\x30\x03",
    SpanKind.PRODUCER: b"\x30\x04",
    SpanKind.CONSUMER: b"\x30\x05",
}

# SpanFlags: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK (0x100), SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
# (0x200). Span.flags is field 16, Span.Link.flags field 6, both fixed32.
_HAS_IS_REMOTE: Final = 0x100
_IS_REMOTE: Final = 0x200
_SPAN_FLAGS_LOCAL: Final = b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE)
_SPAN_FLAGS_REMOTE: Final = b"\x85\x01" + struct.pack("<I", _HAS_IS_REMOTE | _IS_REMOTE)
_LINK_FLAGS_LOCAL: Final = b"\x35" + struct.pack("<I", _HAS_IS_REMOTE)
_LINK_FLAGS_REMOTE: Final = b"\x35" + struct.pack("<I", _HAS_IS_REMOTE | _IS_REMOTE)

# Status without a message, by code (UNSET 0 is not written: an empty but present Status).
_STATUS_WITHOUT_MESSAGE: Final[dict[int, bytes]] = {
    0: _KEY_SPAN_STATUS + _EMPTY_MESSAGE,
    1: _KEY_SPAN_STATUS + b"\x02" + _KEY_STATUS_CODE + b"\x01",
    2: _KEY_SPAN_STATUS + b"\x02" + _KEY_STATUS_CODE + b"\x02",
}


# --- attribute values -------------------------------------------------------------------------


def _int64(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ANY_SMALL_INT[value]
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"Value out of range: {value}")
    # Negative int64 values are written as their 64-bit two's complement (ten bytes).
    return _KEY_ANY_INT + _varint(value if value >= 0 else value + (1 << 64))


def _any_value(value: object) -> bytes:
    """The body of an `AnyValue` holding `value`: the SDK's type tests, in the SDK's order."""
    kind = type(value)
    if kind is str:
        data = cast(str, value).encode()
        return _KEY_ANY_STRING + _varint(len(data)) + data
    if kind is bool:
        return _ANY_TRUE if value else _ANY_FALSE
    if kind is int:
        return _int64(cast(int, value))
    if kind is float:
        return _KEY_ANY_DOUBLE + _pack_double(value)
    # Subclasses, containers and everything else, tested the way the SDK does.
    if value is None:
        return b""
    if isinstance(value, bool):
        return _ANY_TRUE if value else _ANY_FALSE
    if isinstance(value, str):
        data = value.encode()
        return _KEY_ANY_STRING + _varint(len(data)) + data
    if isinstance(value, int):
        return _int64(value)
    if isinstance(value, float):
        return _KEY_ANY_DOUBLE + _pack_double(value)
    if isinstance(value, bytes):
        return _KEY_ANY_BYTES + _varint(len(value)) + value
    if isinstance(value, Sequence):
        items: list[bytes] = []
        for item in value:
            encoded = _any_value(item)
            items += (_KEY_LIST_VALUES, _varint(len(encoded)), encoded)
        array = b"".join(items)
        return _KEY_ANY_ARRAY + _varint(len(array)) + array
    if isinstance(value, Mapping):
        pairs: list[bytes] = []
        for key, item in value.items():
            pair = _key_value(_key_field(str(key)), _any_value(item))
            pairs += (_KEY_LIST_VALUES, _varint(len(pair)), pair)
        kvlist = b"".join(pairs)
        return _KEY_ANY_KVLIST + _varint(len(kvlist)) + kvlist
    raise TypeError(f"Invalid type {type(value)} of value {value}")


def _key_field(key: object) -> bytes:
    """`KeyValue.key` as a field (nothing for the empty key, a proto3 default)."""
    data = _utf8(key)
    return _KEY_KV_KEY + _varint(len(data)) + data if data else b""


def _key_value(key_field: bytes, any_value: bytes) -> bytes:
    """The body of a `KeyValue`; its value is always present, even when empty."""
    return key_field + _KEY_KV_VALUE + _varint(len(any_value)) + any_value


_NOTHING: Final = object()
_MAX_CACHED_KEYS: Final = 4096
_MAX_CACHED_ATTRIBUTES: Final = 8192
_MAX_CACHED_OWNERS: Final = 256
# Spans whose `attributes` property is the SDK's: a read-only view of `_attributes`.
_SDK_SPAN_TYPES: Final = frozenset((ReadableSpan, SdkSpan))
_BOUNDED_ATTRIBUTES_HAVE_DICT: Final = type(getattr(BoundedAttributes(), "_dict", None)) is dict


class OtlpSpanEncoder:
    """Encodes batches of spans, remembering what repeats from span to span and batch to batch.

    Attribute keys, whole attributes with a string, integer or boolean value (a request's
    method, route, pool, model, status code... recur on most spans), resources and scopes are
    kept encoded. Each memo is emptied when it reaches its bound. Safe to share between
    threads: the memos only hold bytes derived from immutable values.
    """

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}
        # field key -> (attribute key, value, value type) -> the encoded repeated-field entry.
        # The type is part of the memo key so that 1 and True (equal in Python, different on
        # the wire) never share an entry; only str, int and bool values are remembered.
        self._attribute_fields: dict[bytes, dict[tuple[str, object, type], bytes]] = {}
        # id(object) -> (object, its encoded fields): the object is held so the id stays its.
        self._resources: dict[int, tuple[Resource, bytes, bytes]] = {}
        self._scopes: dict[int, tuple[InstrumentationScope | None, bytes, bytes]] = {}

    # --- attributes ---------------------------------------------------------------------------

    def _attributes(self, field_key: bytes, attributes: Mapping[str, object] | None) -> bytes:
        """Every attribute as one `field_key` (repeated KeyValue) field, in mapping order."""
        if not attributes:
            return b""
        memo = self._attribute_fields.get(field_key)
        if memo is None:
            memo = self._attribute_fields.setdefault(field_key, {})
        items: Iterable[tuple[str, object]]
        if type(attributes) is BoundedAttributes and _BOUNDED_ATTRIBUTES_HAVE_DICT:
            # The SDK's attribute mapping iterates through the generic Mapping methods, one
            # Python call per key; the dict it wraps is copied in one step instead (a snapshot
            # under the interpreter lock, as its own iteration takes under its lock).
            items = list(attributes._dict.items())
        else:
            items = attributes.items()
        out: list[bytes] = []
        for key, value in items:
            kind = type(value)
            if (kind is str or kind is int or kind is bool) and type(key) is str:
                memo_key = (key, value, kind)
                field = memo.get(memo_key)
                if field is None:
                    field = self._attribute(field_key, key, value)
                    if field is None:
                        continue
                    if len(memo) >= _MAX_CACHED_ATTRIBUTES:
                        memo.clear()
                    memo[memo_key] = field
            else:
                field = self._attribute(field_key, key, value)
                if field is None:
                    continue
            out.append(field)
        return b"".join(out)

    def _attribute(self, field_key: bytes, key: object, value: object) -> bytes | None:
        """One attribute as a `field_key` field; None (logged) when it cannot be encoded."""
        try:
            key_field = self._keys.get(cast(str, key))
            if key_field is None:
                key_field = _key_field(key)
                if type(key) is str:
                    if len(self._keys) >= _MAX_CACHED_KEYS:
                        self._keys.clear()
                    self._keys[key] = key_field
            pair = _key_value(key_field, _any_value(value))
        except Exception as error:
            _logger.exception("Failed to encode key %s: %s", key, error)
            return None
        return field_key + _varint(len(pair)) + pair

    # --- resource and scope -------------------------------------------------------------------

    def _resource(self, resource: Resource) -> tuple[Resource, bytes, bytes]:
        """(resource, its `ResourceSpans.resource` field, its `ResourceSpans.schema_url` field)."""
        cached = self._resources.get(id(resource))
        if cached is not None and cached[0] is resource:
            return cached
        body = self._attributes(_KEY_RESOURCE_ATTRIBUTES, resource.attributes)
        head = _KEY_GROUP_HEAD + _varint(len(body)) + body
        entry = (resource, head, _schema_url_field(resource.schema_url))
        if len(self._resources) >= _MAX_CACHED_OWNERS:
            self._resources.clear()
        self._resources[id(resource)] = entry
        return entry

    def _scope(
        self, scope: InstrumentationScope | None
    ) -> tuple[InstrumentationScope | None, bytes, bytes]:
        """(scope, its `ScopeSpans.scope` field, its `ScopeSpans.schema_url` field)."""
        cached = self._scopes.get(id(scope))
        if cached is not None and cached[0] is scope:
            return cached
        if scope is None:
            head = _KEY_GROUP_HEAD + _EMPTY_MESSAGE
            schema_url = b""
        else:
            parts: list[bytes] = []
            if scope.name:
                name = _utf8(scope.name)
                parts += (_KEY_SCOPE_NAME, _varint(len(name)), name)
            if scope.version:
                version = _utf8(scope.version)
                parts += (_KEY_SCOPE_VERSION, _varint(len(version)), version)
            parts.append(self._attributes(_KEY_SCOPE_ATTRIBUTES, scope.attributes))
            body = b"".join(parts)
            head = _KEY_GROUP_HEAD + _varint(len(body)) + body
            schema_url = _schema_url_field(scope.schema_url)
        entry = (scope, head, schema_url)
        if len(self._scopes) >= _MAX_CACHED_OWNERS:
            self._scopes.clear()
        self._scopes[id(scope)] = entry
        return entry

    # --- spans --------------------------------------------------------------------------------

    def _span(self, span: ReadableSpan) -> bytes:
        """The body of one `Span`, fields in field-number order."""
        context = span.get_span_context()
        if context is None:
            raise ValueError(f"span {span.name!r} has no span context")
        out = [
            _KEY_SPAN_TRACE_ID,
            context.trace_id.to_bytes(16, "big"),
            _KEY_SPAN_SPAN_ID,
            context.span_id.to_bytes(8, "big"),
        ]
        trace_state = context.trace_state
        if trace_state:
            text = ",".join([f"{key}={value}" for key, value in trace_state.items()]).encode()
            out += (_KEY_SPAN_TRACE_STATE, _varint(len(text)), text)
        parent = span.parent
        if parent:
            out += (_KEY_SPAN_PARENT_SPAN_ID, parent.span_id.to_bytes(8, "big"))
        name = span.name
        if name:
            data = name.encode() if type(name) is str else _utf8(name)
            out += (_KEY_SPAN_NAME, _varint(len(data)), data)
        out.append(_SPAN_KIND[span.kind])
        start, end = span.start_time, span.end_time
        if start and end:
            out.append(_pack_two_fixed64(_KEY_SPAN_START, start, _KEY_SPAN_END, end))
        elif start:
            out.append(_pack_key_fixed64(_KEY_SPAN_START, start))
        elif end:
            out.append(_pack_key_fixed64(_KEY_SPAN_END, end))
        out.append(
            self._attributes(
                _KEY_SPAN_ATTRIBUTES,
                span._attributes if type(span) in _SDK_SPAN_TYPES else span.attributes,
            )
        )
        if dropped := span.dropped_attributes:
            out += (_KEY_SPAN_DROPPED_ATTRIBUTES, _varint(dropped))
        for event in span.events:
            body = self._event(event)
            out += (_KEY_SPAN_EVENTS, _varint(len(body)), body)
        if dropped := span.dropped_events:
            out += (_KEY_SPAN_DROPPED_EVENTS, _varint(dropped))
        for link in span.links:
            body = self._link(link.context, link.attributes, link.dropped_attributes)
            out += (_KEY_SPAN_LINKS, _varint(len(body)), body)
        if dropped := span.dropped_links:
            out += (_KEY_SPAN_DROPPED_LINKS, _varint(dropped))
        status = span.status
        if status is not None:
            code = status.status_code.value
            message = status.description
            if not message and code in _STATUS_WITHOUT_MESSAGE:
                out.append(_STATUS_WITHOUT_MESSAGE[code])
            else:
                body = _status(code, message)
                out += (_KEY_SPAN_STATUS, _varint(len(body)), body)
        out.append(_SPAN_FLAGS_REMOTE if parent and parent.is_remote else _SPAN_FLAGS_LOCAL)
        return b"".join(out)

    def _event(self, event: Event) -> bytes:
        """The body of one `Span.Event`."""
        timestamp = event.timestamp
        body = _pack_key_fixed64(_KEY_EVENT_TIME, timestamp) if timestamp else b""
        if name := event.name:
            data = name.encode() if type(name) is str else _utf8(name)
            body += _KEY_EVENT_NAME + _varint(len(data)) + data
        body += self._attributes(_KEY_EVENT_ATTRIBUTES, event.attributes)
        if dropped := event.dropped_attributes:
            body += _KEY_EVENT_DROPPED_ATTRIBUTES + _varint(dropped)
        return body

    def _link(self, context: SpanContext | None, attributes: Any, dropped: int) -> bytes:
        if context is None:
            raise ValueError("link without a span context")
        out = [
            _KEY_SPAN_TRACE_ID,
            context.trace_id.to_bytes(16, "big"),
            _KEY_SPAN_SPAN_ID,
            context.span_id.to_bytes(8, "big"),
            self._attributes(_KEY_LINK_ATTRIBUTES, attributes),
        ]
        if dropped:
            out += (_KEY_LINK_DROPPED_ATTRIBUTES, _varint(dropped))
        out.append(_LINK_FLAGS_REMOTE if context.is_remote else _LINK_FLAGS_LOCAL)
        return b"".join(out)

    # --- the request --------------------------------------------------------------------------

    def encode(self, spans: Iterable[ReadableSpan]) -> bytes:
        """The serialized `ExportTraceServiceRequest` carrying `spans`."""
        # Groups by the SDK's rule (a dict keyed by the resource, then by the scope), looked up
        # by identity first since a batch holds few distinct objects, many times each.
        resources: list[_ResourceGroup] = []
        resource_by_id: dict[int, _ResourceGroup] = {}
        resource_by_value: dict[Resource, _ResourceGroup] = {}
        last: tuple[object, object] = (_NOTHING, _NOTHING)
        last_spans: list[bytes] = []
        for span in spans:
            body = self._span(span)
            resource = span.resource
            scope = span.instrumentation_scope or None
            if last[0] is not resource or last[1] is not scope:
                group = resource_by_id.get(id(resource))
                if group is None:
                    group = resource_by_value.get(resource)
                    if group is None:
                        _, head, schema_url = self._resource(resource)
                        group = _ResourceGroup(head, schema_url)
                        resource_by_value[resource] = group
                        resources.append(group)
                    resource_by_id[id(resource)] = group
                last_spans = group.spans_of(scope, self._scope)
                last = (resource, scope)
            last_spans += (_KEY_GROUP_ITEMS, _varint(len(body)), body)
        out: list[bytes] = []
        for group in resources:
            body = group.encode()
            out += (_KEY_REQUEST_RESOURCE_SPANS, _varint(len(body)), body)
        return b"".join(out)


class _ResourceGroup:
    """One `ResourceSpans` being built: its scopes' encoded spans, by scope."""

    __slots__ = ("by_id", "by_value", "head", "schema_url", "scopes")

    def __init__(self, head: bytes, schema_url: bytes) -> None:
        self.head = head
        self.schema_url = schema_url
        self.scopes: list[tuple[bytes, bytes, list[bytes]]] = []
        self.by_id: dict[int, list[bytes]] = {}
        self.by_value: dict[InstrumentationScope | None, list[bytes]] = {}

    def spans_of(
        self,
        scope: InstrumentationScope | None,
        encode_scope: Callable[
            [InstrumentationScope | None], tuple[InstrumentationScope | None, bytes, bytes]
        ],
    ) -> list[bytes]:
        """The list collecting the encoded span fields of `scope`'s `ScopeSpans`."""
        spans = self.by_id.get(id(scope))
        if spans is None:
            spans = self.by_value.get(scope)
            if spans is None:
                _, head, schema_url = encode_scope(scope)
                spans = []
                self.scopes.append((head, schema_url, spans))
                self.by_value[scope] = spans
            self.by_id[id(scope)] = spans
        return spans

    def encode(self) -> bytes:
        """The body of the `ResourceSpans`."""
        out = [self.head]
        for head, schema_url, spans in self.scopes:
            body = b"".join([head, *spans, schema_url])
            out += (_KEY_GROUP_ITEMS, _varint(len(body)), body)
        out.append(self.schema_url)
        return b"".join(out)


def _schema_url_field(schema_url: str | None) -> bytes:
    if not schema_url:
        return b""
    data = _utf8(schema_url)
    return _KEY_GROUP_SCHEMA_URL + _varint(len(data)) + data


def _status(code: int, message: str | None) -> bytes:
    out = b""
    if message:
        data = _utf8(message)
        out = _KEY_STATUS_MESSAGE + _varint(len(data)) + data
    if code:
        out += _KEY_STATUS_CODE + _varint(code)
    return out


_ENCODER: Final = OtlpSpanEncoder()


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """The serialized `ExportTraceServiceRequest` for `spans` (encoded with a shared cache)."""
    return _ENCODER.encode(spans)


class FastOtlpSpanExporter(OTLPSpanExporter):
    """The OTLP/HTTP span exporter, with the request body written by `encode_spans`.

    Everything else is the parent's: configuration, the HTTP client (compression, retries with
    backoff, the export deadline, giving up on shutdown), the request size limit and the
    exporter's own metrics. The parent builds and sends the body in one method, `export`, with
    no step to override in between; this `export` is the parent's with the encoding replaced,
    and it hands the bytes to the parent's client exactly as the parent does.
    """

    def _encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        return _ENCODER.encode(spans)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            _logger.warning("Exporter already shutdown, ignoring batch")
            return SpanExportResult.FAILURE
        with self._metrics.export_operation(len(spans)) as result:
            try:
                body = self._encode(spans)
            except Exception as error:
                _logger.error("Failed to encode span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE
            if _is_request_too_large(body, self._max_request_size):
                _logger.warning(
                    "Dropping span batch: serialized size %d bytes exceeds max_request_size "
                    "%d bytes.",
                    len(body),
                    self._max_request_size,
                )
                result.error = RequestPayloadTooLargeError(
                    f"Serialized span request size {len(body)} bytes exceeds max_request_size "
                    f"{self._max_request_size} bytes."
                )
                return SpanExportResult.FAILURE
            sent = self._client.export(body)
            if not sent.success:
                result.error = sent.error
                if sent.status_code is not None:
                    result.error_attrs = {HTTP_RESPONSE_STATUS_CODE: sent.status_code}
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS


def fast_exporter() -> FastOtlpSpanExporter | None:
    """A `FastOtlpSpanExporter` configured from the environment as the stock one is, or None
    when this SDK's exporter lacks the private state its `export` uses (`_client`, `_metrics`,
    `_max_request_size`): then the stock exporter serves instead."""
    exporter = FastOtlpSpanExporter()
    try:
        _ = (exporter._client, exporter._metrics, exporter._max_request_size)
    except AttributeError:
        return None
    return exporter
