"""The fake vLLM backend as a pure ASGI application.

Routing is one dict lookup on (method, path); per-model JSON fragments and fixed bodies are built
once at start-up, so the plain non-streamed path does little more than parse and answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from . import responses as r
from .anthropic import MESSAGES, handle_messages
from .asgi import (
    JSON,
    DisconnectGuard,
    Receive,
    Scope,
    Send,
    body_message,
    die_midway,
    read_body,
    respond,
    start_message,
)
from .bodies import BadRequest, parse_object
from .config import DIE, ERROR, HANG, OOM, RATE_LIMIT, STALL, STREAM_ERROR, FakeConfig, Faults
from .continuation import chat_start, completion_start
from .engine import Engine, EngineOOM
from .extra_routes import AUDIO, ECHO, JSON_ROUTES, handle_audio, handle_json
from .pacing import Pacer, cut_point, end_stream, pause, send_tokens
from .requestlog import RequestLog, RequestRecord
from .responses_api import RESPONSES, handle_responses

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
SSE = b"text/event-stream; charset=utf-8"
MAX_TOKENS_LIMIT = 1_000_000


class FakeVllm:
    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.faults = Faults()
        self.rng = random.Random(config.seed)
        self.log = RequestLog(config.log_size)
        self.oom_count = 0
        # Streams left to cut after `die_after` tokens (`die_next`), whatever the rates say.
        self.die_left = 0
        self.error_left = 0  # and streams left to end with the engine's error event
        self.refuse_left = 0  # and requests left to refuse with an error before any token
        self.running = dict.fromkeys(config.models, 0)
        self.success = dict.fromkeys(config.models, 0)
        # None keeps the fake as it was: every request generates at once, without limits.
        self.engine: Engine | None = None
        if config.engine_enabled:
            self.engine = Engine(
                config.max_running, config.kv_tokens, config.batch_slowdown, config.oom_above
            )
        self._model_json = {m: json.dumps(m) for m in config.models}
        self._id_prefix = secrets.token_hex(4)
        self._seq = 0
        self._models_body = r.models_body(config.models, int(time.time()))
        fixed = r.fixed_chat_body()
        self._fixed_start = start_message(200, JSON, len(fixed), [])
        self._fixed_body = body_message(fixed, more=False)
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", CHAT): self._chat,
            ("POST", COMPLETIONS): self._completions,
            ("POST", EMBEDDINGS): self._embeddings,
            ("POST", MESSAGES): self._messages,
            ("POST", RESPONSES): self._responses,
            **{("POST", path): self._audio for path in AUDIO},
            **{("POST", path): self._json for path in (*JSON_ROUTES, ECHO)},
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/_fake/faults"): self._get_faults,
            ("POST", "/_fake/faults"): self._set_faults,
            ("POST", "/_fake/reset"): self._reset,
            ("GET", "/_fake/engine"): self._engine_state,
            ("GET", "/_fake/requests"): self._requests,
        }
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        method: str = scope["method"]
        path: str = scope["path"]
        if self.config.fixed_body and method == "POST" and path.startswith("/v1/"):
            await send(self._fixed_start)
            await send(self._fixed_body)
            return
        handler = self._routes.get((method, path))
        if handler is not None:
            await handler(scope, receive, send)
        elif path in self._paths:
            await respond(send, 405, r.error_body(405, f"method {method} not allowed"))
        else:
            await respond(send, 404, r.error_body(404, f"no route for {path}"))

    # --- generation endpoints ------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        record, body = await self._receive_logged(scope, receive)
        if body is None:
            return
        try:
            request = parse_object(body)
            model = self._model(request, record)
            stream = request.get("stream", False)
            if not isinstance(stream, bool):
                raise BadRequest(400, "'stream' must be a boolean")
            record.stream = stream
            n = _max_tokens(request)
            record.max_tokens = n
            start = chat_start(request) if chat else completion_start(request)
        except BadRequest as exc:
            await respond(send, exc.status, r.error_body(exc.status, exc.message))
            self.log.finish(record, "error")
            return
        prompt_tokens = max(1, r.count_words(request.get("messages" if chat else "prompt")))
        limit = self.config.max_model_len
        if limit and prompt_tokens + n > limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + n} tokens ({prompt_tokens} in the messages, {n} in "
                "the completion). Please reduce the length of the messages or completion."
            )
            await respond(send, 400, r.error_body(400, message, "BadRequestError"))
            self.log.finish(record, "error")
            return
        options = request.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True

        faults = self.faults
        fault = faults.draw(self.rng, stream)
        if fault is None:
            fault = self.forced_fault(stream)
        record.fault = fault
        ttft = faults.ttft_s(self.config)
        per_token = faults.per_token_s(self.config)
        engine = self.engine
        if engine is None and fault is None and not stream and ttft == 0 and per_token == 0:
            # Nothing to wait for, so nothing a disconnect could interrupt: skip the watcher.
            build = r.chat_body if chat else r.completion_body
            body = build(self._next_rid(), self._model_json[model], n, prompt_tokens, start)
            await respond(send, 200, body)
            self.success[model] += 1
            self.log.finish(record, "ok")
            return

        async def generate(per_token: float) -> str:
            rid = self._next_rid()
            if stream:
                writer = r.ChunkWriter(chat, rid, self._model_json[model])
                return await self._stream(
                    send, writer, n, prompt_tokens, include_usage, ttft, per_token, fault, faults,
                    start,
                )  # fmt: skip
            build = r.chat_body if chat else r.completion_body
            full = build(rid, self._model_json[model], n, prompt_tokens, start)
            if fault == DIE:
                await pause(ttft + per_token * min(faults.die_after, n))
                return await die_midway(send, full)
            await pause(ttft + per_token * n)
            await respond(send, 200, full)
            return "ok"

        async def run() -> str:
            # Faults decided before any token is generated are answered outside the engine.
            if fault is not None and fault not in (DIE, STALL, STREAM_ERROR):
                return await self._fault_reply(send, fault, faults)
            if engine is None:
                return await generate(per_token)
            try:
                # Nothing is sent while the request waits, so a stream's headers (and a plain
                # reply) leave only once it runs, and an OOM can still be a 500.
                async with engine.run(prompt_tokens + n) as factor:
                    return await generate(per_token * factor)
            except EngineOOM:
                record.fault = OOM
                return await self._fault_reply(send, OOM, faults)

        await self._guarded(receive, record, model, run)

    async def _stream(
        self,
        send: Send,
        writer: r.ChunkWriter,
        n: int,
        prompt_tokens: int,
        include_usage: bool,
        ttft: float,
        per_token: float,
        fault: str | None,
        faults: Faults,
        start: int = 0,
    ) -> str:
        # Headers go out as the request starts running, as from vLLM (a Starlette
        # StreamingResponse); tokens follow.
        await send(start_message(200, SSE, None, [(b"cache-control", b"no-cache")]))
        stop_after = faults.stall_after if fault in (STALL, STREAM_ERROR) else None
        cut = cut_point(n, faults.die_after if fault == DIE else stop_after)
        step = faults.tokens_per_event_n(self.config)
        pacer = Pacer(ttft, per_token)
        await pacer.first_token()
        if start and writer.chat:
            await send(body_message(writer.role(), more=True))  # as vLLM's first chunk
        await send_tokens(
            send, pacer, n, step, cut, lambda s, e: writer.tokens(start + s, start + e, e == n)
        )
        usage = writer.usage(prompt_tokens, n) if include_usage else None
        return await end_stream(send, fault, faults, usage)

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The Anthropic Messages API (anthropic.py)."""
        await handle_messages(self, scope, receive, send)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The Responses API (responses_api.py)."""
        await handle_responses(self, scope, receive, send)

    async def _audio(self, scope: Scope, receive: Receive, send: Send) -> None:
        await handle_audio(self, scope, receive, send)

    async def _json(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Tokenizer, pooling, score and rerank routes, and the echo route (extra_routes.py)."""
        await handle_json(self, scope, receive, send)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        record, body = await self._receive_logged(scope, receive)
        if body is None:
            return
        try:
            request = parse_object(body)
            model = self._model(request, record)
            inputs = _embedding_inputs(request.get("input"))
        except BadRequest as exc:
            await respond(send, exc.status, r.error_body(exc.status, exc.message))
            self.log.finish(record, "error")
            return
        faults = self.faults
        fault = faults.draw(self.rng, stream=False)
        record.fault = fault

        async def run() -> str:
            if fault is not None and fault != DIE:
                return await self._fault_reply(send, fault, faults)
            await pause(faults.ttft_s(self.config))
            full = r.embeddings_body(model, inputs)
            if fault == DIE:
                return await die_midway(send, full)
            await respond(send, 200, full)
            return "ok"

        await self._guarded(receive, record, model, run)

    async def _guarded(
        self,
        receive: Receive,
        record: RequestRecord,
        model: str,
        run: Callable[[], Awaitable[str]],
    ) -> None:
        """Run a generation while counting it as running and watching for the client leaving."""
        self.running[model] += 1
        guard = DisconnectGuard(receive)
        outcome = "error"
        try:
            outcome = await run()
        except asyncio.CancelledError:
            # The client left (the usual case) or the server's graceful shutdown ran out of time;
            # either way the task ends here, and returning spares uvicorn a traceback to log.
            guard.absorb()
            outcome = "cancelled"
        finally:
            guard.close()
            self.running[model] -= 1
            self.log.finish(record, outcome)
        if outcome == "ok":
            self.success[model] += 1

    async def _fault_reply(self, send: Send, fault: str, faults: Faults) -> str:
        """Answer for the faults decided before any token is generated."""
        if fault == RATE_LIMIT:
            retry = [(b"retry-after", str(faults.retry_after).encode())]
            await respond(send, 429, r.error_body(429, "rate limit exceeded"), extra=retry)
            return "rate_limited"
        if fault == ERROR:
            status = faults.error_status
            await respond(send, status, r.error_body(status, faults.error_message))
            return "error"
        if fault == OOM:
            self.oom_count += 1
            count = [(b"x-oom-count", str(self.oom_count).encode())]
            body = r.error_body(500, r.OOM_MESSAGE, "InternalServerError")
            await respond(send, 500, body, extra=count)
            return "oom"
        assert fault == HANG
        # No headers until the client gives up (the guard cancels this sleep) or hang_s passes.
        await asyncio.sleep(faults.hang_s)
        await respond(send, 504, r.error_body(504, f"hung for {faults.hang_s:g} s"))
        return "hung"

    def forced_fault(self, stream: bool) -> str | None:
        """A request's fault from the `die_next` / `error_next` counts (streams only), then
        from `refuse_next`, if any is left."""
        if stream and self.die_left > 0:
            self.die_left -= 1
            return DIE
        if stream and self.error_left > 0:
            self.error_left -= 1
            return STREAM_ERROR
        if self.refuse_left > 0:
            self.refuse_left -= 1
            return ERROR
        return None

    def _next_rid(self) -> str:
        self._seq += 1
        return f"{self._id_prefix}{self._seq:x}"

    async def _receive_logged(
        self, scope: Scope, receive: Receive
    ) -> tuple[RequestRecord, bytes | None]:
        """Log the request and read its body (None, logged as cancelled, if the client left)."""
        record = self._record(scope)
        body = await read_body(receive)
        if body is None:
            self.log.finish(record, "cancelled")
            return record, None
        record.body_sha256 = hashlib.sha256(body).hexdigest()
        return record, body

    def _record(self, scope: Scope) -> RequestRecord:
        return self.log.start(
            scope["method"],
            scope["path"],
            scope["query_string"].decode("latin-1"),
            scope["headers"],
        )

    def _model(self, request: dict[str, Any], record: RequestRecord) -> str:
        model = request.get("model")
        if model is None or model == "":
            model = self.config.models[0]  # vLLM's default: its first served model name
        if not isinstance(model, str):
            raise BadRequest(400, "'model' must be a string")
        record.model = model
        if model not in self.running:
            # vLLM's wording and status for an unknown model.
            raise BadRequest(404, f"The model `{model}` does not exist.")
        return model

    # --- plain endpoints -------------------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, self._models_body)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 503 if self.faults.unhealthy else 200
        await respond(send, status, b"", content_type=b"text/plain; charset=utf-8")

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.config.metrics:
            await respond(send, 404, b"Not Found", content_type=b"text/plain; charset=utf-8")
            return
        engine = self.engine
        if engine is None:
            body = r.metrics_text(self.config.models, self.running, self.success)
        else:
            # One engine serves every model, so each model's line shows the engine's figures.
            running = dict.fromkeys(self.config.models, engine.running)
            body = r.metrics_text(
                self.config.models,
                running,
                self.success,
                engine.waiting,
                engine.cache_usage,
                engine.kv_tokens,
            )
        await respond(send, 200, body, content_type=b"text/plain; version=0.0.4; charset=utf-8")

    # --- control endpoints -----------------------------------------------------------------

    async def _get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, r.dumps(self.faults.as_dict()))

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        if body is None:
            return
        try:
            patch = parse_object(body)
            self.faults = self.faults.merged(patch)
            if "die_next" in patch:
                self.die_left = self.faults.die_next
            if "error_next" in patch:
                self.error_left = self.faults.error_next
            if "refuse_next" in patch:
                self.refuse_left = self.faults.refuse_next
        except BadRequest as exc:
            await respond(send, exc.status, r.error_body(exc.status, exc.message))
            return
        except ValueError as exc:
            await respond(send, 400, r.error_body(400, str(exc)))
            return
        await respond(send, 200, r.dumps(self.faults.as_dict()))

    async def _reset(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Back to the start state, so each test sees the same random sequence.
        self.faults = Faults()
        self.rng = random.Random(self.config.seed)
        self.oom_count = 0
        self.die_left = 0
        self.error_left = 0
        if self.engine is not None:
            self.engine.reset()
        self.log.reset()
        await respond(send, 200, r.dumps(self.faults.as_dict()))

    async def _engine_state(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The engine's counters; `?waiting=N` first waits (up to `timeout` s) for N queued."""
        engine = self.engine
        if engine is None:
            await respond(send, 404, r.error_body(404, "no engine: start with --max-running etc."))
            return
        query = parse_qs(scope["query_string"].decode("latin-1"))
        try:
            waiting = int(query["waiting"][0]) if "waiting" in query else None
            timeout_s = float(query["timeout"][0]) if "timeout" in query else 10.0
        except ValueError:
            await respond(send, 400, r.error_body(400, "waiting and timeout must be numbers"))
            return
        if waiting is not None:
            await engine.wait_waiting(waiting, timeout_s)
        state = {
            "running": engine.running,
            "waiting": engine.waiting,
            "kv_used": engine.kv_used,
            "kv_tokens": engine.kv_tokens,
            "max_running": engine.max_running,
            "ooms": engine.ooms,
            "peak_running": engine.peak_running,
            "peak_waiting": engine.peak_waiting,
        }
        await respond(send, 200, r.dumps(state))

    async def _requests(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope["query_string"].decode("latin-1"))
        try:
            wait_for = int(query["wait_for"][0]) if "wait_for" in query else None
            timeout_s = float(query["timeout"][0]) if "timeout" in query else 10.0
        except ValueError:
            await respond(send, 400, r.error_body(400, "wait_for and timeout must be numbers"))
            return
        if wait_for is not None:
            await self.log.wait_ended(wait_for, timeout_s)
        await respond(send, 200, r.dumps(self.log.snapshot()))


def _max_tokens(request: dict[str, Any]) -> int:
    value = request.get("max_tokens")
    if value is None:
        value = request.get("max_completion_tokens")
    if value is None:
        return 16
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise BadRequest(400, f"max_tokens must be an integer between 1 and {MAX_TOKENS_LIMIT}")
    return value


def _embedding_inputs(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(isinstance(item, int) for item in value):
            return [" ".join(map(str, value))]  # one pre-tokenized input
        if all(isinstance(item, list) for item in value):
            return [" ".join(map(str, item)) for item in value]
    raise BadRequest(400, "'input' must be a string or a non-empty list")


def build_app(config: FakeConfig) -> FakeVllm:
    """The ASGI application for `config`; each call has its own faults, log and counters."""
    return FakeVllm(config)
