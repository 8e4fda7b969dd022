"""`ingress.whole`: which whole answers are fetched as streams, and what the client gets at the
end of one (its answer, the engine's error, or the gateway's), driven without a server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.config.models import ResumePolicy
from gateway.errors import UpstreamStreamCut
from gateway.ingress.body import read_facts
from gateway.ingress.dialect import ANTHROPIC, OPENAI
from gateway.ingress.whole import WholeAnswer, fetch_as_stream

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def fetch(
    path: str = CHAT, policy: ResumePolicy | None = None, raw: bytes | None = None, **extra: Any
) -> tuple[bytes, Any] | None:
    """What `fetch_as_stream` makes of a request: REQUEST with `extra`, or the bytes `raw`."""
    body = raw if raw is not None else json.dumps({**REQUEST, **extra}).encode()
    return fetch_as_stream(path, read_facts(body), policy or ResumePolicy(), body)


STREAMED = {**REQUEST, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(REQUEST).encode(),
        json.dumps(REQUEST, indent=2).encode() + b"\n",
        json.dumps({**REQUEST, "stream": False}).encode(),
    ],
    ids=["compact", "indented", "stream-false"],
)
def test_a_whole_chat_request_is_fetched_as_a_stream_with_usage(raw: bytes) -> None:
    fetched = fetch(raw=raw)
    assert fetched is not None
    body, streamed = fetched
    assert json.loads(body) == STREAMED
    assert body.count(b'"stream"') == 1  # no key named twice
    assert streamed.stream and streamed.model == "m" and streamed.max_tokens == 8
    assert streamed.request == STREAMED


@pytest.mark.parametrize(
    "extra",
    [
        {"stream": True},
        {"stream_options": {"include_usage": True}},
        {"kv_transfer_params": {"do_remote_decode": True}},
        {"ec_transfer_params": {}},
        {"use_beam_search": True},
        {"include_reasoning": False},
        {"return_token_ids": True},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"n": 3},
    ],
    ids=lambda extra: next(iter(extra)),
)
def test_what_a_stream_would_change_is_sent_as_it_came(extra: dict[str, Any]) -> None:
    assert fetch(**extra) is None


@pytest.mark.parametrize(
    "extra",
    [{"tools": []}, {"include_reasoning": True}, {"stream_options": None}, {"n": 1}],
    ids=["no-tools", "reasoning-on", "null-options", "one-choice"],
)
def test_fields_that_ask_for_nothing_do_not_keep_a_request_from_streaming(
    extra: dict[str, Any],
) -> None:
    fetched = fetch(**extra)
    assert fetched is not None
    assert json.loads(fetched[0]) == {**REQUEST, **extra, **STREAMED}
    assert fetched[0].count(b'"stream_options"') == 1  # no key named twice


def test_other_routes_and_a_policy_without_whole_answers_send_as_it_came() -> None:
    assert fetch("/v1/embeddings") is None
    assert fetch(policy=ResumePolicy(whole_answers=False)) is None
    assert fetch(policy=ResumePolicy(enabled=False)) is None
    structured = {"output_config": {"format": {"type": "json_schema", "schema": {}}}}
    assert fetch(MESSAGES, **structured) is None
    fetched = fetch(MESSAGES)
    assert fetched is not None and json.loads(fetched[0]) == {**REQUEST, "stream": True}


class Client:
    """What the client was sent."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: Any) -> None:
        self.messages.append(dict(message))

    @property
    def status(self) -> int:
        (start,) = [m for m in self.messages if m["type"] == "http.response.start"]
        return int(start["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        (start,) = [m for m in self.messages if m["type"] == "http.response.start"]
        return dict(start["headers"])

    @property
    def json(self) -> Any:
        return json.loads(b"".join(m.get("body", b"") for m in self.messages))


def chunk(content: str) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": None}
    value = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    value["choices"] = [choice]
    return b"data: " + json.dumps(value).encode() + b"\n\n"


async def relayed(whole: WholeAnswer, *pieces: bytes) -> None:
    """What the relay sends: the stream's head, then its bytes in pieces (not cut at events)."""
    await whole({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream"), (b"x-request-id", b"r1"),
        (b"x-gateway-attempts", b"1")]})  # fmt: skip
    for piece in pieces:
        await whole({"type": "http.response.body", "body": piece, "more_body": True})


async def test_events_split_anywhere_make_one_answer_with_the_final_headers() -> None:
    client = Client()
    whole = WholeAnswer(client, CHAT)
    stream = chunk("Hel") + chunk("lo") + b"data: [DONE]\n\n"
    await relayed(whole, stream[:7], stream[7:50], stream[50:])
    await whole({"type": "http.response.body", "body": b""})
    assert await whole.finish(None, 3, b"b", OPENAI) == 200
    assert client.status == 200
    assert client.json["choices"][0]["message"]["content"] == "Hello"
    headers = client.headers
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"x-gateway-attempts"] == b"3" and headers[b"x-gateway-instance"] == b"b"
    assert headers[b"x-request-id"] == b"r1"  # the engine's own headers stay
    assert int(headers[b"content-length"]) == len(json.dumps(client.json, separators=(",", ":")))


async def test_a_long_answer_is_read_in_runs_and_holds_little_raw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(WholeAnswer, "FOLD_BYTES", 1024)
    client = Client()
    whole = WholeAnswer(client, CHAT)
    words = [f"w{i} " for i in range(400)]
    stream = b"".join(chunk(w) for w in words) + b"data: [DONE]\n\n"
    pieces = [stream[i : i + 97] for i in range(0, len(stream), 97)]  # cut inside events
    held = []
    await relayed(whole)
    for piece in pieces:
        await whole({"type": "http.response.body", "body": piece, "more_body": True})
        held.append(whole._held)
    assert max(held) <= 1024 + 97  # a run's worth at most: read once past it
    await whole({"type": "http.response.body", "body": b""})
    assert await whole.finish(None, 1, b"a", OPENAI) == 200
    assert client.json["choices"][0]["message"]["content"] == "".join(words)


async def test_the_engines_error_event_is_the_answer_even_with_no_end_after_it() -> None:
    client = Client()
    whole = WholeAnswer(client, CHAT)
    error = {"error": {"message": "boom", "type": "BadRequestError", "code": 400}}
    await relayed(whole, chunk("a"), b"data: " + json.dumps(error).encode() + b"\n\n")
    cut = UpstreamStreamCut("the upstream ended the stream before its last event")
    assert await whole.finish(cut, 1, b"a", OPENAI) == 400
    assert client.json == error
    assert b"x-gateway-error" not in client.headers


async def test_a_stream_the_gateway_ended_is_the_gateways_error() -> None:
    client = Client()
    whole = WholeAnswer(client, MESSAGES)
    await relayed(whole, b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n')
    cut = UpstreamStreamCut("the upstream ended the stream before its last event")
    assert await whole.finish(cut, 2, b"a", ANTHROPIC) == 502
    assert client.json["type"] == "error"
    assert client.headers[b"x-gateway-error"] == b"upstream_stream_cut"


@pytest.mark.parametrize(
    "events",
    [
        [b"data: {not json\n\n", b"data: [DONE]\n\n"],
        [
            b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
            b'"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}\n\n',
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"input_json_delta","partial_json":"{\\"a\\""}}\n\n',
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
        ],
    ],
    ids=["unreadable-event", "tool-input-cut-short"],
)
async def test_a_stream_no_answer_can_be_made_of_is_a_502(events: list[bytes]) -> None:
    client = Client()
    path = CHAT if events[-1].startswith(b"data: [DONE]") else MESSAGES
    whole = WholeAnswer(client, path)
    await relayed(whole, *events)
    assert await whole.finish(None, 1, b"a", OPENAI) == 502
    assert client.headers[b"x-gateway-error"] == b"upstream_protocol_error"


async def test_a_restart_forgets_what_was_assembled() -> None:
    client = Client()
    whole = WholeAnswer(client, CHAT)
    await relayed(whole, chunk("thinking abo"))
    whole.restart()
    await relayed(whole, chunk("fresh"), b"data: [DONE]\n\n")
    assert await whole.finish(None, 2, b"b", OPENAI) == 200
    assert client.json["choices"][0]["message"]["content"] == "fresh"
