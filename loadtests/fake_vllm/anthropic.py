"""The Anthropic Messages API (`POST /v1/messages`) on the fake backend.

Same latency model, engine and run-time faults as the OpenAI routes, with Anthropic's shapes:

- a plain answer is one `message` object; `stop_reason` is "max_tokens" because, as on the
  OpenAI routes, exactly `max_tokens` tokens are generated;
- a stream is `message_start`, `content_block_start`, `ping`, one `content_block_delta` per
  token event (`tokens_per_event` tokens), `content_block_stop`, `message_delta`,
  `message_stop`, each as `event: NAME\\ndata: JSON\\n\\n`; the first three leave when the first
  token is due (after ttft), so the first body byte arrives when it does on the OpenAI routes;
- errors are `{"type":"error","error":{"type":...,"message":...}}`: rate_limit 429
  rate_limit_error (with retry-after), error `error_status` (api_error for 5xx), oom 500
  api_error, overloaded 529 overloaded_error, hang 504 timeout_error after hang_s, bad
  requests 400 invalid_request_error, an unknown model 404 not_found_error;
- `stream_error` ends a stream after `stall_after` deltas with `event: error` (overloaded_error),
  as the API reports a failure once the stream has started; die and stall behave as on the
  OpenAI streams (the connection is cut; the stream stops and the connection closes after hang_s).

The request log's record of a Messages request shows whether `x-api-key` and `authorization`
were sent and a short hash of each (their values in `headers` are redacted); only with
`--record-credentials` does a `credentials` field hold their exact values.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Any

from . import responses as r
from .asgi import (
    Headers,
    Receive,
    Scope,
    Send,
    body_message,
    die_midway,
    respond,
    start_message,
)
from .bodies import BadRequest, parse_object
from .config import DIE, ERROR, HANG, OOM, OVERLOADED, RATE_LIMIT, STALL, STREAM_ERROR, Faults
from .continuation import prefill, resumed_at
from .engine import EngineOOM
from .pacing import Pacer, cut_point, cut_short, pause, send_tokens
from .requestlog import RequestRecord

if TYPE_CHECKING:
    from .app import FakeVllm

MESSAGES = "/v1/messages"
SSE = b"text/event-stream; charset=utf-8"
MAX_TOKENS_LIMIT = 1_000_000
REDACTED = "[redacted]"
CREDENTIAL_HEADERS = ("x-api-key", "authorization")
ROLES = ("user", "assistant")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> bytes:
    return r.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


OVERLOADED_BODY = error_body(529, "Overloaded")
# How the API reports a failure after a stream's 200 and first events went out.
ERROR_EVENT = b"event: error\ndata: " + OVERLOADED_BODY + b"\n\n"
PING_EVENT = b'event: ping\ndata: {"type":"ping"}\n\n'
BLOCK_START_EVENT = (
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
)
BLOCK_STOP_EVENT = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
MESSAGE_STOP_EVENT = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def message_body(
    mid: str, model_json: str, n: int, input_tokens: int, start: int = 0, echo: str = ""
) -> bytes:
    # Token text is plain ASCII words (responses.VOCAB): safe inside a JSON string as it is;
    # an echoed prefill is the client's text, escaped.
    content = r.dumps(echo + r.generated(n, start)).decode()
    return (
        f'{{"id":"{mid}","type":"message","role":"assistant","model":{model_json},'
        f'"content":[{{"type":"text","text":{content}}}],"stop_reason":"max_tokens",'
        f'"stop_sequence":null,"usage":{{"input_tokens":{input_tokens},"output_tokens":{n}}}}}'
    ).encode()


class EventWriter:
    """The SSE events of one streamed message."""

    def __init__(self, mid: str, model_json: str, start: int = 0, echo: str = "") -> None:
        self._mid = mid
        self._model_json = model_json
        self.first = start  # the first token's index: past 0 when a prefill is continued
        self._echo = echo  # a prefill streamed again, before the first token

    def start(self, input_tokens: int) -> bytes:
        """message_start, content_block_start and ping, sent together."""
        message = (
            f'{{"id":"{self._mid}","type":"message","role":"assistant","model":{self._model_json},'
            f'"content":[],"stop_reason":null,"stop_sequence":null,'
            f'"usage":{{"input_tokens":{input_tokens},"output_tokens":1}}}}'
        )
        head = f'event: message_start\ndata: {{"type":"message_start","message":{message}}}\n\n'
        return head.encode() + BLOCK_START_EVENT + PING_EVENT

    def delta(self, start: int, end: int) -> bytes:
        """One content_block_delta carrying tokens `start` .. `end - 1` (of this answer)."""
        content = r.span(self.first + start, self.first + end)
        if start == 0 and self._echo:
            content = r.dumps(self._echo).decode()[1:-1] + content
        return (
            f'event: content_block_delta\ndata: {{"type":"content_block_delta","index":0,'
            f'"delta":{{"type":"text_delta","text":"{content}"}}}}\n\n'
        ).encode()

    @staticmethod
    def finish(n: int) -> bytes:
        """content_block_stop, message_delta and message_stop, sent together."""
        delta = (
            'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
            f'"max_tokens","stop_sequence":null}},"usage":{{"output_tokens":{n}}}}}\n\n'
        )
        return BLOCK_STOP_EVENT + delta.encode() + MESSAGE_STOP_EVENT


# --- the request log -------------------------------------------------------------------------


def _short_hash(value: str | None) -> str | None:
    return None if value is None else hashlib.sha256(value.encode()).hexdigest()[:12]


def log_credentials(record: RequestRecord, record_exact: bool) -> None:
    """Redact the credential headers of `record`, noting which came (and, if asked, values)."""
    headers = record.headers
    exact = {name: headers.get(name) for name in CREDENTIAL_HEADERS}
    for name, value in exact.items():
        if value is not None:
            headers[name] = REDACTED
    key, authorization = exact["x-api-key"], exact["authorization"]
    version = headers.get("anthropic-version")
    extra: dict[str, Any] = {
        "api_key_present": key is not None,
        "api_key_sha256": _short_hash(key),
        "authorization_present": authorization is not None,
        "authorization_sha256": _short_hash(authorization),
        "anthropic_version_present": version is not None,
        "anthropic_version": version,
    }
    if record_exact:
        extra["credentials"] = exact
    record.extra = extra


# --- request validation ----------------------------------------------------------------------


def _max_tokens(request: dict[str, Any]) -> int:
    value = request.get("max_tokens")
    if value is None:
        raise BadRequest(400, "max_tokens: Field required")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise BadRequest(400, f"max_tokens: must be an integer between 1 and {MAX_TOKENS_LIMIT}")
    return value


def _check_blocks(where: str, blocks: Any) -> None:
    if not isinstance(blocks, list):
        raise BadRequest(400, f"{where}: Input should be a valid string or list")
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(400, f"{where}.{i}: each block needs a string 'type'")
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise BadRequest(400, f"{where}.{i}.text: Field required")


def _input_tokens(request: dict[str, Any]) -> int:
    """Validate `messages` and `system`; their rough token count (whitespace-separated words)."""
    messages = request.get("messages")
    if messages is None:
        raise BadRequest(400, "messages: Field required")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "messages: must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(400, f"messages.{i}: Input should be an object")
        if message.get("role") not in ROLES:
            raise BadRequest(400, f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = message.get("content")
        if not isinstance(content, str):
            _check_blocks(f"messages.{i}.content", content)
    system = request.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks("system", system)
    return max(1, r.count_words(messages) + r.count_words(system))


def _model(request: dict[str, Any], record: RequestRecord, models: dict[str, int]) -> str:
    model = request.get("model")
    if model is None:
        raise BadRequest(400, "model: Field required")
    if not isinstance(model, str):
        raise BadRequest(400, "model: Input should be a valid string")
    record.model = model
    if model not in models:
        raise BadRequest(404, f"model: {model}")
    return model


# --- the handler -----------------------------------------------------------------------------


async def handle_messages(app: FakeVllm, scope: Scope, receive: Receive, send: Send) -> None:
    record, body = await app._receive_logged(scope, receive)
    if body is None:
        return
    log_credentials(record, app.config.record_credentials)
    rid = app._next_rid()
    ids: Headers = [(b"request-id", f"req_{rid}".encode())]
    try:
        request = parse_object(body)
        model = _model(request, record, app.running)
        stream = request.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(400, "stream: Input should be a valid boolean")
        record.stream = stream
        n = _max_tokens(request)
        record.max_tokens = n
        input_tokens = _input_tokens(request)
        limit = app.config.max_model_len
        if limit and input_tokens + n > limit:
            raise BadRequest(
                400,
                f"input length and `max_tokens` exceed context limit: {input_tokens} + {n} > "
                f"{limit}, decrease input length or `max_tokens` and try again",
            )
        prefilled = prefill(request)
    except BadRequest as exc:
        await respond(send, exc.status, error_body(exc.status, exc.message), extra=ids)
        app.log.finish(record, "error")
        return

    faults = app.faults
    fault = faults.draw(app.rng, stream, anthropic=True)
    if stream and fault is None:
        fault = app.forced_fault(stream=True)
    record.fault = fault
    start = resumed_at(prefilled) if prefilled else 0
    # llama.cpp's server streams a prefill again before its continuation.
    echo = prefilled if prefilled and app.config.echo_prefill else ""
    ttft = faults.ttft_s(app.config)
    per_token_s = faults.per_token_s(app.config)
    engine = app.engine
    mid = f"msg_{rid}"
    model_json = app._model_json[model]

    async def generate(per_token: float) -> str:
        if stream:
            return await _stream(
                app, send, ids, EventWriter(mid, model_json, start, echo), n, input_tokens, ttft,
                per_token, fault, faults,
            )  # fmt: skip
        full = message_body(mid, model_json, n, input_tokens, start, echo)
        if fault == DIE:
            # Promise the whole body, send half, then let uvicorn drop the connection.
            await pause(ttft + per_token * min(faults.die_after, n))
            return await die_midway(send, full, ids)
        await pause(ttft + per_token * n)
        await respond(send, 200, full, extra=ids)
        return "ok"

    async def run() -> str:
        # Faults decided before any token is generated are answered outside the engine.
        if fault is not None and fault not in (DIE, STALL, STREAM_ERROR):
            return await _fault_reply(app, send, ids, fault, faults)
        if engine is None:
            return await generate(per_token_s)
        try:
            async with engine.run(input_tokens + n) as factor:
                return await generate(per_token_s * factor)
        except EngineOOM:
            record.fault = OOM
            return await _fault_reply(app, send, ids, OOM, faults)

    await app._guarded(receive, record, model, run)


async def _stream(
    app: FakeVllm,
    send: Send,
    ids: Headers,
    writer: EventWriter,
    n: int,
    input_tokens: int,
    ttft: float,
    per_token: float,
    fault: str | None,
    faults: Faults,
) -> str:
    await send(start_message(200, SSE, None, [(b"cache-control", b"no-cache"), *ids]))
    stop_after = faults.stall_after if fault in (STALL, STREAM_ERROR) else None
    cut = cut_point(n, faults.die_after if fault == DIE else stop_after)
    step = faults.tokens_per_event_n(app.config)
    pacer = Pacer(ttft, per_token)
    await pacer.first_token()
    await send(body_message(writer.start(input_tokens), more=True))
    await send_tokens(send, pacer, n, step, cut, writer.delta)
    ended = await cut_short(fault, faults)
    if ended is not None:
        return ended
    if fault == STREAM_ERROR:
        await send(body_message(ERROR_EVENT, more=False))
        return "stream_error"
    await send(body_message(writer.finish(n), more=False))
    return "ok"


async def _fault_reply(app: FakeVllm, send: Send, ids: Headers, fault: str, faults: Faults) -> str:
    """Answer, in Anthropic's shape, for the faults decided before any token is generated."""
    if fault == RATE_LIMIT:
        retry = [(b"retry-after", str(faults.retry_after).encode()), *ids]
        await respond(send, 429, error_body(429, "rate limit exceeded"), extra=retry)
        return "rate_limited"
    if fault == ERROR:
        status = faults.error_status
        await respond(send, status, error_body(status, faults.error_message), extra=ids)
        return "error"
    if fault == OOM:
        app.oom_count += 1
        count = [(b"x-oom-count", str(app.oom_count).encode()), *ids]
        await respond(send, 500, error_body(500, r.OOM_MESSAGE), extra=count)
        return "oom"
    if fault == OVERLOADED:
        await respond(send, 529, OVERLOADED_BODY, extra=ids)
        return "overloaded"
    assert fault == HANG
    # No headers until the client gives up (the guard cancels this sleep) or hang_s passes.
    await asyncio.sleep(faults.hang_s)
    await respond(send, 504, error_body(504, f"hung for {faults.hang_s:g} s"), extra=ids)
    return "hung"
