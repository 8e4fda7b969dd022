"""Usage and the answering model read from answers' bytes, both protocols, whole and streamed."""

from __future__ import annotations

import json

from gateway.core.usage import Usage, model_of, usage_of


def test_an_openai_whole_answer() -> None:
    body = json.dumps(
        {
            "id": "c1",
            "model": "meta/llama",
            "choices": [{"message": {"content": 'he said "prompt_tokens": 99'}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46},
        }
    ).encode()
    assert usage_of(body) == Usage(12, 34)
    assert model_of(body) == "meta/llama"


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
    assert usage_of(end, start) == Usage(21, 40)
    assert model_of(start) == "claude-x"


def test_model_values_that_are_not_plain_strings_are_left_out() -> None:
    assert model_of(b'{"model":"a\\"b"}') is None
    assert model_of(b'{"id":1}') is None
    assert model_of(b'{"model":"' + b"x" * 300 + b'"}') is None
