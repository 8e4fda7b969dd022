"""Errors in the client's protocol, and usage read from either protocol's answers."""

from __future__ import annotations

import json

import pytest

from gateway.core.usage import usage_of
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoInstanceAvailable,
    Shed,
    ShuttingDown,
    UpstreamTimeout,
)
from gateway.ingress.dialect import ANTHROPIC, BY_PATH, OPENAI


def test_openai_errors_keep_the_native_shape_and_end_streams_with_done() -> None:
    error = Shed("too busy", retry_after_s=2)
    assert json.loads(OPENAI.body(error)) == {
        "error": {"message": "too busy", "type": "rate_limit_error", "code": "shed"}
    }
    ending = OPENAI.stream_ending(error)
    assert ending.startswith(b"data: {") and ending.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (InvalidRequest("bad"), "invalid_request_error"),
        (Shed("busy"), "rate_limit_error"),
        (NoInstanceAvailable("none"), "overloaded_error"),
        (UpstreamTimeout("slow", phase="first_byte"), "timeout_error"),
    ],
)
def test_anthropic_errors_use_anthropic_types(error: Exception, kind: str) -> None:
    assert isinstance(error, InvalidRequest | Shed | NoInstanceAvailable | UpstreamTimeout)
    body = json.loads(ANTHROPIC.body(error))
    assert body == {"type": "error", "error": {"type": kind, "message": error.message}}


def test_an_anthropic_stream_ends_with_an_error_event_and_no_done() -> None:
    ending = ANTHROPIC.stream_ending(UpstreamTimeout("slow", phase="idle"))
    event, data = ending.decode().strip().split("\n")
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: "))["error"]["type"] == "timeout_error"
    assert b"[DONE]" not in ending


@pytest.mark.parametrize(
    "kind", [GatewayError, InvalidRequest, ModelNotFound, Shed, UpstreamTimeout, ShuttingDown]
)
def test_every_error_class_carries_its_own_code_as_a_header(kind: type[GatewayError]) -> None:
    assert kind.header == (b"x-gateway-error", kind.code.encode())


def test_only_the_messages_route_speaks_anthropic() -> None:
    assert BY_PATH == {"/v1/messages": ANTHROPIC}


@pytest.mark.parametrize(
    ("data", "anthropic", "tokens"),
    [
        (b'{"usage":{"prompt_tokens":3,"completion_tokens":17,"total_tokens":20}}', False, 17),
        (b'{"usage":{"input_tokens":3,"output_tokens":42}}', True, 42),
        # A stream: message_start says 1, the final message_delta the real count.
        (
            b'event: message_start\ndata: {"usage":{"input_tokens":3,"output_tokens":1}}\n\n'
            b'event: message_delta\ndata: {"usage":{"output_tokens":250}}\n\n',
            True,
            250,
        ),
        (b'{"choices":[]}', False, None),
        # Each route reads its own protocol's keys only.
        (b'{"usage":{"input_tokens":3,"output_tokens":42}}', False, None),
    ],
)
def test_output_tokens_by_the_routes_protocol(
    data: bytes, anthropic: bool, tokens: int | None
) -> None:
    assert usage_of(data, anthropic=anthropic).output_tokens == tokens


def test_an_engines_error_event_gives_its_status_in_each_dialect() -> None:
    # vLLM's `code` is the HTTP status; Anthropic's error type names one.
    assert OPENAI.error_status({"error": {"message": "x", "code": 400}}) == 400
    assert OPENAI.error_status({"error": {"code": "bad"}}) == 502
    assert OPENAI.error_status({"error": {"code": True}}) == 502
    assert OPENAI.error_status({"error": "flat"}) == 502
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert ANTHROPIC.error_status(overloaded) == 529
    assert ANTHROPIC.error_status({"error": {"type": "invalid_request_error"}}) == 400
    assert ANTHROPIC.error_status({"error": {"type": "timeout_error"}}) == 504
    assert ANTHROPIC.error_status({"error": {"type": "internal_error"}}) == 500
    assert ANTHROPIC.error_status({"error": {"type": "mystery"}}) == 502
