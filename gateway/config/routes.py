"""The routes the data plane proxies, and what the gateway knows of each.

A model route is a POST whose body names a model (a JSON `model`, or a `model` form field of a
multipart body): the model picks the pool. The known routes are vLLM's (and Anthropic's
Messages API): the gateway knows how their answers end, whether they stream, what their
latency looks like and whether sending them twice is harmless. Any other POST under `/v1/` is
proxied too, with less: it must name its model, it is retried only when it was never sent,
never hedged, its stream relayed as it comes (`Route.protocol` "opaque"), and never sent to a
pool whose instances are reached with the operator's own key (`credentials`). vLLM's admin
routes under `/v1/` (LoRA adapters loaded and unloaded at run time) are not proxied at all.

Pure data: the ingress maps a route's protocol to its error dialect, the pipeline reads the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final, Literal

MODELS_PATH: Final = "/v1/models"
MESSAGES_PATH: Final = "/v1/messages"  # Anthropic's Messages API
CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
RESPONSES_PATH: Final = "/v1/responses"

# What the latency model describes, and so what teaches it and is timed by it:
# - generation: a prefill, then tokens decoded one by one (chat, completions, messages, responses);
# - pooling: a prefill and nothing decoded (embeddings, score, rerank, classify);
# - utility: no inference at all (tokenize, detokenize): fast whatever the engine's load;
# - audio: a speech model's decoding, whose time follows the audio's length, not the body's;
# - other: a route the gateway does not know.
Kind = Literal["generation", "pooling", "utility", "audio", "other"]
# How the answers of a route look: its errors' shape and how a stream of it ends
# (`ingress.dialect`); "opaque": unknown, relayed as it comes.
Protocol = Literal["openai", "anthropic", "responses", "opaque"]


@dataclass(frozen=True, slots=True)
class Route:
    """One proxied route.

    `template`: its name for spans and metrics (`http.route`): the path of a known route,
    `/v1/*` for the others, so a client's paths never become label values. `operation`: the
    OpenTelemetry GenAI operation (None: not known to be one). `streams`: known to answer
    with an SSE stream when asked (`stream: true`)."""

    path: str
    template: str
    kind: Kind
    protocol: Protocol
    operation: str | None
    streams: bool

    @property
    def modelled(self) -> bool:
        """Whether its answers' latency is what the instance's latency model predicts: only
        those teach it (and the balancer's peak EWMA and the concurrency limiter) and are timed
        by it. The others wait up to the request's deadline, as they would going direct, and a
        tokenize answered in a millisecond or a transcription of ten minutes of audio leaves
        the predictions for the pool's generations as they were."""
        return self.kind == "generation" or self.kind == "pooling"

    @property
    def hedged(self) -> bool:
        """Whether a slow first attempt may get a second one: where the latency model says
        what slow is (and the request does nothing twice: `acts`)."""
        return self.modelled

    @property
    def generates(self) -> bool:
        """Whether it decodes tokens (a `max_tokens` bounds it)."""
        return self.kind == "generation"

    @property
    def provider(self) -> str:
        """The GenAI conventions' `gen_ai.provider.name`: the protocol family the client speaks
        (OpenAI-compatible servers such as vLLM speak OpenAI's)."""
        return "anthropic" if self.protocol == "anthropic" else "openai"


def _known(
    path: str, kind: Kind, operation: str, protocol: Protocol = "openai", streams: bool = False
) -> Route:
    return Route(path, path, kind, protocol, operation, streams)


KNOWN_ROUTES: Final[dict[str, Route]] = {
    route.path: route
    for route in (
        _known(CHAT_PATH, "generation", "chat", streams=True),
        _known(COMPLETIONS_PATH, "generation", "text_completion", streams=True),
        _known(MESSAGES_PATH, "generation", "chat", "anthropic", streams=True),
        _known(RESPONSES_PATH, "generation", "chat", "responses", streams=True),
        _known("/v1/embeddings", "pooling", "embeddings"),
        _known("/pooling", "pooling", "embeddings"),
        _known("/classify", "pooling", "classify"),
        _known("/score", "pooling", "score"),
        _known("/v1/score", "pooling", "score"),
        _known("/rerank", "pooling", "rerank"),
        _known("/v1/rerank", "pooling", "rerank"),
        _known("/v2/rerank", "pooling", "rerank"),
        _known("/tokenize", "utility", "tokenize"),
        _known("/detokenize", "utility", "detokenize"),
        _known("/v1/audio/transcriptions", "audio", "transcription", streams=True),
        _known("/v1/audio/translations", "audio", "translation", streams=True),
    )
}
CHAT: Final = KNOWN_ROUTES[CHAT_PATH]
OTHER_TEMPLATE: Final = "/v1/*"
# vLLM's run-time administration under /v1/ (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`): an operator's
# business, sent to one instance at a time, never a client's through the gateway.
ADMIN_PATHS: Final = frozenset(("/v1/load_lora_adapter", "/v1/unload_lora_adapter"))
# A path proxied without being known: under /v1/, of unreserved characters only (so what the
# upstream gets is exactly what was matched: no escapes, no dot segments, no empty segment).
_OTHER_PATH: Final = re.compile(r"/v1(?:/[A-Za-z0-9_~-][A-Za-z0-9._~-]*)+")
_MAX_OTHER_PATH: Final = 256


# The Responses API's cancel of a background response: it names the response, not a model
# (in a gateway of one pool, that pool's; vLLM keeps responses on the instance that made them).
_CANCEL: Final = re.compile(r"/v1/responses/[A-Za-z0-9_-]{1,128}/cancel")
CANCEL_TEMPLATE: Final = "/v1/responses/{response_id}/cancel"


def route_for(path: str) -> Route | None:
    """The route of a request path (the path as decoded), or None when it is not proxied."""
    route = KNOWN_ROUTES.get(path)
    if route is not None:
        return route
    if _CANCEL.fullmatch(path) is not None:
        return Route(path, CANCEL_TEMPLATE, "utility", "openai", None, False)
    if len(path) > _MAX_OTHER_PATH or path in ADMIN_PATHS:
        return None
    if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
        return None
    if _OTHER_PATH.fullmatch(path) is None:
        return None
    return Route(path, OTHER_TEMPLATE, "other", "opaque", None, False)


def acts(route: Route, request: dict[str, Any]) -> bool:
    """Whether sending this request twice could do something twice, beyond computing an
    answer: a Responses API request that runs in the background or with tools the server runs
    itself (MCP, code interpreter, web search: anything but the client's own functions), or
    any request on a route the gateway does not know. Such a request is sent again only when
    it never left (a refused connection), and never hedged."""
    if route.kind == "other":
        return True
    if route.protocol != "responses":
        return False
    if request.get("background") is True:
        return True
    tools = request.get("tools")
    if not isinstance(tools, list):
        return False
    return any(not isinstance(t, dict) or t.get("type") != "function" for t in tools)


def genai_attributes(route: Route) -> dict[str, str]:
    """The GenAI attributes a span of this route starts with (known before its body is read,
    as the conventions ask for sampling); none on a route not known to be a GenAI operation."""
    if route.operation is None:
        return {}
    return {"gen_ai.operation.name": route.operation, "gen_ai.provider.name": route.provider}
