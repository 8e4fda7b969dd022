"""What a backend's 4xx says about the request itself, read from its error body.

Two such answers matter to the gateway, because neither is the instance's fault and neither
is cured by asking the same model again:
- the prompt does not fit the model's context window: the request may go to a model with a
  larger one (`context_fallbacks`), never to the same model again;
- a content-policy refusal: the answer, whose reason must reach the client unchanged.

Engines word them differently, so both are recognised by their codes, types and wording:
- vLLM (OpenAI-style body, 400): "This model's maximum context length is 4096 tokens. However,
  you requested 5000 tokens...", "...maximum context length is 4096 tokens and your request has
  4000 input tokens...", "The decoder prompt (length 5000) is longer than the maximum model
  length of 4096";
- llama.cpp's server (400, type `exceed_context_size_error`): "request (4476 tokens) exceeds
  the available context size (4096 tokens)", earlier "the request exceeds the available
  context size";
- OpenAI (400, code `context_length_exceeded`; content policy: code
  `content_policy_violation` or `content_filter`);
- Anthropic (400 `invalid_request_error`): "prompt is too long: 208000 tokens > 200000
  maximum", "input length and `max_tokens` exceed context limit: ...".
"""

from __future__ import annotations

import json
import re
from typing import Final, Literal

Refusal = Literal["context_length", "content_policy"]

_CONTEXT_CODES: Final = frozenset(
    ("context_length_exceeded", "exceed_context_size_error", "context_window_exceeded")
)
_CONTEXT_WORDING: Final = re.compile(
    r"maximum context length"
    r"|exceeds? the available context size"
    r"|longer than the maximum model length"
    r"|prompt is too long"
    r"|exceed context limit"
    r"|context length exceeded"
    r"|context window",
    re.IGNORECASE,
)
_POLICY_CODES: Final = frozenset(
    ("content_policy_violation", "content_filter", "content_policy", "responsible_ai_policy")
)
_POLICY_WORDING: Final = re.compile(
    r"content (?:management )?polic|content filter|safety system|usage polic", re.IGNORECASE
)
# An error body larger than this is not a refusal anyone wrote: not read.
_MAX_BODY: Final = 64 * 1024


def refusal_of(status: int, body: bytes | None) -> Refusal | None:
    """What a 4xx answer (`status`, its `body`) says of the request: a prompt over the
    context window, a content-policy refusal, or None (anything else, or not a 4xx)."""
    if not 400 <= status < 500 or not body or len(body) > _MAX_BODY:
        return None
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    error = value.get("error") if isinstance(value, dict) else None
    if not isinstance(error, dict):
        return None
    codes = {str(error.get(key, "")).lower() for key in ("code", "type")}
    message = str(error.get("message", ""))
    if codes & _POLICY_CODES or _POLICY_WORDING.search(message):
        return "content_policy"
    if codes & _CONTEXT_CODES or _CONTEXT_WORDING.search(message):
        return "context_length"
    return None
