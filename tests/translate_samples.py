"""Streams and answers of both API families for the translation's tests (`gateway.core.translate`),
built as the engines write them, and the official SDKs' types to check translations with."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
from pydantic import TypeAdapter

from gateway.core.assembly import AnthropicAssembly, OpenAIAssembly
from gateway.core.sse import parse_event, split_events

CREATED = 1_700_000_000
DONE = b"data: [DONE]\n\n"

# --- the SDKs' types -------------------------------------------------------------------------

_ANTHROPIC_EVENT: TypeAdapter[Any] = TypeAdapter(anthropic.types.RawMessageStreamEvent)
_ANTHROPIC_REQUEST: TypeAdapter[Any] = TypeAdapter(
    anthropic.types.message_create_params.MessageCreateParamsNonStreaming
)
_OPENAI_REQUEST: TypeAdapter[Any] = TypeAdapter(
    openai.types.chat.completion_create_params.CompletionCreateParamsNonStreaming
)


def _deep(value: Any) -> Any:
    """A validated TypedDict with its lazily validated iterables walked (which validates them)."""
    if isinstance(value, dict):
        return {key: _deep(item) for key, item in value.items()}
    if value is None or isinstance(value, (str, bytes, int, float)):
        return value
    return [_deep(item) for item in value]


def check_anthropic_request(request: dict[str, Any]) -> None:
    _deep(_ANTHROPIC_REQUEST.validate_python({**request, "stream": False}))


def check_openai_request(request: dict[str, Any]) -> None:
    body = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    _deep(_OPENAI_REQUEST.validate_python(body))


def events(data: bytes) -> list[tuple[str | None, str]]:
    return [parse_event(event) for event in split_events(data) if parse_event(event)[1]]


def check_openai_stream(data: bytes) -> list[dict[str, Any]]:
    """Every event of an OpenAI chat stream, each checked with the SDK's types: chunks, then
    `[DONE]` last or an error event last (then no `[DONE]`). The chunks' JSON."""
    chunks = []
    seen = events(data)
    for number, (name, text) in enumerate(seen):
        assert name is None
        last = number == len(seen) - 1
        if text == "[DONE]":
            assert last
            continue
        value = json.loads(text)
        if "error" in value:
            assert last, "nothing follows an error event"
            assert set(value["error"]) == {"message", "type", "code"}
            continue
        openai.types.chat.ChatCompletionChunk.model_validate(value)
        chunks.append(value)
    return chunks


def check_anthropic_stream(data: bytes) -> list[dict[str, Any]]:
    """Every event of an Anthropic stream, checked with the SDK's types (an error event with
    its error response type); each event's name is its type."""
    out = []
    seen = events(data)
    for number, (name, text) in enumerate(seen):
        value = json.loads(text)
        assert name == value["type"]
        if name == "error":
            assert number == len(seen) - 1, "nothing follows an error event"
            if value["error"]["type"] != "request_too_large":  # not in the SDK's types
                anthropic.types.ErrorResponse.model_validate(value)
        else:
            _ANTHROPIC_EVENT.validate_python(value)
        out.append(value)
    return out


def openai_assembled(data: bytes) -> dict[str, Any]:
    assembly = OpenAIAssembly(chat=True)
    for event in split_events(data):
        assembly.feed(event)
    assert assembly.complete and assembly.error is None
    return assembly.answer()


def anthropic_assembled(data: bytes) -> dict[str, Any]:
    assembly = AnthropicAssembly()
    for event in split_events(data):
        assembly.feed(event)
    assert assembly.complete and assembly.error is None
    return assembly.answer()


def parsed_arguments(answer: dict[str, Any]) -> dict[str, Any]:
    """A chat answer with its tool calls' arguments parsed: a stream carries the engine's own
    JSON text, its whole answer the object written again."""
    answer = json.loads(json.dumps(answer))
    for choice in answer["choices"]:
        for call in choice["message"].get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"] or "{}")
    return answer


# --- Anthropic streams -----------------------------------------------------------------------


@dataclass
class Block:
    """A content block and how its stream carries it: `pieces` are the text's deltas (text,
    thinking) or the input's JSON fragments (tool_use)."""

    kind: str  # text, tool_use, thinking
    pieces: list[str]
    id: str = ""
    name: str = ""

    @property
    def whole(self) -> dict[str, Any]:
        text = "".join(self.pieces)
        if self.kind == "tool_use":
            value = json.loads(text) if text else {}
            return {"type": "tool_use", "id": self.id, "name": self.name, "input": value}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": "c2ln"}
        return {"type": "text", "text": text}


@dataclass
class AnthropicSample:
    blocks: list[Block]
    stop_reason: str = "end_turn"
    stop_sequence: str | None = None
    input_tokens: int = 12
    output_tokens: int = 34
    cache_read: int = 0
    ping: bool = True
    mid: str = "msg_01XFDUDYJgAACzvnptvVoYEL"
    model: str = "claude-sonnet-4-5"
    extra_usage: dict[str, Any] = field(default_factory=dict)

    def usage(self, output_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"input_tokens": self.input_tokens, "output_tokens": output_tokens}
        if self.cache_read:
            usage["cache_read_input_tokens"] = self.cache_read
        return {**usage, **self.extra_usage}

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [block.whole for block in self.blocks],
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage(self.output_tokens),
        }

    def stream(self) -> bytes:
        out = [self._event({"type": "message_start", "message": self._start()})]
        if self.ping:
            out.append(self._event({"type": "ping"}))
        for index, block in enumerate(self.blocks):
            start: dict[str, Any] = {"type": block.kind}
            if block.kind == "text":
                start["text"] = ""
            elif block.kind == "thinking":
                start.update(thinking="", signature="")
            else:
                start.update(id=block.id, name=block.name, input={})
            out.append(
                self._event({"type": "content_block_start", "index": index, "content_block": start})
            )
            for piece in block.pieces:
                if block.kind == "text":
                    delta = {"type": "text_delta", "text": piece}
                elif block.kind == "thinking":
                    delta = {"type": "thinking_delta", "thinking": piece}
                else:
                    delta = {"type": "input_json_delta", "partial_json": piece}
                out.append(
                    self._event({"type": "content_block_delta", "index": index, "delta": delta})
                )
            if block.kind == "thinking":
                signature = {"type": "signature_delta", "signature": "c2ln"}
                out.append(
                    self._event({"type": "content_block_delta", "index": index, "delta": signature})
                )
            out.append(self._event({"type": "content_block_stop", "index": index}))
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        usage = {"output_tokens": self.output_tokens}
        out.append(self._event({"type": "message_delta", "delta": delta, "usage": usage}))
        out.append(self._event({"type": "message_stop"}))
        return b"".join(out)

    def _start(self) -> dict[str, Any]:
        message = self.whole()
        return {
            **message,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.usage(1),
        }

    @staticmethod
    def _event(event: dict[str, Any]) -> bytes:
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


# --- OpenAI streams --------------------------------------------------------------------------


@dataclass
class Call:
    id: str
    name: str
    fragments: list[str]  # the arguments' JSON text, in pieces


@dataclass
class OpenAISample:
    """A chat stream as vLLM writes it: a role chunk, content deltas, each tool call's first
    delta (id, name) then its argument fragments, the finish chunk, the usage chunk, [DONE]."""

    texts: list[str]
    calls: list[Call] = field(default_factory=list)
    finish: str = "stop"
    matched: str | int | None = None  # vLLM's stop_reason
    prompt_tokens: int = 9
    completion_tokens: int = 21
    cached: int = 0
    calls_together: bool = False  # every call whole in one chunk (vLLM's non-streaming parsers)
    cid: str = "chatcmpl-8f2e9a1c"
    model: str = "meta-llama/Llama-3.1-8B-Instruct"

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if self.cached:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return usage

    def whole(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.texts) or None}
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": "".join(c.fragments)},
            }
            for c in self.calls
        ]
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": self.finish,
            "stop_reason": self.matched,
        }
        return {
            "id": self.cid,
            "object": "chat.completion",
            "created": CREATED,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
        return self._data({"choices": [choice]})

    def _data(self, fields: dict[str, Any]) -> bytes:
        chunk = {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": self.model,
            **fields,
        }
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def stream(self) -> bytes:
        out = [self._chunk({"role": "assistant", "content": ""})]
        out.extend(self._chunk({"content": text}) for text in self.texts)
        if self.calls_together and self.calls:
            entries = [
                {
                    "index": i,
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": "".join(c.fragments)},
                }
                for i, c in enumerate(self.calls)
            ]
            out.append(self._chunk({"tool_calls": entries}))
        else:
            for i, call in enumerate(self.calls):
                first = {
                    "index": i,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
                out.append(self._chunk({"tool_calls": [first]}))
                for fragment in call.fragments:
                    entry = {"index": i, "function": {"arguments": fragment}}
                    out.append(self._chunk({"tool_calls": [entry]}))
        out.append(self._chunk({}, self.finish, stop_reason=self.matched))
        out.append(self._data({"choices": [], "usage": self.usage()}))
        out.append(DONE)
        return b"".join(out)


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    """`text` cut at the given offsets (out of range or repeated ones ignored)."""
    points = sorted({c for c in cuts if 0 < c < len(text)})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]
