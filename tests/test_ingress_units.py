"""Header handling, body reading and request facts, without a server."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.ingress.body import ClientGone, read_body, read_facts
from gateway.ingress.form import read_form_facts
from gateway.ingress.forwarded import TrustedProxies
from gateway.ingress.headers import response_headers, split_request_headers


def test_request_headers_sorted_into_forwarded_and_gateway() -> None:
    raw = [
        (b"host", b"gw:8080"),
        (b"content-length", b"12"),
        (b"connection", b"keep-alive, X-Secret-Hop"),
        (b"x-secret-hop", b"1"),
        (b"transfer-encoding", b"chunked"),
        (b"upgrade", b"h2c"),
        (b"x-gateway-timeout", b"2.5"),
        (b"authorization", b"Bearer sk"),
        (b"x-forwarded-for", b"10.0.0.1"),
        (b"x-forwarded-for", b"10.0.0.2"),
        (b"accept", b"*/*"),
    ]
    out = split_request_headers(raw, "192.0.2.9", "https", TrustedProxies(["192.0.2.0/24"]))
    assert out.content_length == 12
    assert out.gateway == {b"x-gateway-timeout": b"2.5"}
    assert out.forward == [
        ("authorization", "Bearer sk"),
        ("accept", "*/*"),
        ("x-forwarded-for", "10.0.0.1, 10.0.0.2, 192.0.2.9"),
        ("x-forwarded-proto", "https"),
    ]


def test_existing_forwarded_proto_is_kept_from_a_trusted_proxy() -> None:
    raw = [(b"x-forwarded-proto", b"https")]
    out = split_request_headers(raw, "10.1.2.3", "http", TrustedProxies(["10.0.0.0/8"]))
    assert out.forward == [("x-forwarded-for", "10.1.2.3"), ("x-forwarded-proto", "https")]
    untrusted = split_request_headers(raw, "192.0.2.9", "http", TrustedProxies(["10.0.0.0/8"]))
    assert untrusted.forward == [("x-forwarded-for", "192.0.2.9"), ("x-forwarded-proto", "http")]


@pytest.mark.parametrize("value", [b"-1", b"12a", b"", b" 1"])
def test_invalid_content_length_is_rejected(value: bytes) -> None:
    with pytest.raises(ValueError):
        split_request_headers([(b"content-length", value)], None, "http")


def test_response_headers_drop_hop_by_hop_and_lowercase() -> None:
    raw = [
        (b"Content-Type", b"text/event-stream"),
        (b"Content-Length", b"99"),
        (b"Connection", b"close, X-Internal"),
        (b"X-Internal", b"1"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Request-Id", b"abc"),
        # An upstream (another gateway, say) cannot pass its error off as this gateway's.
        (b"X-Gateway-Error", b"shed"),
    ]
    assert response_headers(raw, drop_length=False) == [
        (b"content-type", b"text/event-stream"),
        (b"content-length", b"99"),
        (b"x-request-id", b"abc"),
    ]
    assert (b"content-length", b"99") not in response_headers(raw, drop_length=True)


class Receiver:
    """An ASGI receive callable fed from a list of messages."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        return self.messages.pop(0)


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


async def test_read_body_single_and_multi_part() -> None:
    assert await read_body(Receiver([body(b"abc")]), 10, 3) == b"abc"
    parts = Receiver([body(b"ab", True), body(b"cd", True), body(b"e")])
    assert await read_body(parts, 10, None) == b"abcde"


async def test_declared_length_over_limit_reads_nothing() -> None:
    receiver = Receiver([body(b"x" * 20)])
    with pytest.raises(PayloadTooLarge):
        await read_body(receiver, 10, 20)
    assert receiver.calls == 0


async def test_chunked_body_stops_at_the_limit() -> None:
    receiver = Receiver([body(b"x" * 6, True)] * 100)
    with pytest.raises(PayloadTooLarge):
        await read_body(receiver, 10, None)
    assert receiver.calls == 2  # refused as soon as the running total passed the limit


async def test_disconnect_while_reading() -> None:
    with pytest.raises(ClientGone):
        await read_body(Receiver([body(b"x", True), {"type": "http.disconnect"}]), 10, None)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"model":"m"}', ("m", False, None)),
        (b'{"model":"m","stream":true,"max_tokens":7}', ("m", True, 7)),
        (b'{"model":"m","max_completion_tokens":9}', ("m", False, 9)),
        (b'{"model":"m","max_output_tokens":7}', ("m", False, 7)),  # the Responses API's
        # No model named: the gateway's only pool may take it (the ingress decides).
        (b"{}", ("", False, None)),
        (b'{"model":""}', ("", False, None)),
        (b"", ("", False, None)),
        (b" \r\n", ("", False, None)),
    ],
)
def test_read_facts(raw: bytes, expected: tuple[str, bool, int | None]) -> None:
    facts = read_facts(raw)
    assert (facts.model, facts.stream, facts.max_tokens) == expected


@pytest.mark.parametrize(
    "raw",
    [
        b"nope",
        b"[]",
        b"null",
        b'{"model":1}',
        b'{"model":null,"max_output_tokens":-1}',
        b'{"model":"m","stream":1}',
        b'{"model":"m","max_tokens":true}',
        b"[" * 50_000,
        b"\xff",
    ],
)
def test_read_facts_rejects(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        read_facts(raw)


def test_a_forms_fields_are_read_as_the_engines_form_parser_reads_them() -> None:
    boundary = "b0und4ry"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"{extra}\r\n\r\n{value}\r\n'
        for name, extra, value in (
            ("model", "", "first"),
            ("file", '; filename="model"', "not a field"),  # a file, whatever its name
            ("model", "", " second "),  # given twice: the last counts, as it is
            ("stream", "", "True"),
        )
    ]
    body = ("".join(parts) + f"--{boundary}--\r\n").encode()
    facts = read_form_facts(body, f"multipart/form-data; boundary={boundary}".encode())
    assert (facts.model, facts.stream, facts.form) == (" second ", True, True)
