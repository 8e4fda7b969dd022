"""Streams translated between Anthropic Messages and OpenAI Chat Completions
(`gateway.core.translate_stream`): every event type, any chunking, the official SDKs' types and
clients, and the whole answer a translated stream assembles into."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.translate import (
    ChatToMessagesStream,
    MessagesToChatStream,
    chat_answer_to_messages,
    messages_answer_to_chat,
)
from loadtests.fake_vllm.anthropic import ERROR_EVENT, EventWriter
from loadtests.fake_vllm.responses import DONE, STREAM_ERROR_EVENT, ChunkWriter
from tests.translate_samples import (
    CREATED,
    AnthropicSample,
    Block,
    Call,
    OpenAISample,
    anthropic_assembled,
    check_anthropic_stream,
    check_openai_stream,
    openai_assembled,
    parsed_arguments,
    pieces_of,
)

Translator = MessagesToChatStream | ChatToMessagesStream


def to_chat(data: bytes, include_usage: bool = True) -> bytes:
    stream = MessagesToChatStream(include_usage, created=CREATED)
    out = stream.feed(data) + stream.finish()
    assert stream.ended or stream.failed
    return out


def to_messages(data: bytes, model: str = "fallback-model") -> bytes:
    stream = ChatToMessagesStream(model)
    out = stream.feed(data) + stream.finish()
    assert stream.ended or stream.failed
    return out


def fed_in_pieces(make: Any, data: bytes, cuts: list[int]) -> bytes:
    stream = make()
    out = []
    start = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        out.append(stream.feed(data[start:cut]))
        start = cut
    return b"".join(out) + stream.finish()


TOOL_SAMPLE = AnthropicSample(
    [
        Block("thinking", ["Let me ", "think."]),
        Block("text", ["I'll check ", "the weather ", 'in Paris.\n"quoted" é']),
        Block("tool_use", ["", '{"city": ', '"Paris", "unit"', ': "c"}'], "toolu_01A", "weather"),
        Block("tool_use", ['{"city": "Rome"}'], "toolu_01B", "weather"),
    ],
    stop_reason="tool_use",
    cache_read=50,
)
TOOL_CHAT = OpenAISample(
    ["Checking", " now."],
    [
        Call("chatcmpl-tool-a1", "weather", ['{"city": "Pa', 'ris"}']),
        Call("functions.weather:1", "weather", ["{}"]),
    ],
    finish="tool_calls",
    cached=4,
)


# --- Anthropic -> OpenAI ---------------------------------------------------------------------


def test_the_fake_backends_anthropic_stream() -> None:
    writer = EventWriter("msg_7", '"claude-x"')
    data = writer.start(11) + writer.delta(0, 3) + writer.delta(3, 5) + writer.finish(5)
    chunks = check_openai_stream(to_chat(data))
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": None},
        {"content": "the model says"},
        {"content": " hello to"},
        {},
    ]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
    assert {(c["id"], c["model"], c["created"]) for c in chunks} == {
        ("chatcmpl-msg_7", "claude-x", CREATED)
    }
    assert to_chat(data).endswith(b"data: [DONE]\n\n")


def test_text_and_tool_use_blocks_become_content_and_tool_calls() -> None:
    out = to_chat(TOOL_SAMPLE.stream())
    deltas = [c["choices"][0]["delta"] for c in check_openai_stream(out)[:-1]]
    assert deltas == [
        {"role": "assistant", "content": None},
        {"content": "I'll check "},
        {"content": "the weather "},
        {"content": "in Paris.\n\"quoted\" é"},
        {"tool_calls": [{"index": 0, "id": "toolu_01A", "type": "function",
                         "function": {"name": "weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris", "unit"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "c"}'}}]},
        {"tool_calls": [{"index": 1, "id": "toolu_01B", "type": "function",
                         "function": {"name": "weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"city": "Rome"}'}}]},
        {},
    ]  # fmt: skip
    last = check_openai_stream(out)[-1]
    assert last["usage"] == {"prompt_tokens": 62, "completion_tokens": 34, "total_tokens": 96,
                             "prompt_tokens_details": {"cached_tokens": 50}}  # fmt: skip


def test_a_matched_stop_sequence_and_no_usage_chunk() -> None:
    sample = AnthropicSample([Block("text", ["a"])], stop_reason="stop_sequence",
                             stop_sequence="###", ping=False)  # fmt: skip
    out = to_chat(sample.stream(), include_usage=False)
    chunks = check_openai_stream(out)
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "stop", "stop_reason": "###"}  # fmt: skip
    assert all("usage" not in c for c in chunks)


def test_an_error_event_ends_the_openai_stream_without_done() -> None:
    writer = EventWriter("msg_1", '"m"')
    data = writer.start(3) + writer.delta(0, 2) + ERROR_EVENT + writer.finish(2)
    stream = MessagesToChatStream(True)
    out = stream.feed(data)
    assert stream.failed and not stream.ended
    assert stream.finish() == b"" and stream.feed(b"more") == b""
    *_, last = out.split(b"\n\n")[:-1]
    assert json.loads(last[len(b"data: ") :]) == {
        "error": {"message": "Overloaded", "type": "service_unavailable_error",
                  "code": "overloaded_error"}
    }  # fmt: skip
    assert b"[DONE]" not in out
    check_openai_stream(out)


def test_an_anthropic_stream_cut_short() -> None:
    data = TOOL_SAMPLE.stream()
    cut = data.index(b"event: message_delta")
    stream = MessagesToChatStream(True)
    out = stream.feed(data[:cut])
    assert not stream.ended and not stream.failed
    ending = stream.finish()
    assert stream.failed and ending.startswith(b'data: {"error":')
    assert json.loads(ending[6:])["error"]["type"] == "server_error"
    # Cut after the stop reason: the answer was whole; only its end is written.
    cut = data.index(b"event: message_stop")
    stream = MessagesToChatStream(True, created=CREATED)
    out = stream.feed(data[:cut]) + stream.finish()
    assert stream.ended and out == to_chat(data)


def test_an_unterminated_last_event_is_read_and_crlf_line_ends_too() -> None:
    data = TOOL_SAMPLE.stream()
    assert to_chat(data[:-2]) == to_chat(data)
    assert to_chat(data.replace(b"\n", b"\r\n")) == to_chat(data)
    assert to_chat(data.replace(b"\n", b"\r")) == to_chat(data)


def test_an_event_that_is_not_json() -> None:
    stream = MessagesToChatStream(False)
    out = stream.feed(b"event: message_start\ndata: {oops\n\n")
    assert stream.failed and b'"type":"server_error"' in out


def test_an_answer_with_nothing_in_it_has_empty_content() -> None:
    sample = AnthropicSample([], stop_reason="max_tokens")
    out = to_chat(sample.stream())
    assert openai_assembled(out) == messages_answer_to_chat(sample.whole(), created=CREATED)
    assert openai_assembled(out)["choices"][0]["message"]["content"] == ""


# --- OpenAI -> Anthropic ---------------------------------------------------------------------


def test_the_fake_backends_openai_stream() -> None:
    writer = ChunkWriter(True, "9", '"llama"')
    data = writer.role() + writer.tokens(0, 2, False) + writer.tokens(2, 3, True)
    data += writer.usage(6, 3) + DONE
    out = check_anthropic_stream(to_messages(data))
    assert out == [
        {"type": "message_start", "message": {
            "id": "msg_chatcmpl-9", "type": "message", "role": "assistant", "model": "llama",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "the model"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": " says"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
         "usage": {"input_tokens": 6, "output_tokens": 3}},
        {"type": "message_stop"},
    ]  # fmt: skip


def test_tool_call_deltas_become_tool_use_blocks() -> None:
    out = check_anthropic_stream(to_messages(TOOL_CHAT.stream()))
    assert [(e["type"], e.get("index")) for e in out] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert out[5]["content_block"] == {"type": "tool_use", "id": "chatcmpl-tool-a1",
                                       "name": "weather", "input": {}}  # fmt: skip
    assert out[6]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Pa'}
    assert out[9]["content_block"]["id"] == "functions_weather_1"
    assert out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2]["usage"] == {"input_tokens": 5, "output_tokens": 21,
                                "cache_read_input_tokens": 4}  # fmt: skip


def test_tool_calls_whole_in_one_chunk() -> None:
    sample = OpenAISample([], TOOL_CHAT.calls, finish="tool_calls", calls_together=True)
    out = to_messages(sample.stream())
    check_anthropic_stream(out)
    assert anthropic_assembled(out) == chat_answer_to_messages(sample.whole())


def test_a_matched_stop_string_is_the_stop_sequence() -> None:
    sample = OpenAISample(["x"], finish="stop", matched="</answer>")
    delta = check_anthropic_stream(to_messages(sample.stream()))[-2]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "</answer>"}


@pytest.mark.parametrize(
    "error",
    [
        STREAM_ERROR_EVENT,  # vLLM before 0.10
        b'data: {"error": {"message": "engine error mid-stream", "type": "InternalServerError",'
        b' "param": null, "code": 500}}\n\n',
    ],
)
def test_vllms_error_event_becomes_an_anthropic_error_event(error: bytes) -> None:
    writer = ChunkWriter(True, "1", '"m"')
    stream = ChatToMessagesStream("m")
    out = stream.feed(writer.role() + writer.tokens(0, 2, False) + error + DONE)
    assert stream.failed and not stream.ended and stream.finish() == b""
    assert out.endswith(
        b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
        b'"message":"engine error mid-stream"}}\n\n'
    )
    check_anthropic_stream(out)


def test_an_openai_stream_cut_short() -> None:
    data = TOOL_CHAT.stream()
    stream = ChatToMessagesStream("m")
    stream.feed(data[: data.index(b'"finish_reason": "tool_calls"')])
    ending = stream.finish()
    assert stream.failed and ending.startswith(b"event: error\n")
    # Cut after the finish reason (before the usage and [DONE]): the answer is whole.
    stream = ChatToMessagesStream("m")
    cut = data.index(b'"choices": [], "usage"')
    out = stream.feed(data[:cut]) + stream.finish()
    assert stream.ended
    assert check_anthropic_stream(out)[-2]["usage"] == {"input_tokens": 0, "output_tokens": 0}


def test_interleaved_tool_calls_end_the_stream_with_an_error() -> None:
    sample = OpenAISample([], [Call("a", "f", ["{}"]), Call("b", "g", ["{}"])], "tool_calls")
    late = sample._chunk({"tool_calls": [{"index": 0, "function": {"arguments": " "}}]})
    data = sample.stream()
    at = data.index(b'"finish_reason": "tool_calls"')
    at = data.rindex(b"data: ", 0, at)
    stream = ChatToMessagesStream("m")
    out = stream.feed(data[:at] + late + data[at:])
    assert stream.failed and out.endswith(b'"the upstream interleaved its tool calls"}}\n\n')


def test_only_the_first_choice_and_no_reasoning() -> None:
    sample = OpenAISample(["x"])
    data = sample.stream().replace(
        b'"delta": {"content": "x"}', b'"delta": {"content": "x", "reasoning_content": "hm"}'
    )
    other = {"index": 1, "delta": {"content": "other"}, "finish_reason": None}
    data = sample._data({"choices": [other]}) + data
    assert anthropic_assembled(to_messages(data)) == chat_answer_to_messages(sample.whole())


def test_the_model_given_when_the_chunks_name_none() -> None:
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    out = to_messages(b"data: " + json.dumps(chunk).encode() + b"\n\n" + DONE, "named-here")
    assert check_anthropic_stream(out)[0]["message"]["model"] == "named-here"
    only_done = check_anthropic_stream(to_messages(DONE))
    assert [e["type"] for e in only_done] == ["message_start", "message_delta", "message_stop"]


# --- any chunking --------------------------------------------------------------------------

SAMPLES = [
    (lambda: MessagesToChatStream(True, created=CREATED), TOOL_SAMPLE.stream()),
    (lambda: ChatToMessagesStream("m"), TOOL_CHAT.stream()),
    (lambda: MessagesToChatStream(False), TOOL_SAMPLE.stream().replace(b"\n", b"\r\n")),
]


@pytest.mark.parametrize(("make", "data"), SAMPLES)
def test_every_split_gives_the_same_stream(make: Any, data: bytes) -> None:
    whole = fed_in_pieces(make, data, [])
    assert whole.endswith((b"data: [DONE]\n\n", b'data: {"type":"message_stop"}\n\n'))
    for cut in range(1, len(data)):
        assert fed_in_pieces(make, data, [cut]) == whole, cut
    assert fed_in_pieces(make, data, list(range(len(data)))) == whole  # a byte at a time


def test_a_long_stream_costs_linear_time_and_keeps_only_a_tail() -> None:
    """A 6 MB stream of 50,000 deltas fed in 61-byte pieces: quadratic buffering would take
    minutes; the held tail never passes one event."""
    sample = AnthropicSample([Block("text", ["tok "] * 50_000)], stop_reason="max_tokens")
    data = sample.stream()
    stream = MessagesToChatStream(True)
    longest_event = max(len(e) for e in data.split(b"\n\n"))
    started = time.perf_counter()
    size = 0
    for at in range(0, len(data), 61):
        size += len(stream.feed(data[at : at + 61]))
        assert len(stream._events._tail) <= longest_event + 61
    assert stream.ended and time.perf_counter() - started < 30
    assert size > len(data)


# --- a translated stream assembles into the translated whole answer --------------------------


def test_an_anthropic_stream_translated_assembles_into_the_translated_answer() -> None:
    translated = messages_answer_to_chat(TOOL_SAMPLE.whole(), created=CREATED)
    assembled = openai_assembled(to_chat(TOOL_SAMPLE.stream()))
    assert parsed_arguments(assembled) == parsed_arguments(translated)
    openai.types.chat.ChatCompletion.model_validate(assembled)


def test_an_openai_stream_translated_assembles_into_the_translated_answer() -> None:
    assembled = anthropic_assembled(to_messages(TOOL_CHAT.stream()))
    assert assembled == chat_answer_to_messages(TOOL_CHAT.whole())
    anthropic.types.Message.model_validate(assembled)


# --- the official SDKs read the translated streams -------------------------------------------


class Upstream(http.server.ThreadingHTTPServer):
    """A loopback server for the SDKs to read translated answers from: every POST gets its one
    canned answer (status, content type, body)."""

    answer: tuple[int, str, bytes] = (500, "text/plain", b"")

    def serve(self, status: int, body: bytes, stream: bool) -> str:
        self.answer = (status, "text/event-stream" if stream else "application/json", body)
        return f"http://127.0.0.1:{self.server_address[1]}"


class Canned(http.server.BaseHTTPRequestHandler):
    server: Upstream

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        status, kind, body = self.server.answer
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    server = Upstream(("127.0.0.1", 0), Canned)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def openai_client(server: Upstream, status: int, body: bytes, stream: bool) -> openai.OpenAI:
    url = server.serve(status, body, stream)
    return openai.OpenAI(api_key="k", base_url=f"{url}/v1", max_retries=0, timeout=10)


def anthropic_client(
    server: Upstream, status: int, body: bytes, stream: bool
) -> anthropic.Anthropic:
    url = server.serve(status, body, stream)
    return anthropic.Anthropic(api_key="k", base_url=url, max_retries=0, timeout=10)


CHAT_ARGS: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
MESSAGES_ARGS: dict[str, Any] = {**CHAT_ARGS, "max_tokens": 100}


def test_the_openai_sdk_reads_a_translated_stream_as_the_translated_answer(
    upstream: Upstream,
) -> None:
    client = openai_client(upstream, 200, to_chat(TOOL_SAMPLE.stream()), stream=True)
    with client.chat.completions.stream(**CHAT_ARGS) as events:
        final = events.get_final_completion()
    whole = messages_answer_to_chat(TOOL_SAMPLE.whole(), created=CREATED)
    client = openai_client(upstream, 200, json.dumps(whole).encode(), stream=False)
    direct = client.chat.completions.create(**CHAT_ARGS)
    assert final.choices[0].message.content == direct.choices[0].message.content
    calls = final.choices[0].message.tool_calls or []
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c.id, c.function.name, json.loads(c.function.arguments))  # type: ignore[union-attr]
        for c in direct.choices[0].message.tool_calls or []
    ]
    assert final.usage == direct.usage and final.choices[0].finish_reason == "tool_calls"


def test_the_anthropic_sdk_reads_a_translated_stream_as_the_translated_answer(
    upstream: Upstream,
) -> None:
    client = anthropic_client(upstream, 200, to_messages(TOOL_CHAT.stream()), stream=True)
    with client.messages.stream(**MESSAGES_ARGS) as events:
        final = events.get_final_message()
    whole = chat_answer_to_messages(TOOL_CHAT.whole())
    client = anthropic_client(upstream, 200, json.dumps(whole).encode(), stream=False)
    direct = client.messages.create(**MESSAGES_ARGS)
    assert final.model_dump() == direct.model_dump()


def test_the_sdks_raise_the_translated_error_events(upstream: Upstream) -> None:
    writer = EventWriter("msg_1", '"m"')
    data = to_chat(writer.start(3) + writer.delta(0, 2) + ERROR_EVENT)
    client = openai_client(upstream, 200, data, stream=True)
    with pytest.raises(openai.APIError) as raised:
        list(client.chat.completions.create(**CHAT_ARGS, stream=True))
    assert raised.value.message == "Overloaded"
    assert raised.value.code == "overloaded_error"

    chunks = ChunkWriter(True, "1", '"m"')
    data = to_messages(chunks.role() + chunks.tokens(0, 2, False) + STREAM_ERROR_EVENT + DONE)
    client = anthropic_client(upstream, 200, data, stream=True)
    with pytest.raises(anthropic.APIStatusError) as failed:
        list(client.messages.create(**MESSAGES_ARGS, stream=True))
    assert "engine error mid-stream" in str(failed.value)


# --- property tests ------------------------------------------------------------------------

_text = st.text(max_size=12)
_key = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_key, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def anthropic_samples(draw: st.DrawFn) -> AnthropicSample:
    blocks = []
    calls = 0
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["text", "tool_use", "thinking"]))
        if kind == "tool_use":
            calls += 1
            text = json.dumps(draw(st.dictionaries(_key, _json, max_size=4)))
            cuts = draw(st.lists(st.integers(0, len(text)), max_size=5))
            blocks.append(Block(kind, pieces_of(text, cuts), f"toolu_{calls}", draw(_key)))
        else:
            blocks.append(Block(kind, draw(st.lists(_text.filter(bool), max_size=5))))
    return AnthropicSample(
        blocks,
        stop_reason=draw(st.sampled_from(["end_turn", "max_tokens", "tool_use", "refusal"])),
        input_tokens=draw(st.integers(0, 10**6)),
        output_tokens=draw(st.integers(0, 10**6)),
        cache_read=draw(st.integers(0, 100)),
        ping=draw(st.booleans()),
    )


@st.composite
def openai_samples(draw: st.DrawFn) -> OpenAISample:
    calls = []
    for number in range(draw(st.integers(0, 3))):
        text = json.dumps(draw(st.dictionaries(_key, _json, max_size=4)))
        cuts = draw(st.lists(st.integers(0, len(text)), max_size=5))
        calls.append(Call(f"call_{number}", draw(_key), pieces_of(text, cuts)))
    finish = draw(st.sampled_from(["stop", "length", "tool_calls", "content_filter"]))
    return OpenAISample(
        draw(st.lists(_text.filter(bool), max_size=5)),
        calls,
        finish=finish,
        matched=draw(st.none() | _text) if finish == "stop" else None,
        prompt_tokens=draw(st.integers(0, 10**6)),
        completion_tokens=draw(st.integers(0, 10**6)),
        calls_together=draw(st.booleans()),
    )


@settings(max_examples=200, deadline=None)
@given(anthropic_samples(), st.lists(st.integers(0, 5000), max_size=8))
def test_any_anthropic_stream(sample: AnthropicSample, cuts: list[int]) -> None:
    data = sample.stream()
    out = to_chat(data)
    check_openai_stream(out)
    assert fed_in_pieces(lambda: MessagesToChatStream(True, created=CREATED), data, cuts) == out
    translated = messages_answer_to_chat(sample.whole(), created=CREATED)
    assert parsed_arguments(openai_assembled(out)) == parsed_arguments(translated)
    indices = [
        call["index"]
        for chunk in check_openai_stream(out)
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls") or []
        if "id" in call
    ]
    assert indices == list(range(len(indices)))


@settings(max_examples=200, deadline=None)
@given(openai_samples(), st.lists(st.integers(0, 5000), max_size=8))
def test_any_openai_stream(sample: OpenAISample, cuts: list[int]) -> None:
    data = sample.stream()
    out = to_messages(data)
    events = check_anthropic_stream(out)
    assert fed_in_pieces(lambda: ChatToMessagesStream("fallback-model"), data, cuts) == out
    assert anthropic_assembled(out) == chat_answer_to_messages(sample.whole())
    # Each block starts, has its deltas, and stops before the next starts, at index 0, 1, ...
    open_block = None
    started = []
    for event in events:
        if event["type"] == "content_block_start":
            assert open_block is None
            open_block = event["index"]
            started.append(open_block)
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_block
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_block
            open_block = None
    assert open_block is None and started == list(range(len(started)))


# Whatever an upstream sends, a translator answers with its own protocol's events (or nothing):
# it never raises, and what it writes the SDKs accept.

_field = st.none() | st.booleans() | st.integers(-2, 3) | _text | st.lists(_text, max_size=2)
_anthropic_types = st.sampled_from(
    ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
     "message_delta", "message_stop", "ping", "error", "something_new"]
)  # fmt: skip
_anthropic_keys = st.sampled_from(
    ["message", "index", "content_block", "delta", "usage", "error", "type", "text", "id",
     "name", "input", "partial_json", "stop_reason", "stop_sequence", "output_tokens"]
)  # fmt: skip
_openai_keys = st.sampled_from(
    ["id", "model", "choices", "usage", "error", "delta", "index", "content", "tool_calls",
     "function", "arguments", "name", "finish_reason", "stop_reason", "refusal", "code"]
)  # fmt: skip


def _objects(keys: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return st.recursive(
        _field,
        lambda inner: st.dictionaries(keys, inner, max_size=3) | st.lists(inner, max_size=2),
        max_leaves=6,
    )


@st.composite
def anthropic_noise(draw: st.DrawFn) -> bytes:
    out = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(_anthropic_types)
        fields = st.dictionaries(_anthropic_keys, _objects(_anthropic_keys), max_size=4)
        body = {"type": kind, **draw(fields)}
        body["type"] = kind
        name = kind if draw(st.booleans()) else draw(_anthropic_types)
        out.append(f"event: {name}\ndata: {json.dumps(body)}\n\n".encode())
    return b"".join(out) + draw(st.sampled_from([b"", b"data: {", b"event: message_stop\n"]))


@st.composite
def openai_noise(draw: st.DrawFn) -> bytes:
    out = []
    for _ in range(draw(st.integers(0, 8))):
        body = draw(st.dictionaries(_openai_keys, _objects(_openai_keys), max_size=4))
        out.append(b"data: " + json.dumps(body).encode() + b"\n\n")
        if draw(st.integers(0, 9)) == 0:
            out.append(DONE)
    return b"".join(out) + draw(st.sampled_from([b"", b"data: {", b": comment\n\n", DONE]))


@settings(max_examples=150, deadline=None)
@given(anthropic_noise())
def test_any_anthropic_events_give_a_valid_openai_stream(data: bytes) -> None:
    stream = MessagesToChatStream(True)
    out = stream.feed(data) + stream.finish()
    assert stream.ended != stream.failed
    check_openai_stream(out)


@settings(max_examples=150, deadline=None)
@given(openai_noise())
def test_any_openai_chunks_give_a_valid_anthropic_stream(data: bytes) -> None:
    stream = ChatToMessagesStream("m")
    out = stream.feed(data) + stream.finish()
    assert stream.ended != stream.failed
    check_anthropic_stream(out)
