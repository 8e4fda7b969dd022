"""How the gateway's own errors look to a client, in the protocol of the route it called.

OpenAI-compatible routes get `{"error": {"message", "type", "code"}}`, and a stream that breaks
ends with that as a `data:` event and `data: [DONE]`. The Anthropic Messages route gets
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, and a broken stream ends
with an `event: error` (Anthropic streams have no `[DONE]`), so each protocol's SDK raises its
own error type instead of choking on a foreign one. The Responses API answers errors in
OpenAI's shape; its streams are named events ending with `response.completed` (or `.failed`,
`.incomplete`), and a broken one ends with its `error` event. A route the gateway does not know
(`opaque`) has no stream ending it could write: a stream of it that breaks is aborted, so its
client sees an incomplete response rather than a foreign event.
"""

from __future__ import annotations

import json
from typing import Any, Final

from gateway.config.routes import Protocol, route_for
from gateway.errors import GatewayError

_SSE_DONE: Final = b"data: [DONE]\n\n"

# Anthropic's error types, by the status the gateway answers with.
_ANTHROPIC_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


# An engine's error event whose status cannot be told: the upstream failed.
_UNKNOWN_STATUS: Final = 502
# Anthropic's error types by status, for an engine's error event on that route: the gateway's
# own, and those only an engine sends.
_ANTHROPIC_STATUSES: Final = {
    **{kind: status for status, kind in _ANTHROPIC_TYPES.items() if status not in (405, 503)},
    "api_error": 500,
    "internal_error": 500,  # vLLM's Messages route
    "overloaded_error": 529,
}


class Dialect:
    """OpenAI's: the gateway's native error shape."""

    name = "openai"
    # Whether `ended` can tell a stream's last event (not for a protocol the gateway does not
    # know, whose every stream is taken as ended).
    knows_end = True

    def error_status(self, event: dict[str, Any]) -> int:
        """The status of an engine's error event (its data): vLLM's `error.code` is one."""
        detail = event.get("error")
        code = detail.get("code") if isinstance(detail, dict) else None
        if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
            return code
        return _UNKNOWN_STATUS

    def has_error_event(self, events: bytes) -> bool:
        """Whether the engine's error event is among `events` (vLLM's `data: {"error": ...}`):
        a chunk's JSON cannot hold these bytes elsewhere (a string escapes its quotes)."""
        return b'{"error"' in events

    def ended(self, last: bytes) -> bool:
        """Whether a stream whose last events were `last` ended as its protocol ends one."""
        return last.rstrip().endswith(b"data: [DONE]")

    def body(self, error: GatewayError) -> bytes:
        return error.body()

    def stream_ending(self, error: GatewayError, last: bytes = b"") -> bytes | None:
        """The last bytes of a stream the gateway has to end: an error event, then the end
        (None: the protocol has none; the response is aborted). `last`: the stream's last
        events so far."""
        return b"data: " + error.body() + b"\n\n" + _SSE_DONE


class AnthropicDialect(Dialect):
    name = "anthropic"

    def error_status(self, event: dict[str, Any]) -> int:
        """The status of an engine's error event: its error type's."""
        detail = event.get("error")
        kind = detail.get("type") if isinstance(detail, dict) else None
        return _ANTHROPIC_STATUSES.get(str(kind), _UNKNOWN_STATUS)

    def has_error_event(self, events: bytes) -> bool:
        # An event's name line: its line end is a raw CR or LF, which no JSON text can hold
        # (a model writing "event: error" in its answer has it escaped inside a string).
        return _named(events, b"error")

    def ended(self, last: bytes) -> bool:
        # After an `error` event nothing comes: it ends the stream too.
        return _named(last, b"message_stop") or _named(last, b"error")

    def body(self, error: GatewayError) -> bytes:
        kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
        payload = {"type": "error", "error": {"type": kind, "message": error.message}}
        return json.dumps(payload, separators=(",", ":")).encode()

    def stream_ending(self, error: GatewayError, last: bytes = b"") -> bytes | None:
        return b"event: error\ndata: " + self.body(error) + b"\n\n"


# The Responses API's events that end a stream: its last `response.*` event, or an error.
_RESPONSES_ENDS: Final = (
    b"response.completed",
    b"response.failed",
    b"response.incomplete",
    b"error",
)
_SEQUENCE: Final = b'"sequence_number":'


class ResponsesDialect(Dialect):
    """The Responses API's: OpenAI's error shape; named events, each with its place in the
    stream (`sequence_number`)."""

    name = "responses"

    def has_error_event(self, events: bytes) -> bool:
        return _named(events, b"error")

    def ended(self, last: bytes) -> bool:
        return any(_named(last, name) for name in _RESPONSES_ENDS)

    def stream_ending(self, error: GatewayError, last: bytes = b"") -> bytes | None:
        # OpenAI's `error` event: its fields at the top, numbered after the last event sent.
        payload = {
            "type": "error",
            "code": error.code,
            "message": error.message,
            "param": None,
            "sequence_number": _last_sequence(last) + 1,
        }
        return (
            b"event: error\ndata: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
        )


def _last_sequence(events: bytes) -> int:
    """The `sequence_number` of the last event in `events` (-1: none)."""
    at = events.rfind(_SEQUENCE)
    if at < 0:
        return -1
    digits = events[at + len(_SEQUENCE) : at + len(_SEQUENCE) + 12].lstrip()
    end = 0
    while end < len(digits) and 48 <= digits[end] <= 57:
        end += 1
    return int(digits[:end]) if end else -1


class OpaqueDialect(Dialect):
    """A route the gateway does not know: OpenAI's error shape for its own answers (the
    common one); its streams are relayed as they come, taken as ended when the upstream ends
    them, and aborted when they break."""

    name = "opaque"
    knows_end = False

    def has_error_event(self, events: bytes) -> bool:
        return False

    def ended(self, last: bytes) -> bool:
        return True

    def stream_ending(self, error: GatewayError, last: bytes = b"") -> bytes | None:
        return None


def _named(events: bytes, name: bytes) -> bool:
    """Whether `events` hold an event named `name`: its name line ends in a raw CR or LF."""
    line = b"event: " + name
    return line + b"\n" in events or line + b"\r" in events


OPENAI: Final = Dialect()
ANTHROPIC: Final = AnthropicDialect()
RESPONSES: Final = ResponsesDialect()
OPAQUE: Final = OpaqueDialect()
BY_PROTOCOL: Final[dict[Protocol, Dialect]] = {
    "openai": OPENAI,
    "anthropic": ANTHROPIC,
    "responses": RESPONSES,
    "opaque": OPAQUE,
}


def dialect_for(path: str) -> Dialect:
    """The dialect of a request path's route (OpenAI's for a path that is not proxied)."""
    route = route_for(path)
    return OPENAI if route is None else BY_PROTOCOL[route.protocol]
