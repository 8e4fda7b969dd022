"""A whole answer assembled from a stream's events (`gateway.core.assembly`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core.assembly import AnthropicAssembly, OpenAIAssembly, stream_request
from gateway.core.continuation import UnreadableEvent


def data(value: Any) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


def named(name: str, value: Any) -> bytes:
    return f"event: {name}\n".encode() + data(value)


DONE = b"data: [DONE]\n\n"
SHARED = {"id": "chatcmpl-1", "created": 7, "model": "m", "system_fingerprint": "fp"}


def chat_chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    choice.update(extra)
    return data({**SHARED, "object": "chat.completion.chunk", "choices": [choice]})


def feed(assembly: OpenAIAssembly | AnthropicAssembly, *events: bytes) -> None:
    for event in events:
        assembly.feed(event)


def test_a_chat_stream_becomes_one_chat_completion() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assembly = OpenAIAssembly(chat=True)
    feed(
        assembly,
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"content": "Hel"}),
        chat_chunk({"content": "lo"}),
        chat_chunk({"content": "!"}, "stop", stop_reason=None),
        data({**SHARED, "object": "chat.completion.chunk", "choices": [], "usage": usage}),
    )
    assert not assembly.complete
    feed(assembly, DONE)
    assert assembly.complete and assembly.error is None
    assert assembly.answer() == {
        "id": "chatcmpl-1",
        "created": 7,
        "model": "m",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!"},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "system_fingerprint": "fp",
        "usage": usage,
    }


def test_reasoning_and_tool_calls_are_merged_as_a_whole_message() -> None:
    """Any text field a delta carries is appended to; tool calls merge by their index, and the
    whole answer's list has none."""
    assembly = OpenAIAssembly(chat=True)
    call = {"index": 0, "id": "call-1", "type": "function", "function": {"name": "f"}}
    feed(
        assembly,
        chat_chunk({"role": "assistant", "reasoning_content": "Think"}),
        chat_chunk({"reasoning_content": "ing."}),
        chat_chunk({"tool_calls": [{**call, "function": {"name": "f", "arguments": ""}}]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        chat_chunk({"tool_calls": [{"index": 1, "id": "call-2", "function": {"name": "g"}}]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}, "tool_calls"),
        DONE,
    )
    (choice,) = assembly.answer()["choices"]
    message = choice["message"]
    assert message["content"] is None  # no content delta came
    assert message["reasoning_content"] == "Thinking."
    assert message["tool_calls"] == [
        {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call-2", "function": {"name": "g"}},
    ]
    assert choice["finish_reason"] == "tool_calls"


def test_a_completions_stream_becomes_one_text_completion() -> None:
    assembly = OpenAIAssembly(chat=False)

    def piece(text: str, finish: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return data({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                     "choices": [choice]})  # fmt: skip

    feed(assembly, piece("Once"), piece(" upon"), piece(" a time", "length"), DONE)
    whole = assembly.answer()
    assert whole["object"] == "text_completion"
    assert whole["choices"] == [
        {"index": 0, "text": "Once upon a time", "logprobs": None, "finish_reason": "length"}
    ]
    assert "usage" not in whole  # none came


def test_openai_error_event_is_kept_and_ends_the_assembly() -> None:
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    assembly = OpenAIAssembly(chat=True)
    feed(assembly, chat_chunk({"content": "a"}), data(error), chat_chunk({"content": "b"}), DONE)
    assert assembly.error == error
    assert not assembly.complete  # what followed the error does not count


def test_an_unreadable_event_raises() -> None:
    assembly = OpenAIAssembly(chat=True)
    with pytest.raises(UnreadableEvent):
        assembly.feed(b"data: {not json\n\n")
    with pytest.raises(UnreadableEvent):
        OpenAIAssembly(chat=True).feed(b"data: [1, 2]\n\n")


def test_comments_and_empty_events_are_ignored() -> None:
    assembly = OpenAIAssembly(chat=True)
    feed(assembly, b": keep-alive\n\n", chat_chunk({"content": "x"}), DONE)
    assert assembly.answer()["choices"][0]["message"]["content"] == "x"


def event(kind: str, **fields: Any) -> bytes:
    """An Anthropic event: named as its type."""
    return named(kind, {"type": kind, **fields})


def delta(index: int, kind: str, **fields: Any) -> bytes:
    return event("content_block_delta", index=index, delta={"type": kind, **fields})


def anthropic_stream(*, tool: bool = False) -> list[bytes]:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": 1},
    }
    events = [
        event("message_start", message=message),
        event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        event("ping"),
        delta(0, "text_delta", text="Hi"),
        delta(0, "text_delta", text=" there"),
        event("content_block_stop", index=0),
    ]
    if tool:
        block = {"type": "tool_use", "id": "tu", "name": "f", "input": {}}
        events += [
            event("content_block_start", index=1, content_block=block),
            delta(1, "input_json_delta", partial_json='{"city": '),
            delta(1, "input_json_delta", partial_json='"Paris"}'),
            event("content_block_stop", index=1),
        ]
    stop = {"stop_reason": "end_turn", "stop_sequence": None}
    return [
        *events,
        event("message_delta", delta=stop, usage={"output_tokens": 4}),
        event("message_stop"),
    ]


def test_a_messages_stream_becomes_one_message() -> None:
    assembly = AnthropicAssembly()
    feed(assembly, *anthropic_stream())
    assert assembly.complete
    assert assembly.answer() == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude",
        "content": [{"type": "text", "text": "Hi there"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": 4},
    }


def test_a_tool_use_block_gets_its_input_parsed() -> None:
    assembly = AnthropicAssembly()
    feed(assembly, *anthropic_stream(tool=True))
    content = assembly.answer()["content"]
    assert content[1] == {"type": "tool_use", "id": "tu", "name": "f", "input": {"city": "Paris"}}


def test_thinking_blocks_keep_their_text_and_signature() -> None:
    assembly = AnthropicAssembly()
    block = {"type": "thinking", "thinking": "", "signature": ""}
    feed(
        assembly,
        event("content_block_start", index=0, content_block=block),
        delta(0, "thinking_delta", thinking="hmm"),
        delta(0, "signature_delta", signature="sig"),
        event("content_block_stop", index=0),
        event("message_stop"),
    )
    thinking = {"type": "thinking", "thinking": "hmm", "signature": "sig"}
    assert assembly.answer()["content"] == [thinking]


def test_anthropic_error_event_is_kept() -> None:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assembly = AnthropicAssembly()
    feed(assembly, *anthropic_stream()[:3], named("error", error), *anthropic_stream()[3:])
    assert assembly.error == error and not assembly.complete


def test_the_streamed_request_asks_for_usage_on_openai_routes_only() -> None:
    request = {"model": "m", "messages": [], "stream": False}
    assert stream_request(request, messages=False) == {
        "model": "m",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert stream_request(request, messages=True) == {"model": "m", "messages": [], "stream": True}
    assert request["stream"] is False  # the client's request is not changed


def test_a_long_answer_keeps_every_piece_in_order() -> None:
    assembly = OpenAIAssembly(chat=True)
    words = [f"w{i} " for i in range(20_000)]
    feed(assembly, *(chat_chunk({"content": word}) for word in words), DONE)
    assert assembly.answer()["choices"][0]["message"]["content"] == "".join(words)


def test_a_choice_without_a_numeric_index_is_unreadable() -> None:
    chunk = data({**SHARED, "choices": [{"index": "0", "delta": {"content": "x"}}]})
    with pytest.raises(UnreadableEvent):
        OpenAIAssembly(chat=True).feed(chunk)
