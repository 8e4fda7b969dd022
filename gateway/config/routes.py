"""The paths the data plane proxies (matched exactly, never as prefixes): OpenAI-compatible ones,
and Anthropic's Messages API."""

from __future__ import annotations

PROXY_ROUTES: frozenset[str] = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"}
)
MODELS_PATH = "/v1/models"
