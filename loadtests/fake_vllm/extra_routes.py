"""vLLM's other model routes on the fake backend: audio, tokenizer, pooling, score and rerank,
and one route vLLM does not have (`/v1/_fake/echo`), standing for any route the gateway does not
know (a server plugin's).

Each answers in vLLM's shape with the same faults as the generation routes, drawn as for a
plain request (`error`, `rate_limit`, `oom`, `hang` before answering; `die` cuts the body).
`model` may be left out everywhere, as vLLM allows: the first served model answers.

- `/v1/audio/transcriptions`, `/v1/audio/translations`: a multipart form (`file`, `model`,
  `stream`, `stream_include_usage`); the text has one word per 256 bytes of the file (1 to
  64). A plain answer is `{"text": ..., "usage": {"type": "duration", "seconds": ...}}`; a stream
  is `transcription.chunk` (`translation.chunk`) events, one per word, the last with
  `finish_reason` "stop", a usage chunk when asked, then `data: [DONE]`.
- `/tokenize` (`prompt` or `messages`), `/detokenize` (`tokens`).
- `/pooling`, `/classify`, `/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`.
- `/v1/_fake/echo`: the path and a hash of the body; with `"stream": true`, three `data:`
  events of its own making and no `[DONE]` (a protocol the gateway does not know).
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from starlette.datastructures import UploadFile
from starlette.requests import Request

from . import responses as r
from .asgi import Message, Receive, Scope, Send, answer_whole, body_message, respond, start_message
from .bodies import BadRequest, parse_object
from .config import DIE, STALL, STREAM_ERROR
from .pacing import Pacer, cut_point, end_stream, pause, send_tokens

if TYPE_CHECKING:
    from .app import FakeVllm

SSE = b"text/event-stream; charset=utf-8"
AUDIO = ("/v1/audio/transcriptions", "/v1/audio/translations")
ECHO = "/v1/_fake/echo"
Build = Callable[[dict[str, Any], str], dict[str, Any]]
_TRUE = frozenset(("true", "1", "yes", "on", "t", "y"))


def _words(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [word for item in value for word in _words(item)]
    if isinstance(value, dict):
        return _words(value.get("content")) + _words(value.get("text"))
    return []


def _tokenize(request: dict[str, Any], model: str) -> dict[str, Any]:
    words = _words(request.get("prompt", request.get("messages")))
    tokens = [zlib.crc32(word.encode()) % 50_000 for word in words]
    return {"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None}


def _detokenize(request: dict[str, Any], model: str) -> dict[str, Any]:
    tokens = request.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise BadRequest(400, "'tokens' must be a list of integers")
    return {"prompt": " ".join(r.VOCAB[t % len(r.VOCAB)] for t in tokens)}


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _inputs(request: dict[str, Any]) -> list[str]:
    value = request.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise BadRequest(400, "'input' must be a string or a non-empty list of strings")


def _pooling(request: dict[str, Any], model: str) -> dict[str, Any]:
    inputs = _inputs(request)
    data = [
        {"index": i, "object": "pooling", "data": r.embedding(item)}
        for i, item in enumerate(inputs)
    ]
    return _listed(model, "pool", data, sum(len(_words(i)) for i in inputs))


def _classify(request: dict[str, Any], model: str) -> dict[str, Any]:
    inputs = _inputs(request)
    data = []
    for i, item in enumerate(inputs):
        positive = (zlib.crc32(item.encode()) % 100) / 100
        data.append(
            {
                "index": i,
                "label": "positive" if positive >= 0.5 else "negative",
                "probs": [round(1 - positive, 2), positive],
                "num_classes": 2,
            }
        )
    return _listed(model, "classify", data, sum(len(_words(i)) for i in inputs))


def _score_of(a: str, b: str) -> float:
    shared = set(a.split()) & set(b.split())
    return round(len(shared) / max(1, len(set(b.split()))), 4)


def _score(request: dict[str, Any], model: str) -> dict[str, Any]:
    first, second = request.get("text_1"), request.get("text_2")
    if not isinstance(first, str) or not isinstance(second, (str, list)):
        raise BadRequest(400, "'text_1' must be a string and 'text_2' a string or a list")
    seconds = [second] if isinstance(second, str) else [str(s) for s in second]
    data = [
        {"index": i, "object": "score", "score": _score_of(first, s)} for i, s in enumerate(seconds)
    ]
    return _listed(model, "score", data, len(_words(first)) + len(_words(seconds)))


def _rerank(request: dict[str, Any], model: str) -> dict[str, Any]:
    query, documents = request.get("query"), request.get("documents")
    if not isinstance(query, str) or not isinstance(documents, list) or not documents:
        raise BadRequest(400, "'query' must be a string and 'documents' a non-empty list")
    texts = [str(d) for d in documents]
    ranked = sorted(
        (
            {"index": i, "document": {"text": t}, "relevance_score": _score_of(query, t)}
            for i, t in enumerate(texts)
        ),
        key=lambda result: -cast(float, result["relevance_score"]),
    )
    top_n = request.get("top_n")
    if isinstance(top_n, int) and top_n > 0:
        ranked = ranked[:top_n]
    tokens = len(_words(query)) + len(_words(texts))
    return {"id": f"rerank-{_id(query)}", "model": model, "usage": {"total_tokens": tokens},
            "results": ranked}  # fmt: skip


def _id(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def _listed(model: str, kind: str, data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    return {
        "id": f"{kind}-{_id(repr(data))}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _usage(tokens),
    }


JSON_ROUTES: dict[str, Build] = {
    "/tokenize": _tokenize,
    "/detokenize": _detokenize,
    "/pooling": _pooling,
    "/classify": _classify,
    "/score": _score,
    "/v1/score": _score,
    "/rerank": _rerank,
    "/v1/rerank": _rerank,
    "/v2/rerank": _rerank,
}


async def handle_json(app: FakeVllm, scope: Scope, receive: Receive, send: Send) -> None:
    """A JSON route answered whole (`JSON_ROUTES`, and the echo route)."""
    record, body = await app._receive_logged(scope, receive)
    if body is None:
        return
    path = scope["path"]
    try:
        request = parse_object(body)
        model = app._model(request, record)
        stream = path == ECHO and request.get("stream") is True
        record.stream = stream
        if path == ECHO:
            answer = {"path": path, "model": model, "body_sha256": hashlib.sha256(body).hexdigest()}
        else:
            answer = JSON_ROUTES[path](request, model)
    except BadRequest as exc:
        await respond(send, exc.status, r.error_body(exc.status, exc.message))
        app.log.finish(record, "error")
        return
    faults = app.faults
    fault = faults.draw(app.rng, stream)
    record.fault = fault

    async def run() -> str:
        if fault is not None and fault not in (DIE, STALL, STREAM_ERROR):
            return await app._fault_reply(send, fault, faults)
        await pause(faults.ttft_s(app.config))
        if stream:
            return await _echo_stream(send, answer, fault)
        return await answer_whole(send, r.dumps(answer), fault == DIE)

    await app._guarded(receive, record, model, run)


async def _echo_stream(send: Send, answer: dict[str, Any], fault: str | None) -> str:
    await send(start_message(200, SSE, None, [(b"cache-control", b"no-cache")]))
    for part in range(3):
        if fault == DIE and part == 2:
            return "died"
        await send(body_message(b"data: " + r.dumps({**answer, "part": part}) + b"\n\n", True))
    await send(body_message(b"", more=False))
    return "ok"


async def handle_audio(app: FakeVllm, scope: Scope, receive: Receive, send: Send) -> None:
    """A transcription or translation of a multipart form's `file`."""
    record, body = await app._receive_logged(scope, receive)
    if body is None:
        return
    path = scope["path"]
    try:
        form = await _form(scope, body)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadRequest(422, "'file' must be an uploaded file")
        size = len(await upload.read())
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        model = app._model({"model": fields.get("model")}, record)
        stream = fields.get("stream", "false").lower() in _TRUE
        include_usage = fields.get("stream_include_usage", "false").lower() in _TRUE
        record.stream = stream
    except BadRequest as exc:
        await respond(send, exc.status, r.error_body(exc.status, exc.message))
        app.log.finish(record, "error")
        return
    n = max(1, min(64, size // 256))
    record.max_tokens = n
    seconds = max(1, size // 32_000)
    faults = app.faults
    fault = faults.draw(app.rng, stream)
    if stream and fault is None:
        fault = app.forced_fault(stream=True)
    record.fault = fault
    ttft, per_token = faults.ttft_s(app.config), faults.per_token_s(app.config)
    kind = "translation.chunk" if path == AUDIO[1] else "transcription.chunk"
    rid = app._next_rid()

    async def run() -> str:
        if fault is not None and fault not in (DIE, STALL, STREAM_ERROR):
            return await app._fault_reply(send, fault, faults)
        if not stream:
            await pause(ttft + per_token * n)
            full = r.dumps({"text": r.text(n), "usage": {"type": "duration", "seconds": seconds}})
            return await answer_whole(send, full, fault in (DIE, STREAM_ERROR))
        await send(start_message(200, SSE, None, [(b"cache-control", b"no-cache")]))

        def chunk(start: int, end: int) -> bytes:
            choice = {
                "delta": {"content": r.span(start, end)},
                "finish_reason": "stop" if end == n else None,
                "stop_reason": None,
            }
            event = {"id": f"trsc-{rid}", "object": kind, "created": int(time.time()),
                     "model": model, "choices": [choice]}  # fmt: skip
            return b"data: " + r.dumps(event) + b"\n\n"

        stop_after = faults.stall_after if fault in (STALL, STREAM_ERROR) else None
        cut = cut_point(n, faults.die_after if fault == DIE else stop_after)
        pacer = Pacer(ttft, per_token)
        await pacer.first_token()
        await send_tokens(send, pacer, n, 1, cut, chunk)
        usage = None
        if include_usage:
            said = {"id": f"trsc-{rid}", "object": kind, "created": int(time.time()),
                    "model": model, "choices": [], "usage": {"prompt_tokens": seconds,
                    "completion_tokens": n, "total_tokens": seconds + n}}  # fmt: skip
            usage = b"data: " + r.dumps(said) + b"\n\n"
        return await end_stream(send, fault, faults, usage)

    await app._guarded(receive, record, model, run)


async def _form(scope: Scope, body: bytes) -> dict[str, Any]:
    """The multipart form in `body`, parsed as vLLM's server (Starlette) parses it."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(scope, replay).form()
    except Exception as exc:  # Starlette's parse errors: a 400 as vLLM gives
        raise BadRequest(400, f"invalid form: {exc}") from None
    return dict(form.multi_items())
