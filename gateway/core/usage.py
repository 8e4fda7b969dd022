"""Token usage and the model that answered, read from an answer's bytes without parsing them.

A whole answer holds `usage` in its body: OpenAI's `prompt_tokens` / `completion_tokens`,
Anthropic's and the Responses API's `input_tokens` / `output_tokens`. A stream holds it near its
end: OpenAI's in the last chunk before `[DONE]` (when the request asked for it:
`stream_options.include_usage`), the Responses API's in its last event (`response.completed`),
Anthropic's output tokens in `message_delta` and its input tokens in `message_start`, the
stream's first event. So the head and the last two chunks of a stream are enough.

A key inside the model's own text cannot match: a JSON string escapes its quotes, so the text
`"prompt_tokens":` appears there as `\\"prompt_tokens\\":`.

Pure: bytes in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

_PROMPT: Final = b'"prompt_tokens":'
_COMPLETION: Final = b'"completion_tokens":'
_INPUT: Final = b'"input_tokens":'
_OUTPUT: Final = b'"output_tokens":'
# Anthropic counts cached prompt tokens apart from `input_tokens`; OpenAI's `prompt_tokens`
# includes them, and so does the conventions' `gen_ai.usage.input_tokens`.
_CACHE_READ: Final = b'"cache_read_input_tokens":'
_CACHE_WRITE: Final = b'"cache_creation_input_tokens":'
# How far into a whole body its model and usage are looked for (they sit at its start or end:
# a large body, such as embeddings, is never scanned whole).
EDGE_BYTES: Final = 8192
_MODEL: Final = b'"model":'


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens an answer says it used (None: it did not say)."""

    input_tokens: int | None
    output_tokens: int | None


def _last_number(data: bytes, key: bytes) -> int | None:
    at = data.rfind(key)
    if at < 0:
        return None
    digits = data[at + len(key) : at + len(key) + 12].lstrip()
    end = 0
    while end < len(digits) and 48 <= digits[end] <= 57:
        end += 1
    return int(digits[:end]) if end else None


def usage_of(end: bytes, head: bytes = b"", protocol: str = "openai") -> Usage:
    """The usage in `end` (a whole body's end, or a stream's last chunks), by the keys of the
    route's `protocol` (a tool's input object may hold another protocol's names): OpenAI's
    chat, completions, embeddings...; the Responses API's (`input_tokens`, which include the
    cached ones, and `output_tokens`, in its last event); Anthropic's, whose input tokens may
    be only in `head` (a stream's first chunk: `message_start`) and leave its cached ones out."""
    if protocol == "responses":
        return Usage(_last_number(end, _INPUT), _last_number(end, _OUTPUT))
    if protocol != "anthropic":
        return Usage(_last_number(end, _PROMPT), _last_number(end, _COMPLETION))
    source = end if _INPUT in end else head
    input_tokens = _last_number(source, _INPUT)
    if input_tokens is not None:
        for key in (_CACHE_READ, _CACHE_WRITE):
            input_tokens += _last_number(source, key) or 0
    return Usage(input_tokens, _last_number(end, _OUTPUT))


def model_of(data: bytes) -> str | None:
    """The first `"model":"..."` of an answer (a body, or a stream's first chunk): the model
    that answered, as the server names it. None when absent or not a plain string."""
    at = data.find(_MODEL)
    if at < 0:
        return None
    start = at + len(_MODEL)
    while start < len(data) and data[start] in b" \t":
        start += 1
    if data[start : start + 1] != b'"':
        return None
    start += 1
    end = data.find(b'"', start)
    if end < 0 or end - start > 256:
        return None
    value = data[start:end]
    if b"\\" in value:
        return None  # an escape: not worth decoding for a label
    try:
        return value.decode()
    except UnicodeDecodeError:
        return None
