"""Usage and the answering model read from answers' bytes, both protocols, whole and streamed."""

from __future__ import annotations

import json

from gateway.core.usage import Usage, model_of, usage_of


def test_an_openai_whole_answer_and_keys_inside_the_models_text() -> None:
    body = json.dumps(
        {
            "id": "c1",
            "model": "meta/llama",
            "usage": {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46},
            # After the usage: the last match would be this text's, were it not escaped.
            "choices": [
                {"message": {"content": 'he said "prompt_tokens":99 "completion_tokens":8'}}
            ],
        }
    ).encode()
    assert usage_of(body) == Usage(12, 34)
    assert model_of(body) == "meta/llama"


def test_an_anthropic_answer_reads_its_own_keys_and_counts_cached_input() -> None:
    """A tool's input object may hold OpenAI's names unescaped: the Messages route's usage is
    read by its own keys; cached prompt tokens are input tokens too."""
    body = json.dumps(
        {
            "model": "claude-x",
            "content": [
                {"type": "tool_use", "input": {"prompt_tokens": 999, "completion_tokens": 8}}
            ],
            "usage": {
                "input_tokens": 10,
                "cache_read_input_tokens": 100,
                "cache_creation_input_tokens": 5,
                "output_tokens": 20,
            },
        }
    ).encode()
    assert usage_of(body, protocol="anthropic") == Usage(115, 20)


def test_an_openai_stream_with_usage_before_its_done_chunk() -> None:
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n'
    done = b"data: [DONE]\n\n"
    assert usage_of(usage + done) == Usage(5, 7)
    assert usage_of(done) == Usage(None, None)  # without usage asked for: nothing said


def test_an_anthropic_stream_says_input_at_its_start_and_output_at_its_end() -> None:
    start = (
        b'event: message_start\ndata: {"type":"message_start","message":{"model":"claude-x",'
        b'"usage":{"input_tokens":21,"output_tokens":1}}}\n\n'
    )
    end = (
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":40}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    assert usage_of(end, start, protocol="anthropic") == Usage(21, 40)
    assert model_of(start) == "claude-x"


def test_model_values_that_are_not_plain_strings_are_left_out() -> None:
    assert model_of(b'{"model":"a\\"b"}') is None
    assert model_of(b'{"id":1}') is None
    assert model_of(b'{"model":"' + b"x" * 300 + b'"}') is None
