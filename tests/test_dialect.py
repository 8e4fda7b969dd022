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
from gateway.ingress.dialect import ANTHROPIC, OPAQUE, OPENAI, RESPONSES, dialect_for


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


def test_each_route_speaks_its_protocols_dialect() -> None:
    assert dialect_for("/v1/messages") is ANTHROPIC
    assert dialect_for("/v1/responses") is RESPONSES
    for path in ("/v1/chat/completions", "/v1/audio/transcriptions", "/tokenize", "/v2/rerank"):
        assert dialect_for(path) is OPENAI
    assert dialect_for("/v1/some/plugin") is OPAQUE  # a route the gateway does not know
    assert dialect_for("/admin/state") is OPENAI  # not proxied: the gateway's own answers


def test_a_responses_stream_ends_with_its_last_response_event_or_an_error() -> None:
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
    assert not RESPONSES.ended(delta)
    for name in (b"response.completed", b"response.failed", b"response.incomplete", b"error"):
        assert RESPONSES.ended(b"event: " + name + b'\ndata: {"type":"x"}\n\n')
    # No [DONE] in this protocol: a stream that sends one has not ended as it should.
    assert not RESPONSES.ended(b"data: [DONE]\n\n")


def test_a_broken_responses_stream_ends_with_an_error_event_numbered_after_the_last() -> None:
    last = (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":" a","sequence_number":41}\n\n'
    )
    ending = RESPONSES.stream_ending(UpstreamTimeout("slow", phase="idle"), last)
    assert ending is not None
    name, data = ending.split(b"\n", 1)
    assert name == b"event: error" and ending.endswith(b"\n\n")
    payload = json.loads(data.removeprefix(b"data: "))
    assert payload == {
        "type": "error",
        "code": "upstream_timeout",
        "message": "slow",
        "param": None,
        "sequence_number": 42,
    }
    assert (
        json.loads(RESPONSES.stream_ending(Shed("x"))[len(b"event: error\ndata: ") :])[
            "sequence_number"
        ]
        == 0
    )


def test_a_stream_of_an_unknown_protocol_is_never_given_a_foreign_ending() -> None:
    assert OPAQUE.stream_ending(UpstreamTimeout("slow", phase="idle")) is None
    assert OPAQUE.ended(b"data: anything\n\n") and OPAQUE.ended(b"")
    assert not OPAQUE.has_error_event(b'data: {"error":{"code":500}}\n\n')


@pytest.mark.parametrize(
    ("data", "protocol", "tokens"),
    [
        (b'{"usage":{"prompt_tokens":3,"completion_tokens":17,"total_tokens":20}}', "openai", 17),
        (b'{"usage":{"input_tokens":3,"output_tokens":42}}', "anthropic", 42),
        (b'{"usage":{"input_tokens":3,"output_tokens":42}}', "responses", 42),
        # A stream: message_start says 1, the final message_delta the real count.
        (
            b'event: message_start\ndata: {"usage":{"input_tokens":3,"output_tokens":1}}\n\n'
            b'event: message_delta\ndata: {"usage":{"output_tokens":250}}\n\n',
            "anthropic",
            250,
        ),
        (b'{"choices":[]}', "openai", None),
        # Each route reads its own protocol's keys only.
        (b'{"usage":{"input_tokens":3,"output_tokens":42}}', "openai", None),
        (b'{"usage":{"prompt_tokens":3,"completion_tokens":17}}', "responses", None),
    ],
)
def test_output_tokens_by_the_routes_protocol(
    data: bytes, protocol: str, tokens: int | None
) -> None:
    assert usage_of(data, protocol=protocol).output_tokens == tokens


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
