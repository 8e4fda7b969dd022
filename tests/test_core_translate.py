"""Requests, whole answers and errors translated between OpenAI Chat Completions and Anthropic
Messages (`gateway.core.translate`); streams are in test_core_translate_stream.py."""

from __future__ import annotations

import base64
import json
from typing import Any

import anthropic
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.translate import (
    DEFAULT_MAX_TOKENS,
    Untranslatable,
    chat_answer_to_messages,
    chat_to_messages,
    error_to_chat,
    error_to_messages,
    messages_answer_to_chat,
    messages_to_chat,
)
from tests.translate_samples import (
    CREATED,
    check_anthropic_request,
    check_openai_request,
)

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake image").decode()
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


def to_messages(request: dict[str, Any], model: str = "claude") -> dict[str, Any]:
    out = chat_to_messages(request, model)
    check_anthropic_request(out)
    return out


def to_chat(request: dict[str, Any], model: str = "llama") -> dict[str, Any]:
    out = messages_to_chat(request, model)
    check_openai_request(out)
    return out


# --- OpenAI requests -> Anthropic ------------------------------------------------------------


def test_a_plain_chat_request() -> None:
    request = {
        "model": "gpt",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi", "name": "ann"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Weather?"},
        ],
        "max_tokens": 50,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": "END",
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u-1",
    }
    assert to_messages(request, "claude-x") == {
        "model": "claude-x",
        "max_tokens": 50,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Weather?"},
        ],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "stream": True,
        "metadata": {"user_id": "u-1"},
    }
    assert request["stream_options"] == {"include_usage": True}  # the request is not modified


def test_max_tokens_come_from_either_field_or_the_default() -> None:
    base = {"messages": [{"role": "user", "content": "x"}]}
    assert to_messages(base)["max_tokens"] == DEFAULT_MAX_TOKENS == 4096
    assert to_messages({**base, "max_tokens": 7})["max_tokens"] == 7
    both = {**base, "max_tokens": 7, "max_completion_tokens": 9}
    assert to_messages(both)["max_tokens"] == 9


def test_sampling_fields() -> None:
    base = {"messages": [{"role": "user", "content": "x"}]}
    out = to_messages({**base, "temperature": 1.7, "top_k": 40, "stop": ["a", "b"]})
    assert out["temperature"] == 1.0  # Anthropic's range ends at 1
    assert out["top_k"] == 40 and out["stop_sequences"] == ["a", "b"]
    dropped = {"seed": 3, "frequency_penalty": 0.5, "presence_penalty": 0.1,
               "repetition_penalty": 1.1, "min_p": 0.05, "chat_template_kwargs": {"x": 1},
               "logprobs": False, "n": 1, "response_format": {"type": "text"},
               "modalities": ["text"], "top_logprobs": 0, "store": False}  # fmt: skip
    assert to_messages({**base, **dropped}) == to_messages(base)
    assert "stop_sequences" not in to_messages({**base, "stop": []})
    assert to_messages({**base, "safety_identifier": "s"})["metadata"] == {"user_id": "s"}


def test_system_and_developer_messages_become_the_system_blocks() -> None:
    request = {
        "messages": [
            {"role": "system", "content": "One."},
            {"role": "user", "content": "x"},
            {"role": "developer", "content": [{"type": "text", "text": "Two."}]},
            {"role": "system", "content": ""},
        ]
    }
    out = to_messages(request)
    assert out["system"] == [{"type": "text", "text": "One."}, {"type": "text", "text": "Two."}]
    assert out["messages"] == [{"role": "user", "content": "x"}]
    assert "system" not in to_messages({"messages": [{"role": "system", "content": ""}]})


def test_images_by_data_url_and_by_link() -> None:
    escaped = "data:image/gif,GIF89a%01%00"  # not base64: percent-encoded bytes
    request = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                    {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg",
                                                        "detail": "high"}},
                    {"type": "image_url", "image_url": {"url": escaped}},
                    {"type": "text", "text": ""},
                ],
            }
        ]
    }  # fmt: skip
    assert to_messages(request)["messages"][0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
        {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": "image/gif",
                "data": base64.b64encode(b"GIF89a\x01\x00").decode(),
            },
        },
    ]
    for url in ("ftp://x/a.png", "data:image/svg+xml,%3Csvg%2F%3E", "data:image/png;base64"):
        part = {"type": "image_url", "image_url": {"url": url}}
        with pytest.raises(Untranslatable) as raised:
            chat_to_messages({"messages": [{"role": "user", "content": [part]}]}, "m")
        assert raised.value.reason == "image"


def test_tool_calls_and_their_results() -> None:
    """Tool calls become tool_use blocks; consecutive tool messages, and the user message
    right after them, are one user turn with the results first."""
    request = {
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "functions.weather:1", "type": "function",
                     "function": {"name": "weather", "arguments": " "}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "functions.weather:1",
             "content": [{"type": "text", "text": "21C"}]},
            {"role": "user", "content": "And tomorrow?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c3", "type": "function",
                             "function": {"name": "weather", "arguments": "{ }"}}]},
            {"role": "tool", "tool_call_id": "c3", "content": "20C"},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Now.",
                                                    "parameters": WEATHER, "strict": True}},
                  {"type": "function", "function": {"name": "time"}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
    }  # fmt: skip
    out = to_messages(request)
    assert out["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
                # Anthropic's ids are [A-Za-z0-9_-]: the result's id maps the same way.
                {"type": "tool_use", "id": "functions_weather_1", "name": "weather", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "functions_weather_1",
                 "content": [{"type": "text", "text": "21C"}]},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
        {"role": "assistant",
         "content": [{"type": "tool_use", "id": "c3", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c3",
                                      "content": "20C"}]},
    ]  # fmt: skip
    assert out["tools"] == [
        {"name": "weather", "description": "Now.", "input_schema": WEATHER},
        {"name": "time", "input_schema": {"type": "object", "properties": {}}},
    ]
    assert out["tool_choice"] == {
        "type": "tool",
        "name": "weather",
        "disable_parallel_tool_use": True,
    }


@pytest.mark.parametrize(
    ("openai_choice", "anthropic_choice"),
    [
        ("auto", {"type": "auto"}),
        ("none", {"type": "none"}),
        ("required", {"type": "any"}),
        ({"type": "function", "function": {"name": "f"}}, {"type": "tool", "name": "f"}),
    ],
)
def test_tool_choice(openai_choice: Any, anthropic_choice: dict[str, Any]) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": WEATHER}}]
    base = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    assert to_messages({**base, "tool_choice": openai_choice})["tool_choice"] == anthropic_choice
    back = to_chat({**to_messages(base), "tool_choice": anthropic_choice})
    assert back["tool_choice"] == openai_choice


def test_tool_choice_without_tools_is_dropped_and_parallel_calls_alone_mean_auto() -> None:
    base = {"messages": [{"role": "user", "content": "x"}]}
    assert "tool_choice" not in to_messages({**base, "tool_choice": "none"})
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = to_messages({**base, "tools": tools, "parallel_tool_calls": False})
    assert out["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    assert "tool_choice" not in to_chat({**base, "tool_choice": {"type": "any"}, "max_tokens": 1})


def test_assistant_refusals_are_text() -> None:
    request = {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
            {"role": "assistant", "content": None, "refusal": "Still no."},
        ]
    }
    out = to_messages(request)["messages"]
    assert out[1]["content"] == [{"type": "text", "text": "No."}]
    assert out[2]["content"] == [{"type": "text", "text": "Still no."}]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"n": 2}, "n>1"),
        ({"best_of": 3}, "n>1"),
        ({"use_beam_search": True}, "n>1"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "logprobs"),
        ({"prompt_logprobs": 1}, "logprobs"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "audio"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "functions"),
        ({"web_search_options": {}}, "web_search"),
        ({"guided_json": {"type": "object"}}, "guided_decoding"),
        ({"structured_outputs": {"regex": "a+"}}, "guided_decoding"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"echo": True}, "echo"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tool_type"),
        ({"some_vendor_field": 1}, "unknown_field"),
    ],
)  # fmt: skip
def test_what_an_anthropic_server_cannot_do(fields: dict[str, Any], reason: str) -> None:
    request = {"messages": [{"role": "user", "content": "x"}], **fields}
    with pytest.raises(Untranslatable) as raised:
        chat_to_messages(request, "m")
    assert raised.value.reason == reason
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ({"role": "user", "content": [{"type": "input_audio",
                                       "input_audio": {"data": "x", "format": "wav"}}]}, "audio"),
        ({"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}, "file"),
        ({"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]},
         "video"),
        ({"role": "assistant", "content": None, "audio": {"id": "a"}}, "audio"),
        ({"role": "assistant", "content": None,
          "function_call": {"name": "f", "arguments": "{}"}}, "functions"),
        ({"role": "function", "name": "f", "content": "x"}, "functions"),
        ({"role": "assistant", "content": None,
          "tool_calls": [{"id": "c", "type": "function",
                          "function": {"name": "f", "arguments": "[1, 2]"}}]}, "tool_arguments"),
        ({"role": "assistant", "content": None,
          "tool_calls": [{"id": "c", "type": "function",
                          "function": {"name": "f", "arguments": '{"a": '}}]}, "tool_arguments"),
        ({"role": "wizard", "content": "x"}, "malformed"),
        ({"role": "user", "content": 3}, "malformed"),
    ],
)  # fmt: skip
def test_messages_an_anthropic_server_cannot_take(message: dict[str, Any], reason: str) -> None:
    with pytest.raises(Untranslatable) as raised:
        chat_to_messages({"messages": [message]}, "m")
    assert raised.value.reason == reason


def test_a_request_that_is_not_a_chat_request() -> None:
    for request in ({}, {"messages": "hi"}, {"messages": [3]}):
        with pytest.raises(Untranslatable) as raised:
            chat_to_messages(request, "m")
        assert raised.value.reason == "malformed"


# --- Anthropic requests -> OpenAI ------------------------------------------------------------


def test_a_plain_messages_request() -> None:
    request = {
        "model": "claude",
        "max_tokens": 100,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather?",
                                          "cache_control": {"type": "ephemeral"}}]},
        ],
        "stop_sequences": ["END"],
        "temperature": 0.2,
        "top_p": 0.8,
        "top_k": 5,
        "stream": True,
        "metadata": {"user_id": "u-2"},
        "service_tier": "auto",
        "thinking": {"type": "disabled"},
    }  # fmt: skip
    assert to_chat(request, "llama-x") == {
        "model": "llama-x",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        ],
        "max_tokens": 100,
        "stop": ["END"],
        "temperature": 0.2,
        "top_p": 0.8,
        "top_k": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u-2",
    }


def test_system_blocks_images_and_tool_results() -> None:
    request = {
        "max_tokens": 10,
        "system": [{"type": "text", "text": "A."}, {"type": "text", "text": "B.",
                                                     "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": PNG}},
                {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
                {"type": "text", "text": "Weather?"},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather",
                 "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "unknown"}]},
                {"type": "text", "text": "Thanks."},
            ]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3",
                                               "name": "weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
        ],
        "tools": [{"name": "weather", "description": "Now.", "input_schema": WEATHER,
                   "cache_control": {"type": "ephemeral"}}, {"name": "t", "type": "custom",
                                                             "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }  # fmt: skip
    assert to_chat(request) == {
        "model": "llama",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "A."},
                                           {"type": "text", "text": "B."}]},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
                {"type": "text", "text": "Weather?"},
            ]},
            {"role": "assistant", "content": "Looking.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
                {"id": "toolu_2", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
            ]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "toolu_2",
             "content": [{"type": "text", "text": "unknown"}]},
            {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "toolu_3", "type": "function",
                 "function": {"name": "weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
        ],
        "max_tokens": 10,
        "tools": [
            {"type": "function", "function": {"name": "weather", "description": "Now.",
                                              "parameters": WEATHER}},
            {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}},
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking"),
        ({"thinking": {"type": "adaptive"}}, "thinking"),
        ({"output_format": {"type": "json_schema", "schema": {}}}, "output_format"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_format"),
        ({"container": "c-1"}, "container"),
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
         "context_management"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server_tools"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "server_tools"),
        ({"user_profile_id": "p"}, "unknown_field"),
    ],
)  # fmt: skip
def test_what_an_openai_server_cannot_do(fields: dict[str, Any], reason: str) -> None:
    request = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **fields}
    with pytest.raises(Untranslatable) as raised:
        messages_to_chat(request, "m")
    assert raised.value.reason == reason


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        ({"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                         "data": "JVBER"}}, "document"),
        ({"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                         "data": "x"}}, "document"),
        ({"type": "search_result", "source": "s", "title": "t", "content": []}, "search_result"),
        ({"type": "image", "source": {"type": "file", "file_id": "file_1"}}, "file"),
        ({"type": "tool_result", "tool_use_id": "t",
          "content": [{"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}]},
         "tool_result_image"),
        ({"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
         "server_tools"),
        ({"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
         "server_tools"),
        ({"type": "container_upload", "file_id": "f"}, "container"),
        ({"type": "hologram"}, "content_type"),
    ],
)  # fmt: skip
def test_blocks_an_openai_server_cannot_take(block: dict[str, Any], reason: str) -> None:
    request = {"max_tokens": 5, "messages": [{"role": "user", "content": [block]}]}
    with pytest.raises(Untranslatable) as raised:
        messages_to_chat(request, "m")
    assert raised.value.reason == reason


# --- round trips -----------------------------------------------------------------------------


def normal_chat(request: dict[str, Any]) -> dict[str, Any]:
    """What both families express of a chat request, in one form: system text joined, content
    as a list of parts, tool arguments parsed, tool ids as Anthropic writes them."""
    out = {k: v for k, v in request.items() if k not in ("messages", "model", "stream_options")}
    system: list[str] = []
    messages = []
    for message in request["messages"]:
        role, content = message["role"], message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        parts = [p for p in parts if p.get("type") != "text" or p["text"]]
        if role in ("system", "developer"):
            system.extend(p["text"] for p in parts)
        elif role == "assistant":
            calls = [
                (c["id"].replace(".", "_").replace(":", "_"), c["function"]["name"],
                 json.loads(c["function"]["arguments"] or "{}"))
                for c in message.get("tool_calls") or []
            ]  # fmt: skip
            text = "".join(p["text"] for p in parts)
            messages.append(("assistant", [{"type": "text", "text": text}] if text else [], calls))
        elif role == "tool":
            messages.append(("tool", message["tool_call_id"], parts))
        else:
            messages.append((role, parts))
    return {**out, "system": system, "messages": messages}


def normal_messages(request: dict[str, Any]) -> dict[str, Any]:
    """What both families express of a Messages request, in one form."""
    out = {k: v for k, v in request.items() if k not in ("messages", "system", "model")}
    system = request.get("system") or []
    messages = []
    for message in request["messages"]:
        content = message["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        messages.append((message["role"], [b for b in blocks if b.get("text", True) != ""]))
    return {**out, "system": [system] if isinstance(system, str) else system, "messages": messages}


def test_a_conversation_survives_a_round_trip_each_way() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{PNG}"}}]},
            {"role": "assistant", "content": "Calling.", "tool_calls": [
                {"id": "call_9", "type": "function",
                 "function": {"name": "f", "arguments": '{"x": [1, {"y": null}]}'}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "done"},
            {"role": "assistant", "content": "Done."},
        ],
        "max_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.5,
        "top_k": 3,
        "stop": ["\n\n"],
        "stream": True,
        "user": "me",
        "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                    "parameters": WEATHER}}],
        "tool_choice": "auto",
    }  # fmt: skip
    back = to_chat(to_messages(chat), "gpt")
    assert back["stream_options"] == {"include_usage": True}
    assert normal_chat(back) == normal_chat(chat)
    messages = to_messages(chat)
    assert normal_messages(to_messages(to_chat(messages))) == normal_messages(messages)


# Hypothesis: requests within what both families express.

_text = st.text(min_size=1, max_size=20)
_ident = st.from_regex(r"[A-Za-z][A-Za-z0-9_-]{0,12}", fullmatch=True)
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_ident, inner, max_size=3),
    max_leaves=6,
)
_arguments = st.dictionaries(_ident, _json_value, max_size=3)
_image = st.sampled_from(
    [f"data:image/png;base64,{PNG}", "https://x.test/i.png", "http://x.test/i.gif"]
).map(lambda url: {"type": "image_url", "image_url": {"url": url}})
_user_content = _text | st.lists(
    _text.map(lambda t: {"type": "text", "text": t}) | _image, min_size=1, max_size=3
)


@st.composite
def chat_requests(draw: st.DrawFn) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])),
                         "content": draw(_text)})  # fmt: skip
    for turn in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(_user_content)})
        calls = [
            {"id": f"call_{turn}_{i}", "type": "function",
             "function": {"name": draw(_ident), "arguments": json.dumps(draw(_arguments))}}
            for i in range(draw(st.integers(0, 3)))
        ]  # fmt: skip
        text = draw(st.none() | _text) if calls else draw(_text)
        assistant: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            assistant["tool_calls"] = calls
        messages.append(assistant)
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": draw(_text)})
        if calls:
            # After the results: the assistant's answer, or more from the user (same turn).
            role = draw(st.sampled_from(["assistant", "user"]))
            messages.append({"role": role, "content": draw(_text)})
    request: dict[str, Any] = {"messages": messages, "max_tokens": draw(st.integers(1, 9999))}
    optional = {
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0, 1),
        "top_k": st.integers(1, 100),
        "stop": st.lists(_text, min_size=1, max_size=3),
        "stream": st.booleans(),
        "user": _ident,
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            request[key] = draw(strategy)
    if draw(st.booleans()):
        names = draw(st.lists(_ident, min_size=1, max_size=3, unique=True))
        request["tools"] = [
            {"type": "function", "function": {"name": n, "parameters": WEATHER}} for n in names
        ]
        request["tool_choice"] = draw(
            st.sampled_from(["auto", "none", "required"])
            | st.sampled_from(names).map(lambda n: {"type": "function", "function": {"name": n}})
        )
    return request


@settings(max_examples=150, deadline=None)
@given(chat_requests())
def test_chat_requests_survive_a_round_trip(request: dict[str, Any]) -> None:
    messages = to_messages(request)
    back = to_chat(messages)
    assert normal_chat(back) == normal_chat(request)
    # ...and the Anthropic form is a fixed point of the other round trip.
    assert normal_messages(to_messages(back)) == normal_messages(messages)


_block_text = _text.map(lambda t: {"type": "text", "text": t})
_block_image = st.sampled_from(
    [
        {"type": "base64", "media_type": "image/webp", "data": PNG},
        {"type": "url", "url": "https://x.test/i.jpg"},
    ]
).map(lambda source: {"type": "image", "source": source})


@st.composite
def messages_requests(draw: st.DrawFn) -> dict[str, Any]:
    request: dict[str, Any] = {
        "model": "c",
        "max_tokens": draw(st.integers(1, 9999)),
        "messages": [],
    }
    system = draw(st.none() | _text | st.lists(_block_text, min_size=1, max_size=2))
    if system is not None:
        request["system"] = system
    results: list[dict[str, Any]] = []
    for turn in range(draw(st.integers(1, 4))):
        user = draw(_text | st.lists(_block_text | _block_image, min_size=1, max_size=3))
        if results:
            user = results + ([] if isinstance(user, str) else user)
        request["messages"].append({"role": "user", "content": user})
        uses = [
            {"type": "tool_use", "id": f"toolu_{turn}_{i}", "name": draw(_ident),
             "input": draw(_arguments)}
            for i in range(draw(st.integers(0, 2)))
        ]  # fmt: skip
        if uses:
            texts = draw(st.lists(_block_text, max_size=1))
            request["messages"].append({"role": "assistant", "content": texts + uses})
        else:
            content = draw(_text | st.lists(_block_text, min_size=1, max_size=2))
            request["messages"].append({"role": "assistant", "content": content})
        results = [
            {"type": "tool_result", "tool_use_id": use["id"],
             "content": draw(_text | st.lists(_block_text, min_size=1, max_size=2))}
            for use in uses
        ]  # fmt: skip
    if results:
        request["messages"].append({"role": "user", "content": results})
    for key, strategy in {
        "temperature": st.floats(0, 1),
        "top_k": st.integers(1, 50),
        "stop_sequences": st.lists(_text, min_size=1, max_size=2),
        "stream": st.booleans(),
        "metadata": _ident.map(lambda user: {"user_id": user}),
        "tools": st.lists(_ident, min_size=1, max_size=2, unique=True).map(
            lambda names: [{"name": n, "input_schema": WEATHER} for n in names]
        ),
    }.items():
        if draw(st.booleans()):
            request[key] = draw(strategy)
    if "tools" in request:
        request["tool_choice"] = draw(
            st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}])
        )
    return request


@settings(max_examples=150, deadline=None)
@given(messages_requests())
def test_messages_requests_survive_a_round_trip(request: dict[str, Any]) -> None:
    check_anthropic_request(request)
    back = to_messages(to_chat(request), "c")
    assert normal_messages(back) == normal_messages(request)


@settings(max_examples=200, deadline=None)
@given(st.integers(100, 599), st.binary(max_size=80) | st.builds(json.dumps, st.recursive(
    st.none() | st.text(max_size=5) | st.integers(),
    lambda inner: st.dictionaries(st.sampled_from(["error", "type", "message", "code", "detail"]),
                                  inner, max_size=3),
    max_leaves=6,
)).map(str.encode))  # fmt: skip
def test_any_error_body_gives_an_error_of_the_other_shape(status: int, body: bytes) -> None:
    openai_body = json.loads(error_to_chat(status, body))
    assert set(openai_body["error"]) == {"message", "type", "code"}
    assert isinstance(openai_body["error"]["message"], str)
    anthropic_body = json.loads(error_to_messages(status, body))
    assert anthropic_body["type"] == "error" and set(anthropic_body["error"]) == {"type", "message"}
    if anthropic_body["error"]["type"] != "request_too_large":
        anthropic.types.ErrorResponse.model_validate(anthropic_body)


# --- whole answers ---------------------------------------------------------------------------


ANTHROPIC_ANSWER = {
    "id": "msg_01ABC",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5-20250929",
    "content": [
        {"type": "thinking", "thinking": "...", "signature": "sig"},
        {"type": "text", "text": "Let me check. "},
        {"type": "text", "text": "One moment."},
        {"type": "tool_use", "id": "toolu_01", "name": "weather", "input": {"city": "Paris"}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 10,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 5,
        "output_tokens": 20,
    },
}


def test_an_anthropic_answer_as_a_chat_completion() -> None:
    out = messages_answer_to_chat(ANTHROPIC_ANSWER, created=CREATED)
    assert out == {
        "id": "chatcmpl-msg_01ABC",
        "object": "chat.completion",
        "created": CREATED,
        "model": "claude-sonnet-4-5-20250929",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Let me check. One moment.",
                    "tool_calls": [
                        {"id": "toolu_01", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
                    ],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 115, "completion_tokens": 20, "total_tokens": 135,
                  "prompt_tokens_details": {"cached_tokens": 100}},
    }  # fmt: skip
    openai.types.chat.ChatCompletion.model_validate(out)


def test_a_chat_completion_as_an_anthropic_answer() -> None:
    answer = {
        "id": "chatcmpl-77",
        "object": "chat.completion",
        "created": 1,
        "model": "llama",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Sure.",
                    "reasoning_content": "thinking...",
                    "tool_calls": [
                        {"id": "chatcmpl-tool-1", "type": "function",
                         "function": {"name": "f", "arguments": '{"a": 1}'}},
                        {"id": "functions.g:1", "type": "function",
                         "function": {"name": "g", "arguments": ""}},
                    ],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34,
                  "prompt_tokens_details": {"cached_tokens": 16}},
    }  # fmt: skip
    out = chat_answer_to_messages(answer)
    assert out == {
        "id": "msg_chatcmpl-77",
        "type": "message",
        "role": "assistant",
        "model": "llama",
        "content": [
            {"type": "text", "text": "Sure."},
            {"type": "tool_use", "id": "chatcmpl-tool-1", "name": "f", "input": {"a": 1}},
            {"type": "tool_use", "id": "functions_g_1", "name": "g", "input": {}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 14, "output_tokens": 4, "cache_read_input_tokens": 16},
    }
    anthropic.types.Message.model_validate(out)
    assert chat_answer_to_messages({**answer, "id": "msg_x"})["id"] == "msg_x"


@pytest.mark.parametrize(
    ("stop", "sequence", "finish", "matched"),
    [
        ("end_turn", None, "stop", None),
        ("max_tokens", None, "length", None),
        ("tool_use", None, "tool_calls", None),
        ("stop_sequence", "###", "stop", "###"),
        ("refusal", None, "content_filter", None),
    ],
)
def test_stop_and_finish_reasons(
    stop: str, sequence: str | None, finish: str, matched: str | None
) -> None:
    answer = {**ANTHROPIC_ANSWER, "stop_reason": stop, "stop_sequence": sequence}
    choice = messages_answer_to_chat(answer)["choices"][0]
    assert choice["finish_reason"] == finish
    assert choice.get("stop_reason") == matched
    back = chat_answer_to_messages(messages_answer_to_chat(answer))
    assert (back["stop_reason"], back["stop_sequence"]) == (stop, sequence)


def test_other_reasons() -> None:
    def finish_of(stop: str | None) -> str:
        answer = {**ANTHROPIC_ANSWER, "stop_reason": stop}
        return str(messages_answer_to_chat(answer)["choices"][0]["finish_reason"])

    assert finish_of("model_context_window_exceeded") == "length"
    assert finish_of("pause_turn") == "stop"
    assert finish_of(None) == "stop"

    def stop_of(finish: str | None, matched: Any = None) -> Any:
        choice = {"index": 0, "message": {"content": "x"}, "finish_reason": finish,
                  "stop_reason": matched}  # fmt: skip
        out = chat_answer_to_messages({"id": "c", "model": "m", "choices": [choice]})
        return out["stop_reason"], out["stop_sequence"]

    assert stop_of("stop", 128009) == ("end_turn", None)  # vLLM: a stop token's id
    assert stop_of("function_call") == ("tool_use", None)
    assert stop_of(None) == ("end_turn", None)


def test_an_answer_with_nothing_in_it() -> None:
    empty = {**ANTHROPIC_ANSWER, "content": [], "stop_reason": "max_tokens"}
    assert messages_answer_to_chat(empty)["choices"][0]["message"] == {
        "role": "assistant",
        "content": "",
    }
    out = chat_answer_to_messages({"id": "c", "model": "m", "choices": []})
    assert out["content"] == [] and out["usage"] == {"input_tokens": 0, "output_tokens": 0}
    anthropic.types.Message.model_validate(out)


def test_an_answer_survives_a_round_trip() -> None:
    answer = {**ANTHROPIC_ANSWER, "content": ANTHROPIC_ANSWER["content"][1:]}
    back = chat_answer_to_messages(messages_answer_to_chat(answer))
    assert back["content"] == [
        {"type": "text", "text": "Let me check. One moment."},
        {"type": "tool_use", "id": "toolu_01", "name": "weather", "input": {"city": "Paris"}},
    ]
    assert back["model"] == answer["model"] and back["stop_reason"] == "tool_use"
    # The cache's write is part of the prompt on OpenAI's side: it comes back as input.
    assert back["usage"] == {
        "input_tokens": 15,
        "output_tokens": 20,
        "cache_read_input_tokens": 100,
    }


# --- errors ----------------------------------------------------------------------------------


def anthropic_body(kind: str, message: str = "m") -> bytes:
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


@pytest.mark.parametrize(
    ("status", "anthropic_type", "openai_type"),
    [
        (400, "invalid_request_error", "invalid_request_error"),
        (401, "authentication_error", "authentication_error"),
        (402, "billing_error", "insufficient_quota"),
        (403, "permission_error", "permission_error"),
        (404, "not_found_error", "not_found_error"),
        (413, "request_too_large", "invalid_request_error"),
        (429, "rate_limit_error", "rate_limit_error"),
        (500, "api_error", "server_error"),
        (504, "timeout_error", "timeout_error"),
        (529, "overloaded_error", "service_unavailable_error"),
    ],
)
def test_errors_each_way(status: int, anthropic_type: str, openai_type: str) -> None:
    body = json.loads(error_to_chat(status, anthropic_body(anthropic_type, "Nope.")))
    assert body == {"error": {"message": "Nope.", "type": openai_type, "code": anthropic_type}}
    back = json.loads(error_to_messages(status, json.dumps(body).encode()))
    assert back == {"type": "error", "error": {"type": anthropic_type, "message": "Nope."}}
    if anthropic_type != "request_too_large":  # the SDK's types lack Cloudflare's 413
        anthropic.types.ErrorResponse.model_validate(back)


@pytest.mark.parametrize(
    ("status", "body", "kind", "message"),
    [
        # vLLM today, and before 0.10 (no "error" wrapper)
        (400, b'{"error":{"message":"too long","type":"BadRequestError","param":null,'
              b'"code":400}}', "invalid_request_error", "too long"),
        (404, b'{"object":"error","message":"no model","type":"NotFoundError","param":null,'
              b'"code":404}', "not_found_error", "no model"),
        # OpenAI's own
        (401, b'{"error":{"message":"bad key","type":"invalid_request_error","param":null,'
              b'"code":"invalid_api_key"}}', "authentication_error", "bad key"),
        (429, b'{"error":{"message":"slow","type":"requests","code":"rate_limit_exceeded"}}',
         "rate_limit_error", "slow"),
        (503, b'{"error":{"message":"busy","type":"service_unavailable","code":null}}',
         "overloaded_error", "busy"),
        (500, b"<html>Bad gateway</html>", "api_error", "<html>Bad gateway</html>"),
        (502, b"", "api_error", "Bad Gateway"),
        (422, b'{"detail":[{"loc":["body"],"msg":"x"}]}', "invalid_request_error",
         '[{"loc":["body"],"msg":"x"}]'),
        (418, b'{"error":"teapot"}', "invalid_request_error", "teapot"),
    ],
)  # fmt: skip
def test_openai_and_vllm_errors_as_anthropic_errors(
    status: int, body: bytes, kind: str, message: str
) -> None:
    assert json.loads(error_to_messages(status, body)) == {
        "type": "error",
        "error": {"type": kind, "message": message},
    }


def test_anthropic_errors_that_are_not_anthropics_shape() -> None:
    assert json.loads(error_to_chat(529, b"Overloaded")) == {
        "error": {"message": "Overloaded", "type": "service_unavailable_error",
                  "code": "overloaded_error"}
    }  # fmt: skip
    # vLLM's Messages route writes its own type: the status decides.
    body = anthropic_body("internal_error", "boom")
    assert json.loads(error_to_chat(500, body))["error"]["type"] == "server_error"
    long = b"x" * 5000
    assert len(json.loads(error_to_chat(500, long))["error"]["message"]) == 1000
