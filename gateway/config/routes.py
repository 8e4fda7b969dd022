"""The paths the data plane proxies (matched exactly, never as prefixes): OpenAI-compatible ones,
and Anthropic's Messages API."""

from __future__ import annotations

PROXY_ROUTES: frozenset[str] = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"}
)
MODELS_PATH = "/v1/models"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API

# The OpenTelemetry GenAI conventions' operation of each route, and its provider: the protocol
# family the client speaks (OpenAI-compatible servers such as vLLM speak OpenAI's).
GENAI_OPERATIONS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "chat",
}
GENAI_PROVIDERS: dict[str, str] = {"/v1/messages": "anthropic"}
DEFAULT_GENAI_PROVIDER = "openai"


def genai_attributes(path: str) -> dict[str, str]:
    """The GenAI attributes a span of this route starts with (known before its body is read,
    as the conventions ask for sampling)."""
    return {
        "gen_ai.operation.name": GENAI_OPERATIONS.get(path, "chat"),
        "gen_ai.provider.name": GENAI_PROVIDERS.get(path, DEFAULT_GENAI_PROVIDER),
    }
