"""Continuing a final assistant message or a prompt, as the real servers do.

The fake's text is a fixed sequence of words (`responses.token`), so a prefix that ends with the
first k of them is continued from word k: a stream cut after k tokens and continued elsewhere
reads exactly as one uninterrupted answer, which lets tests check every token once, in order.

- Chat (vLLM): `continue_final_message: true` continues the last message, which must be the
  assistant's, and requires `add_generation_prompt: false` (it defaults to true): both true is
  vLLM's 400. Without it, an assistant message in the history is just history.
- Completions: the prompt's end is the prefix.
- Anthropic Messages: a final assistant message is a prefill, continued; the API rejects one
  that ends in whitespace (400). With `echo_prefill` (llama.cpp's server) the prefill is
  streamed again before the continuation.
"""

from __future__ import annotations

from typing import Any

from .bodies import BadRequest
from .responses import VOCAB, text

# vLLM's words (a pydantic validation error, answered 400).
BOTH_FLAGS = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
NOT_ASSISTANT = "continue_final_message is set but the final message is not from the assistant"
TRAILING_WHITESPACE = "messages: final assistant content cannot end with trailing whitespace"


def resumed_at(prefix: str) -> int:
    """How many of the fake's words `prefix` ends with: where generation picks up."""
    first = VOCAB[0]
    at = prefix.find(first)
    while at >= 0:
        # The first word has no leading space: a completion's text follows its prompt directly.
        tail = prefix[at:]
        words = len(tail.split())
        if tail == text(words):
            return words
        at = prefix.find(first, at + 1)
    return 0


def content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return content if isinstance(content, str) else ""


def chat_start(request: dict[str, Any]) -> int:
    """Where a chat request's generation starts (0: a new assistant turn); 400 as vLLM."""
    continued = request.get("continue_final_message", False)
    if continued is not True:
        return 0
    if request.get("add_generation_prompt", True) is not False:
        raise BadRequest(400, BOTH_FLAGS)
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, NOT_ASSISTANT)
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise BadRequest(400, NOT_ASSISTANT)
    return resumed_at(content_text(last.get("content")))


def completion_start(request: dict[str, Any]) -> int:
    prompt = request.get("prompt")
    return resumed_at(prompt) if isinstance(prompt, str) else 0


def prefill(request: dict[str, Any]) -> str | None:
    """An Anthropic request's prefill (its final assistant message's text), if it has one;
    400 when it ends in whitespace, as the API answers."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None
    content = content_text(last.get("content"))
    if content != content.rstrip():
        raise BadRequest(400, TRAILING_WHITESPACE)
    return content
