"""The few fields routing needs from a multipart/form-data body (an audio file and its form).

vLLM's audio routes take their request as a form: the file, and fields such as `model` and
`stream`. The body is forwarded untouched; only those two fields are read, by python-multipart's
streaming parser, which walks the parts without copying the file's bytes anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from python_multipart import MultipartParser
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import parse_options_header

from gateway.errors import InvalidRequest
from gateway.ingress.body import read_facts
from gateway.pipeline.call import RequestFacts

# The parser logs each malformed body it meets: a client's mistake, answered with a 400 that
# says what was wrong, is not the operator's to read about once per request.
logging.getLogger("python_multipart.multipart").setLevel(logging.ERROR)

# The fields read, and the most of each kept (a model's name is short; more is not a name).
_WANTED = frozenset((b"model", b"stream"))
_MAX_FIELD_BYTES = 1024
# How a form says true or false: as vLLM's request models (pydantic) read a boolean field.
_TRUE = frozenset((b"true", b"1", b"yes", b"on", b"t", b"y"))
_FALSE = frozenset((b"false", b"0", b"no", b"off", b"f", b"n"))


def is_form(content_type: bytes | None) -> bool:
    return content_type is not None and content_type[:19].lower() == b"multipart/form-data"


class _Fields:
    """Collects the wanted fields' values as the parser walks the parts."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.ended = False
        self._header = b""
        self._value = b""
        self._name: bytes | None = None  # of the part being read, when it is a wanted field
        self._data = bytearray()

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            _, options = parse_options_header(self._value)
            name = options.get(b"name")
            # A file part is never a field, whatever its name.
            if name in _WANTED and b"filename" not in options:
                self._name = name
        self._header = self._value = b""

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name is not None and len(self._data) <= _MAX_FIELD_BYTES:
            self._data += data[start:end]

    def part_end(self) -> None:
        if self._name is not None:
            if len(self._data) > _MAX_FIELD_BYTES:
                raise InvalidRequest(f"the form field {self._name.decode()!r} is too long")
            # A field given twice: the last one counts, as in the engine's form parser.
            self.values[self._name] = bytes(self._data)
        self._name = None
        self._data.clear()

    def end(self) -> None:
        self.ended = True


def read_form_facts(body: bytes, content_type: bytes) -> RequestFacts:
    """`model` and `stream` from a multipart/form-data body; 400 if it is not one. A form
    without `model` names none (""): the gateway's only pool takes it, as the engine's
    default model would."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise InvalidRequest("a multipart/form-data body needs a boundary in its Content-Type")
    fields = _Fields()
    parser = MultipartParser(
        boundary,
        {
            "on_header_field": fields.header_field,
            "on_header_value": fields.header_value,
            "on_header_end": fields.header_end,
            "on_part_data": fields.part_data,
            "on_part_end": fields.part_end,
            "on_end": fields.end,
        },
    )
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise InvalidRequest(f"the request body is not valid multipart/form-data: {exc}") from None
    if not fields.ended:
        raise InvalidRequest("the request body is not valid multipart/form-data: it is cut short")
    try:
        model = fields.values.get(b"model", b"").decode()
    except UnicodeDecodeError:
        raise InvalidRequest("the form field 'model' is not UTF-8") from None
    raw = fields.values.get(b"stream", b"false").strip().lower()
    if raw not in _TRUE and raw not in _FALSE:
        raise InvalidRequest("the form field 'stream' must be true or false")
    return RequestFacts(model, raw in _TRUE, None, {}, form=True)


def read_request_facts(
    raw_headers: Iterable[tuple[bytes, bytes]], body: bytes, strict: bool
) -> RequestFacts:
    """What routing needs from the body: a JSON object's fields, or a multipart form's
    (`strict`: see `read_facts`)."""
    if body[:1] != b"{":  # not the usual JSON object: a form, or JSON after blanks (or neither)
        for name, value in raw_headers:
            if name == b"content-type":
                if is_form(value):
                    return read_form_facts(body, value)
                break
    return read_facts(body, strict)
