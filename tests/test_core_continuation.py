"""The pure core of stream resume: transcripts, continuation requests, rewriting, splicing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core import continuation_anthropic as anthropic_c
from gateway.core import continuation_openai as openai_c
from gateway.core.continuation import KEEP_RAW, PACK_BATCH, NotResumable, Splice
from gateway.core.sse import event_boundary, format_event, parse_event, parse_lines, split_events

CHAT_REQUEST: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 10,
    "stream": True,
}


def chat_chunk(content: str | None = None, role: bool = False, finish: str | None = None,
               cid: str = "chatcmpl-1", created: int = 100, **extra: Any) -> bytes:  # fmt: skip
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    chunk = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": "m",
        "system_fingerprint": "fp-" + cid,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


def data_of(events: bytes) -> list[Any]:
    out = []
    for event in split_events(events):
        _, data = parse_event(event)
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


# --- SSE ------------------------------------------------------------------------------------


def test_events_split_and_parse_with_any_line_ending() -> None:
    raw = b"event: a\r\ndata: 1\r\ndata: 2\r\n\r\ndata: x\n\n: comment\rdata: y\r\r"
    events = split_events(raw)
    assert b"".join(events) == raw
    assert [parse_event(e) for e in events] == [("a", "1\n2"), (None, "x"), (None, "y")]
    assert event_boundary(b"data: 1\n\ndata: 2") == len(b"data: 1\n\n")
    assert parse_event(format_event("a\nb", "n")) == ("n", "a\nb")


@given(
    st.lists(
        st.sampled_from([b"data: ", b"data:", b"event: e", b": c", b"\n", b"\r", b"\r\n", b"{}"])
        | st.binary(max_size=8),
        max_size=8,
    )
)
def test_an_event_reads_the_same_through_the_one_line_shortcut_as_line_by_line(
    parts: list[bytes],
) -> None:
    event = b"".join(parts) + b"\n\n"
    assert parse_event(event) == parse_lines(event)
    assert parse_event(b"data: " + event) == parse_lines(b"data: " + event)


def test_a_one_line_event_reads_as_its_data() -> None:
    assert parse_event(b'data: {"a":1}\n\n') == (None, '{"a":1}')
    assert parse_event(b"data: x\r\n\r\n") == (None, "x")
    assert parse_event(b"data: a\rb\n\n") == (None, "a")  # CR alone ends a line: "b" is a field


# --- splicing --------------------------------------------------------------------------------


def test_an_echoed_prefix_is_dropped_once_it_is_whole() -> None:
    splice = Splice("Hello there", "auto")
    assert splice.feed("Hello") == ""  # could still be the echo: held
    assert splice.feed(" there, friend") == ", friend"
    assert splice.feed(" more") == " more"


def test_text_that_is_not_the_echo_is_released_at_once() -> None:
    splice = Splice("Hello there", "auto")
    assert splice.feed("Hel") == ""
    assert splice.feed("p me") == "Help me"


def test_held_text_is_released_at_the_end() -> None:
    splice = Splice("Hello there", "auto")
    assert splice.feed("Hello") == ""
    assert splice.flush() == "Hello"


def test_never_mode_delivers_everything() -> None:
    assert Splice("Hello", "never").feed("Hello again") == "Hello again"


def test_owed_whitespace_is_not_delivered_twice() -> None:
    splice = Splice("", "auto", owed="\n\n")
    assert splice.feed("\n") == ""  # part of what the client has
    assert splice.feed("\nNext") == "Next"
    other = Splice("", "auto", owed=" ")
    assert other.feed("\nNext") == "\nNext"  # different whitespace: the model's own


# --- OpenAI ------------------------------------------------------------------------------------


def openai_transcript(request: dict[str, Any] | None = None, chat: bool = True,
                      max_bytes: int = 1 << 20) -> openai_c.OpenAITranscript:  # fmt: skip
    return openai_c.OpenAITranscript(request or dict(CHAT_REQUEST), chat, max_bytes, "auto")


def test_a_chat_continuation_appends_the_text_as_a_final_assistant_message() -> None:
    t = openai_transcript()
    t.keep(chat_chunk("", role=True) + chat_chunk("Hello"))
    t.keep(chat_chunk(" world"))
    t.fold()
    assert t.why_not() is None and t.finishing() is None
    body, _ = t.continuation()
    request = json.loads(body)
    assert request["messages"][-1] == {"role": "assistant", "content": "Hello world"}
    assert request["continue_final_message"] is True
    assert request["add_generation_prompt"] is False
    assert request["max_tokens"] == 8  # two chunks carried text: two tokens delivered
    assert request["stream_options"] == {"include_usage": True}
    assert request["messages"][:-1] == CHAT_REQUEST["messages"]


def test_a_clients_own_final_message_is_extended() -> None:
    request = {
        **CHAT_REQUEST,
        "messages": [*CHAT_REQUEST["messages"], {"role": "assistant", "content": "Sure:"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_completion_tokens": 5,
    }
    t = openai_transcript(request)
    t.keep(chat_chunk(" one", role=True))
    t.fold()
    body, _ = t.continuation()
    sent = json.loads(body)
    assert sent["messages"][-1] == {"role": "assistant", "content": "Sure: one"}
    assert len(sent["messages"]) == 2
    assert sent["max_completion_tokens"] == 4


def test_a_completions_continuation_extends_the_prompt() -> None:
    request = {"model": "m", "prompt": "Once", "max_tokens": 4, "stream": True}
    t = openai_transcript(request, chat=False)
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": " upon", "finish_reason": None}]}  # fmt: skip
    t.keep(f"data: {json.dumps(chunk)}\n\n".encode())
    t.fold()
    body, _ = t.continuation()
    assert json.loads(body)["prompt"] == "Once upon"
    assert json.loads(body)["max_tokens"] == 3


def test_the_continuation_is_rewritten_into_the_same_stream() -> None:
    t = openai_transcript({**CHAT_REQUEST, "stream_options": {"include_usage": True}})
    t.keep(chat_chunk("", role=True) + chat_chunk("Hello"))
    t.fold()
    _, rewriter = t.continuation()
    out = rewriter.rewrite(
        chat_chunk("", role=True, cid="chatcmpl-2", created=200)
        + chat_chunk(" world", cid="chatcmpl-2", created=200)
        + chat_chunk("", finish="length", cid="chatcmpl-2", created=200)
    )
    usage = {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    out += rewriter.rewrite(
        f"data: {json.dumps({'id': 'chatcmpl-2', 'object': 'chat.completion.chunk', 'created': 200, 'model': 'm', 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()  # noqa: E501
    )
    chunks = data_of(out)
    assert chunks[-1] == "[DONE]"
    bodies = chunks[:-1]
    assert {c["id"] for c in bodies} == {"chatcmpl-1"}
    assert {c["created"] for c in bodies} == {100}
    assert {c["system_fingerprint"] for c in bodies} == {"fp-chatcmpl-1"}
    assert all("role" not in c["choices"][0]["delta"] for c in bodies if c["choices"])
    assert [c["choices"][0]["delta"].get("content") for c in bodies if c["choices"]] == [
        " world",
        "",
    ]
    # Usage: the original prompt (the continuation's minus the text it carried), every token.
    assert bodies[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_usage_the_client_did_not_ask_for_is_dropped() -> None:
    t = openai_transcript()
    t.keep(chat_chunk("Hi", role=True))
    t.fold()
    _, rewriter = t.continuation()
    usage = {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    tail = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [], "usage": usage}  # fmt: skip
    assert data_of(rewriter.rewrite(f"data: {json.dumps(tail)}\n\n".encode())) == []


def test_continuous_usage_counts_tokens_exactly() -> None:
    request = {**CHAT_REQUEST, "stream_options": {"include_usage": True,
                                                  "continuous_usage_stats": True}}  # fmt: skip
    t = openai_transcript(request)
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    t.keep(chat_chunk("Hello world", role=True, usage=usage))  # three tokens in one chunk
    t.fold()
    body, rewriter = t.continuation()
    assert json.loads(body)["max_tokens"] == 7
    usage2 = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
    out = data_of(rewriter.rewrite(chat_chunk("!", cid="c2", usage=usage2)))
    assert out[0]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


def test_a_tool_call_in_progress_is_not_continued() -> None:
    t = openai_transcript()
    call = {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{"}}
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}  # fmt: skip
    t.keep(f"data: {json.dumps(chunk)}\n\n".encode())
    t.fold()
    assert t.why_not() == "tool_call"
    with pytest.raises(NotResumable, match="tool_call"):
        t.continuation()


@pytest.mark.parametrize(
    ("extra", "reason"),
    [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"echo": True}, "echo")],
)
def test_requests_that_cannot_be_continued_are_known_before_they_are_sent(
    extra: dict[str, Any], reason: str
) -> None:
    assert openai_c.refusal({**CHAT_REQUEST, **extra}, chat=True) == reason
    assert openai_c.refusal({**CHAT_REQUEST, "n": 1, "logprobs": False}, chat=True) is None
    assert openai_c.refusal({"prompt": [1, 2, 3]}, chat=False) == "prompt_not_text"


def test_a_stream_that_had_finished_is_only_ended() -> None:
    request = {**CHAT_REQUEST, "stream_options": {"include_usage": True,
                                                  "continuous_usage_stats": True}}  # fmt: skip
    t = openai_transcript(request)
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    t.keep(chat_chunk("Hi", role=True, finish="stop", usage=usage))
    t.fold()
    ending = data_of(t.finishing() or b"")
    assert ending[-1] == "[DONE]"
    assert ending[0]["usage"]["completion_tokens"] == 1 and ending[0]["choices"] == []


def test_a_long_stream_is_kept_compressed_and_read_back_whole() -> None:
    t = openai_transcript()
    words = [f" w{i}" for i in range(3000)]
    t.keep(chat_chunk("", role=True))
    for word in words:
        t.keep(chat_chunk(word))
    kept = sum(len(c) for c in t._kept)
    assert kept < 3000 * len(chat_chunk(" w0")) / 5  # past KEEP_RAW, compressed
    assert 0 < t._batch_bytes < PACK_BATCH  # a batch at a time: the last one not yet
    t.fold()  # the unfinished batch is read back too
    assert t.delivered_text == "".join(words)
    assert t.text_events == 3000


def test_a_stream_past_its_bound_is_not_resumable() -> None:
    t = openai_transcript(max_bytes=100)  # compressed bytes
    piece = chat_chunk("x" * 50)
    for i in range(KEEP_RAW // len(piece) + 200):
        t.keep(chat_chunk(f"{i:x}" * 30))
    t.fold()
    assert t.why_not() == "too_long"
    assert t.text == [] and t._kept == []  # everything let go


# --- Anthropic ---------------------------------------------------------------------------------

MESSAGES_REQUEST: dict[str, Any] = {
    "model": "m",
    "max_tokens": 10,
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}


def event(name: str, **fields: Any) -> bytes:
    return format_event(json.dumps({"type": name, **fields}), name)


def message_start(mid: str = "msg_1", input_tokens: int = 3) -> bytes:
    message = {"id": mid, "type": "message", "role": "assistant", "content": [], "model": "m",
               "usage": {"input_tokens": input_tokens, "output_tokens": 1}}  # fmt: skip
    return event("message_start", message=message)


def text_delta(text: str, index: int = 0) -> bytes:
    return event("content_block_delta", index=index, delta={"type": "text_delta", "text": text})


def block_start(index: int = 0) -> bytes:
    return event("content_block_start", index=index, content_block={"type": "text", "text": ""})


def test_a_prefill_holds_back_trailing_whitespace_and_it_is_not_sent_twice() -> None:
    t = anthropic_c.AnthropicTranscript(dict(MESSAGES_REQUEST), 1 << 20, "auto")
    t.keep(
        message_start() + block_start() + event("ping") + text_delta("Hello") + text_delta(",\n\n")
    )
    t.fold()
    body, rewriter = t.continuation()
    request = json.loads(body)
    assert request["messages"][-1] == {"role": "assistant", "content": "Hello,"}
    assert request["max_tokens"] == 8
    out = rewriter.rewrite(
        message_start("msg_2", input_tokens=5) + block_start() + event("ping")
        + text_delta("\n") + text_delta("\nWorld")
        + event("content_block_stop", index=0)
        + event("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                usage={"output_tokens": 2})
        + event("message_stop")
    )  # fmt: skip
    names = [parse_event(e)[0] for e in split_events(out)]
    assert names == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    delta = json.loads(parse_event(split_events(out)[0])[1])
    assert delta["delta"]["text"] == "World" and delta["index"] == 0
    usage = json.loads(parse_event(split_events(out)[2])[1])["usage"]
    assert usage["output_tokens"] == 4


def test_an_echoed_prefill_is_dropped() -> None:
    t = anthropic_c.AnthropicTranscript(dict(MESSAGES_REQUEST), 1 << 20, "auto")
    t.keep(message_start() + block_start() + text_delta("One two"))
    t.fold()
    _, rewriter = t.continuation()
    out = rewriter.rewrite(message_start() + block_start() + text_delta("One two three"))
    (delta,) = [json.loads(parse_event(e)[1]) for e in split_events(out)]
    assert delta["delta"]["text"] == " three"


def test_later_blocks_of_a_continuation_are_renumbered_after_the_clients() -> None:
    t = anthropic_c.AnthropicTranscript(dict(MESSAGES_REQUEST), 1 << 20, "never")
    t.keep(
        message_start() + block_start(0) + text_delta("a") + event("content_block_stop", index=0)
    )
    t.keep(block_start(1) + text_delta("b", index=1))
    t.fold()
    _, rewriter = t.continuation()
    out = rewriter.rewrite(
        block_start(0) + text_delta("c", 0) + event("content_block_stop", index=0)
        + block_start(1) + text_delta("d", 1)
    )  # fmt: skip
    indices = [json.loads(parse_event(e)[1]).get("index") for e in split_events(out)]
    assert indices == [1, 1, 2, 2]


def test_thinking_and_tool_use_are_not_continued() -> None:
    assert anthropic_c.refusal({**MESSAGES_REQUEST, "thinking": {"type": "enabled"}}) == "reasoning"
    t = anthropic_c.AnthropicTranscript(dict(MESSAGES_REQUEST), 1 << 20, "auto")
    tool = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    t.keep(message_start() + event("content_block_start", index=0, content_block=tool))
    t.fold()
    assert t.why_not() == "tool_call"


def test_a_message_that_had_stopped_is_only_ended() -> None:
    t = anthropic_c.AnthropicTranscript(dict(MESSAGES_REQUEST), 1 << 20, "auto")
    t.keep(message_start() + block_start() + text_delta("x") + event("content_block_stop", index=0))
    t.keep(event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 1}))
    t.fold()
    assert t.finishing() == anthropic_c.MESSAGE_STOP


# --- what a review found ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"guided_json": {"type": "object"}},
        {"grammar": "root ::= x"},
    ],
)
def test_structured_output_is_not_continued(extra: dict[str, Any]) -> None:
    # The constraint applies to each attempt from its start: a continuation would open a
    # second document after the half-written one.
    assert openai_c.refusal({**CHAT_REQUEST, **extra}, chat=True) == "structured"
    text_format = {**CHAT_REQUEST, "response_format": {"type": "text"}}
    assert openai_c.refusal(text_format, chat=True) is None


@pytest.mark.parametrize(
    "extra",
    [
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
        {"output_format": {"type": "json_schema", "schema": {"type": "object"}}},
    ],
)
def test_anthropic_structured_output_is_not_continued(extra: dict[str, Any]) -> None:
    assert anthropic_c.refusal({**MESSAGES_REQUEST, **extra}) == "structured"
    assert anthropic_c.refusal({**MESSAGES_REQUEST, "output_config": {"effort": "low"}}) is None


def test_token_ids_are_not_continued() -> None:
    # A continuation tokenizes the text so far anew: its ids are not one generation's.
    assert openai_c.refusal({**CHAT_REQUEST, "return_token_ids": True}, chat=True) == "token_ids"


def test_a_usage_chunk_already_delivered_is_not_sent_again() -> None:
    t = openai_transcript({**CHAT_REQUEST, "stream_options": {"include_usage": True}})
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    tail = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 100, "model": "m",
            "choices": [], "usage": usage}  # fmt: skip
    t.keep(chat_chunk("Hi", role=True, finish="stop") + f"data: {json.dumps(tail)}\n\n".encode())
    t.fold()
    assert t.finishing() == openai_c.DONE


def test_a_stream_that_used_all_its_tokens_gets_its_finish_chunk() -> None:
    t = openai_transcript({**CHAT_REQUEST, "max_tokens": 2})
    t.keep(chat_chunk("a", role=True) + chat_chunk(" b"))
    t.fold()
    ending = data_of(t.finishing() or b"")
    assert ending[-1] == "[DONE]"
    assert ending[0]["choices"][0]["finish_reason"] == "length"


def test_a_chat_continuation_is_not_taken_for_an_echo_unless_the_pool_says_so() -> None:
    t = openai_transcript()
    t.keep(chat_chunk("ha", role=True))
    t.fold()
    _, rewriter = t.continuation()  # echo "auto": the OpenAI routes do not echo
    out = data_of(rewriter.rewrite(chat_chunk("ha", cid="c2") + chat_chunk("!", cid="c2")))
    assert [c["choices"][0]["delta"]["content"] for c in out] == ["ha", "!"]


def test_an_unreadable_event_takes_nothing_of_its_chunk_into_the_transcript() -> None:
    t = openai_transcript()
    t.keep(chat_chunk("Hello", role=True))
    t.fold()
    _, rewriter = t.continuation()
    with pytest.raises(ValueError):
        rewriter.rewrite(chat_chunk(" world", cid="c2") + b"data: [1, 2]\n\n")
    assert t.delivered_text == "Hello"


def test_a_text_block_is_closed_when_the_continuation_starts_a_tool_call() -> None:
    t = anthropic_c.AnthropicTranscript(dict(MESSAGES_REQUEST), 1 << 20, "never")
    t.keep(message_start() + block_start(0) + text_delta("Let me look"))
    t.fold()
    _, rewriter = t.continuation()
    tool = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    out = rewriter.rewrite(event("content_block_start", index=0, content_block=tool))
    events = [(parse_event(e)[0], json.loads(parse_event(e)[1])) for e in split_events(out)]
    assert [(name, e.get("index")) for name, e in events] == [
        ("content_block_stop", 0),
        ("content_block_start", 1),
    ]


def test_model_text_about_error_events_is_not_an_error_event() -> None:
    from gateway.ingress.dialect import ANTHROPIC

    said = text_delta("then the server sends event: error and closes")
    assert not ANTHROPIC.has_error_event(said)
    assert ANTHROPIC.has_error_event(said + b'event: error\ndata: {"type":"error"}\n\n')
    assert not ANTHROPIC.ended(said)
