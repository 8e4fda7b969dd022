"""Response bodies in the shapes vLLM's OpenAI-compatible server uses.

Generated text comes from a fixed vocabulary of plain ASCII words, so token text can be pasted
into JSON templates without escaping; only model names go through `json.dumps`.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

VOCAB = (
    "the", "model", "says", "hello", "to", "a", "fast", "gateway", "and", "its",
    "tokens", "flow", "like", "water", "over", "small", "stones", "in", "one", "clear",
    "stream", "while", "backends", "rest", "or", "fail", "but", "clients", "still", "get",
    "their", "answer",
)  # fmt: skip

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
    "of which 1.06 GiB is free."
)


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def token(i: int) -> str:
    """The text of the i-th generated token; tokens after the first carry their leading space."""
    word = VOCAB[i % len(VOCAB)]
    return word if i == 0 else " " + word


@lru_cache(maxsize=1024)
def text(n: int) -> str:
    return "".join(token(i) for i in range(n))


def span(start: int, end: int) -> str:
    """The text of generated tokens `start` .. `end - 1` (one SSE event's worth)."""
    if start == 0:
        return text(end)
    # Tokens after the first depend only on their position in the vocabulary's cycle.
    return _span(start % len(VOCAB), end - start)


@lru_cache(maxsize=4096)
def _span(phase: int, count: int) -> str:
    return "".join(" " + VOCAB[(phase + k) % len(VOCAB)] for k in range(count))


def error_body(status: int, message: str, kind: str | None = None) -> bytes:
    kind = kind or _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "Error")
    return dumps({"error": {"message": message, "type": kind, "code": status}})


def usage_json(prompt_tokens: int, completion_tokens: int) -> str:
    total = prompt_tokens + completion_tokens
    return (
        f'{{"prompt_tokens":{prompt_tokens},"total_tokens":{total},'
        f'"completion_tokens":{completion_tokens}}}'
    )


def generated(n: int, start: int = 0) -> str:
    """The text of `n` tokens from token `start` on (a continuation starts past 0)."""
    return text(n) if start == 0 else span(start, start + n)


def chat_body(rid: str, model_json: str, n: int, prompt_tokens: int, start: int = 0) -> bytes:
    return (
        f'{{"id":"chatcmpl-{rid}","object":"chat.completion","created":{int(time.time())},'
        f'"model":{model_json},"choices":[{{"index":0,"message":{{"role":"assistant",'
        f'"content":"{generated(n, start)}","tool_calls":[]}},"logprobs":null,'
        f'"finish_reason":"length",'
        f'"stop_reason":null}}],"usage":{usage_json(prompt_tokens, n)},"prompt_logprobs":null}}'
    ).encode()


def completion_body(rid: str, model_json: str, n: int, prompt_tokens: int, start: int = 0) -> bytes:
    return (
        f'{{"id":"cmpl-{rid}","object":"text_completion","created":{int(time.time())},'
        f'"model":{model_json},"choices":[{{"index":0,"text":"{generated(n, start)}",'
        f'"logprobs":null,"finish_reason":"length","stop_reason":null}}],'
        f'"usage":{usage_json(prompt_tokens, n)}}}'
    ).encode()


class ChunkWriter:
    """SSE events of one streamed response; the per-response JSON prefix is built once."""

    def __init__(self, chat: bool, rid: str, model_json: str) -> None:
        self._chat = chat
        self.chat = chat
        if chat:
            head = f'{{"id":"chatcmpl-{rid}","object":"chat.completion.chunk"'
        else:
            head = f'{{"id":"cmpl-{rid}","object":"text_completion"'
        self._head = f'data: {head},"created":{int(time.time())},"model":{model_json},'

    def token(self, i: int, last: bool) -> bytes:
        return self.tokens(i, i + 1, last)

    def tokens(self, start: int, end: int, last: bool) -> bytes:
        """One event carrying tokens `start` .. `end - 1` (vLLM's stream interval batches them)."""
        finish = '"length"' if last else "null"
        content = token(start) if end == start + 1 else span(start, end)
        if self._chat:
            # The first delta also names the role, as OpenAI and vLLM streams do.
            role = '"role":"assistant",' if start == 0 else ""
            choice = f'{{"index":0,"delta":{{{role}"content":"{content}"}},"logprobs":null,'
        else:
            choice = f'{{"index":0,"text":"{content}","logprobs":null,'
        return (
            f'{self._head}"choices":[{choice}"finish_reason":{finish},"stop_reason":null}}]}}\n\n'
        ).encode()

    def role(self) -> bytes:
        """vLLM's first chunk of a chat stream on its own: the role, with empty content (the
        fake folds it into the first token's chunk, except in a continuation)."""
        choice = '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
        return f'{self._head}"choices":[{choice}"finish_reason":null}}]}}\n\n'.encode()

    def usage(self, prompt_tokens: int, n: int) -> bytes:
        return f'{self._head}"choices":[],"usage":{usage_json(prompt_tokens, n)}}}\n\n'.encode()


DONE = b"data: [DONE]\n\n"
# How vLLM's OpenAI server ends a stream whose generation failed (its error response as JSON,
# by `json.dumps`, hence the spaces), before `[DONE]`.
STREAM_ERROR_EVENT = (
    b'data: {"error": {"object": "error", "message": "engine error mid-stream", '
    b'"type": "InternalServerError", "param": null, "code": 500}}\n\n'
)


def embedding(text_in: str) -> list[float]:
    """A deterministic unit vector of 8 floats derived from the input text."""
    seed = zlib.crc32(text_in.encode())
    raw = [((seed >> (4 * k)) & 0xF) - 7.5 for k in range(8)]
    norm = sum(x * x for x in raw) ** 0.5
    return [round(x / norm, 6) for x in raw]


def embeddings_body(model: str, inputs: list[str]) -> bytes:
    data = [
        {"object": "embedding", "index": i, "embedding": embedding(item)}
        for i, item in enumerate(inputs)
    ]
    tokens = sum(count_words(item) for item in inputs)
    return dumps(
        {
            "id": f"embd-{zlib.crc32(''.join(inputs).encode()):08x}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    )


def models_body(models: Iterable[str], created: int) -> bytes:
    return dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": m,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": m,
                    "parent": None,
                    "max_model_len": 8192,
                }
                for m in models
            ],
        }
    )


def fixed_chat_body() -> bytes:
    return chat_body("fixed", '"fixed"', 4, 4)


def count_words(value: Any) -> int:
    """A rough prompt-token count: whitespace-separated words in the strings of `value`."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(count_words(item) for item in value)
    if isinstance(value, Mapping):
        return count_words(value.get("content")) + count_words(value.get("text"))
    return 0


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_text(
    models: Iterable[str],
    running: Mapping[str, int],
    success: Mapping[str, int],
    waiting: int = 0,
    cache_usage: float | None = None,
    kv_tokens: int = 0,
) -> bytes:
    """Prometheus exposition with the names vLLM uses, labelled by `model_name`.

    `waiting` and `cache_usage` (0..1) are the engine's, shown on every model's line; without a
    cache size (None: a fake whose capacity is unlimited) the cache is never used up, so usage
    is 0 (an engine that serves any number of requests at full speed does not report a full
    cache). An engine with a KV
    cache of `kv_tokens` shows it as vLLM does, in blocks of 16 tokens, in `cache_config_info`.
    """
    names = list(models)
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, values: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {value!r}" for labels, value in values)

    per_model = [(m, f'model_name="{_label(m)}"') for m in names]
    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests currently running on GPU.",
        [(lbl, float(running.get(m, 0))) for m, lbl in per_model],
    )
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        [(lbl, float(waiting)) for _, lbl in per_model],
    )
    usage = [(lbl, 0.0 if cache_usage is None else float(cache_usage)) for m, lbl in per_model]
    # vLLM 0.10 renamed the cache gauge; both names are served so either kind of scraper works.
    family(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage.",
        usage,
    )
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage)
    family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        [(f'finished_reason="length",{lbl}', float(success.get(m, 0))) for m, lbl in per_model],
    )
    if kv_tokens > 0:
        family(
            "vllm:cache_config_info",
            "gauge",
            "Information of the LLMEngine CacheConfig",
            [(f'block_size="16",cache_dtype="auto",num_gpu_blocks="{kv_tokens // 16}"', 1.0)],
        )
    return ("\n".join(lines) + "\n").encode()
