"""How the gateway's own errors look to a client, in the protocol of the route it called.

OpenAI-compatible routes get `{"error": {"message", "type", "code"}}`, and a stream that breaks
ends with that as a `data:` event and `data: [DONE]`. The Anthropic Messages route gets
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, and a broken stream ends
with an `event: error` (Anthropic streams have no `[DONE]`), so each protocol's SDK raises its
own error type instead of choking on a foreign one.
"""

from __future__ import annotations

import json
from typing import Any, Final

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

    def stream_ending(self, error: GatewayError) -> bytes:
        """The last bytes of a stream the gateway has to end: an error event, then the end."""
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

    def stream_ending(self, error: GatewayError) -> bytes:
        return b"event: error\ndata: " + self.body(error) + b"\n\n"


def _named(events: bytes, name: bytes) -> bool:
    """Whether `events` hold an event named `name`: its name line ends in a raw CR or LF."""
    line = b"event: " + name
    return line + b"\n" in events or line + b"\r" in events


OPENAI: Final = Dialect()
ANTHROPIC: Final = AnthropicDialect()
MESSAGES_PATH: Final = "/v1/messages"
# Routes not listed speak OpenAI's dialect.
BY_PATH: Final[dict[str, Dialect]] = {MESSAGES_PATH: ANTHROPIC}
