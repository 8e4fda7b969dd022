"""The OpenAI-compatible paths the data plane proxies (matched exactly, never as prefixes)."""

from __future__ import annotations

PROXY_ROUTES: frozenset[str] = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"}
)
MODELS_PATH = "/v1/models"
