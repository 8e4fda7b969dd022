"""The data plane: a pure ASGI app (no framework on the hot path).

Parses just enough of a request to route it (size limit, JSON, `model`), hands it to the
pipeline, and relays the answer. While the pipeline and the relay run, a watcher notices a
client that disconnects and cancels the work, which closes the upstream request at once
(vLLM then aborts the generation instead of computing for nobody).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from starlette.types import Message, Scope

from gateway.config.models import LimitsPolicy
from gateway.config.routes import (
    KNOWN_ROUTES,
    MODELS_PATH,
    Route,
    acts,
    genai_attributes,
    route_for,
)
from gateway.core.continuation import Transcript
from gateway.core.usage import model_of, usage_of
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    UpstreamProtocolError,
)
from gateway.ingress.auth import OPEN_PATHS, ClientAuth, send_unauthorized
from gateway.ingress.body import ClientGone, Receive, read_body, read_facts
from gateway.ingress.dialect import BY_PROTOCOL
from gateway.ingress.form import is_form, read_form_facts
from gateway.ingress.forwarded import TrustedProxies
from gateway.ingress.headers import split_request_headers
from gateway.ingress.protocol import ConnectionLimits, HardenedProtocol
from gateway.ingress.refusals import UNAUTHORIZED, IngressRefusals
from gateway.ingress.relay import ResponseAborted, Send, relay, send_error, send_json
from gateway.ingress.resume import Restart, StreamResume, transcript_for
from gateway.ingress.streams import OpenStreams
from gateway.ingress.whole import WholeAnswer, fetch_as_stream
from gateway.ingress.writer import client_writer
from gateway.pipeline.admit import parse_priority
from gateway.pipeline.attempt_span import answer_attributes, read_answer
from gateway.pipeline.call import Call, Handler, RequestFacts
from gateway.runtime import CLIENT_GONE, Cancellation
from gateway.telemetry.logs import AccessLog
from gateway.telemetry.tracing import Tracing
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.registry import Registry
from gateway.upstream.response import UpstreamResponse

log = logging.getLogger("gateway.ingress")


# Most requests finish within milliseconds: a timer is cheaper than a task, so only a request
# still running after this long gets a task that waits for its client to disconnect.
WATCH_AFTER_S = 0.02


def _positive_seconds(raw: bytes) -> float:
    value = float(raw)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(raw)
    return value


class _DisconnectWatch:
    """Cancels a request's task when its client goes away (closing the upstream request)."""

    __slots__ = ("_cancellation", "_handle", "_loop", "_receive", "_watcher", "done")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, cancellation: Cancellation, receive: Receive
    ) -> None:
        self._loop = loop
        self._cancellation = cancellation
        self._receive = receive
        self._watcher: asyncio.Task[None] | None = None
        self.done = False
        self._handle: asyncio.TimerHandle | None = loop.call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._handle = None
        if not self.done:
            self._watcher = self._loop.create_task(self._watch())

    async def _watch(self) -> None:
        try:
            while (await self._receive())["type"] != "http.disconnect":
                pass
        except asyncio.CancelledError:
            # Closed: the request is over. Ended here rather than cancelled, the task keeps
            # no CancelledError, whose traceback would hold this frame, this watch and the
            # task in a cycle with the request's state: garbage only a full collection frees,
            # which under load piles up to gigabytes and then stops the process for seconds.
            return
        if not self.done:
            self._cancellation.cancel(CLIENT_GONE)

    def close(self) -> None:
        self.done = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()


# What a request that ended because its client left counts as (nginx's 499).
CLIENT_CLOSED = 499


class DataPlane:
    def __init__(
        self,
        registry: Registry,
        handler: Handler,
        *,
        auth: ClientAuth,
        access_log: AccessLog | None = None,
        max_request_bytes: int,
        readiness: Callable[[], tuple[bool, dict[str, Any]]],
        tracing: Tracing | None = None,
        limits: LimitsPolicy | None = None,
        resume_handler: Handler | None = None,
    ) -> None:
        # The connection-level limits (deadlines, header caps...) are the HTTP protocol's:
        # `protocol` is the class uvicorn serves this app's connections with
        # (`server._uvicorn_config`); trusted_proxies and the body cap are ours. So are the
        # refusal counters it shares with us (401s), for /metrics and /admin/state.
        self.limits = limits or LimitsPolicy(max_request_bytes=max_request_bytes)
        self.refusals = IngressRefusals("data")
        self.streams = OpenStreams()  # the SSE streams being relayed, for the drain
        self.connection_limits = ConnectionLimits(self.limits)
        self.protocol = HardenedProtocol.configured(self.connection_limits, self.refusals)
        self._trusted = TrustedProxies(self.limits.trusted_proxies) or None
        self._by_model = registry.by_model
        self._auth = auth  # client API keys (policy `auth`); swapped on reload
        self._tracer = tracing.tracer if tracing is not None else None
        self._tracing = tracing
        self._access = access_log  # None: off
        self._handler = handler
        # The request path below admission, for a broken stream's continuation (None: off).
        self._resume_handler = resume_handler
        self._limit = max_request_bytes
        self._readiness = readiness
        self._loop = asyncio.get_running_loop()
        self._models_body = b""
        self._model_bodies: dict[str, bytes] = {}
        # The pool a request naming no model goes to: the only one, else None.
        self._only: tuple[PoolState, str] | None = None
        self.refresh_models()

    def set_limits(self, limits: LimitsPolicy) -> None:
        """A reload's `limits`. Requests read these attributes as they always do (no cost on
        the hot path): a request that has not read its body yet gets the new cap; the
        connections' limits are one object, changed in place for every connection."""
        self.limits = limits
        self._trusted = TrustedProxies(limits.trusted_proxies) or None
        self._limit = limits.max_request_bytes
        self.connection_limits.update(limits)

    def set_access_log(self, access: AccessLog | None) -> None:
        """A reload turned the access log on or off: requests that end from now on follow."""
        self._access = access

    def refresh_models(self) -> None:
        """Encode `GET /v1/models` (every pool's models) and each `GET /v1/models/{model}` once
        per policy (again after a reload), not per request."""
        models = [
            {"id": model, "object": "model", "created": 0, "owned_by": pool.name}
            for model, pool in self._by_model.items()
        ]
        self._models_body = json.dumps(
            {"object": "list", "data": models}, separators=(",", ":")
        ).encode()
        self._model_bodies = {
            str(model["id"]): json.dumps(model, separators=(",", ":")).encode() for model in models
        }
        pools: dict[int, tuple[PoolState, str]] = {}
        for model, pool in self._by_model.items():
            pools.setdefault(id(pool), (pool, model))  # its first model
        self._only = next(iter(pools.values())) if len(pools) == 1 else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no websockets; lifespan is handled by the process, not the app
        path = scope["path"]
        method = scope["method"]
        auth = self._auth
        if auth.enabled and path not in OPEN_PATHS and not auth.allows(scope["headers"]):
            await self._unauthorized(scope, send, path)
            return
        route = KNOWN_ROUTES.get(path) or route_for(path)
        if route is not None:
            if method != "POST":
                dialect = BY_PROTOCOL[route.protocol]
                if route.kind == "other":
                    unknown = NotFound(f"no route for {method} {path}: POST requests are proxied")
                    await send_error(send, unknown, dialect=dialect)
                    return
                not_post = MethodNotAllowed(f"{path} accepts POST only", allow="POST")
                await send_error(send, not_post, dialect=dialect)
                return
            if self._tracer is None:
                await self._proxy(scope, receive, send, route)
            else:
                await self._proxy_traced(self._tracer, scope, receive, send, route)
        elif path == MODELS_PATH:
            await self._get(method, send, self._models_body)
        elif path.startswith(MODELS_PATH + "/"):
            body = self._model_bodies.get(path[len(MODELS_PATH) + 1 :])
            if body is None:
                unknown_model = ModelNotFound(
                    f"the model {path[len(MODELS_PATH) + 1 :]!r} does not exist"
                )
                await send_error(send, unknown_model)
                return
            await self._get(method, send, body)
        elif path == "/healthz":
            await self._get(method, send, b'{"status":"ok"}')
        elif path == "/readyz":
            if method != "GET":
                await send_error(send, MethodNotAllowed("use GET", allow="GET, HEAD"))
                return
            ready, detail = self._readiness()
            await send_json(send, 200 if ready else 503, json.dumps(detail).encode())
        else:
            await send_error(send, NotFound(f"no route for {path}"))

    async def _unauthorized(self, scope: Scope, send: Send, path: str) -> None:
        """The 401: counted and access-logged like any refused request (never the key)."""
        started = self._loop.time()
        await send_unauthorized(send, path)
        client = self._client_address(scope)
        self.refusals.count(UNAUTHORIZED, client)
        self._rejected(scope, path, 401, started, None, client)

    def _client_address(self, scope: Scope) -> str | None:
        """The client's address as the access log gives it (the peer, or what a trusted
        proxy's X-Forwarded-For says), found as for a proxied request."""
        peer = scope.get("client")
        host: str | None = peer[0] if peer else None
        try:
            headers = split_request_headers(scope["headers"], host, scope["scheme"], self._trusted)
        except ValueError:  # an invalid Content-Length: the peer, then
            return host
        return headers.client

    async def _get(self, method: str, send: Send, body: bytes) -> None:
        if method in ("GET", "HEAD"):
            await send_json(send, 200, body)
        else:
            await send_error(send, MethodNotAllowed("use GET", allow="GET, HEAD"))

    async def _reject(
        self,
        scope: Scope,
        send: Send,
        route: Route,
        error: GatewayError,
        started: float,
        model: str | None,
        client_address: str | None = None,
    ) -> None:
        """Answer a request the gateway refuses before routing it (400, 404, 413...)."""
        await send_error(send, error, dialect=BY_PROTOCOL[route.protocol])
        self._rejected(scope, route.path, error.status, started, model, client_address)

    def _rejected(
        self,
        scope: Scope,
        path: str,
        status: int,
        started: float,
        model: str | None,
        client_address: str | None = None,
    ) -> None:
        if self._access is not None:
            client = (client_address,) if client_address else scope.get("client")
            fields = {
                "method": scope["method"],
                "path": path,
                "status": status,
                "model": model,  # a client's string: escaped by the formatter
                "duration_s": self._loop.time() - started,
                "client": client[0] if client else None,
            }
            self._access.write(fields)

    def _log_access(
        self,
        scope: Scope,
        path: str,
        status: int,
        started: float,
        facts: RequestFacts,
        pool: str,
        call: Call,
        ttfb_s: float | None,
        client: str | None,
        stream_error: str | None = None,
        resume: StreamResume | None = None,
    ) -> None:
        fields: dict[str, object] = {
            "method": "POST",
            "path": path,
            "status": status,
            "pool": pool,
            "model": facts.model,
            "instance": _instance_name(call, resume),
            "attempts": call.attempts + (resume.attempts if resume is not None else 0),
            "streamed": facts.stream,
            "duration_s": self._loop.time() - started,
            "ttfb_s": ttfb_s,
            "client": client,
        }
        if stream_error is not None:
            # The status went out with the first byte; what ended the stream did not.
            fields["stream_error"] = stream_error
        if resume is not None and resume.resumes:
            # Headers (x-gateway-attempts) went out before: the log tells of the resumes.
            fields["resumes"] = resume.resumes
            fields["resumed_on"] = resume.reasons
        if self._tracer is not None:
            span_context = trace.get_current_span().get_span_context()
            if span_context.is_valid:
                fields["trace_id"] = format(span_context.trace_id, "032x")
        assert self._access is not None
        self._access.write(fields)

    def _resumable(self, call: Call, whole: WholeAnswer | None) -> StreamResume:
        """A stream's resume: its transcript (or why it has none), and how a continuation is
        sent: the same request with the continuation's body, through the layers below
        admission, avoiding the instances that broke it. For a whole answer (`whole`), also
        how it starts again from nothing when it cannot be continued."""
        pool = call.pool
        policy = pool.policy.resume
        request = call.facts.request
        path = call.path
        transcript, refusal = transcript_for(path, request, policy)
        handler = self._resume_handler
        assert handler is not None
        traced = self._tracer is not None

        left: list[InstanceState] = []  # the instances that broke this stream so far

        async def start(
            resume: StreamResume, body: bytes, broken: InstanceState
        ) -> tuple[UpstreamResponse, float]:
            left.append(broken)
            continued = call.for_continuation(body, left)
            if traced:
                trace.get_current_span().add_event(
                    "stream resumed",
                    {
                        "gateway.resume.reason": resume.reasons[-1],
                        "gateway.resume.from_instance": broken.name,
                        "gateway.resume.count": resume.resumes,
                    },
                )
            try:
                response = await handler(continued)
            finally:
                resume.attempts += continued.attempts
                if continued.attempt.instance is not None:
                    resume.instance = continued.attempt.instance
            if response.status != 200 or not response.is_sse:
                # The engine refused the continuation (an engine that does not continue a
                # final message answers 400): the stream ends as it would have.
                response.finish(ok=response.body is not None)
                pool.stats.not_resumed("refused")
                raise UpstreamProtocolError(
                    f"the continuation was answered with HTTP {response.status}"
                )
            timeouts = continued.attempt.timeouts
            assert timeouts is not None
            return response, timeouts.idle_s or timeouts.first_byte_s

        restart = None
        if whole is not None:

            def fresh() -> Transcript | None:
                return transcript_for(path, request, policy)[0]

            restart = Restart(call.body, fresh, whole.restart)
        resume = StreamResume(
            transcript, refusal, policy, pool, start, self._loop.time, call.deadline, restart
        )
        return resume

    async def _proxy_traced(
        self, tracer: Tracer, scope: Scope, receive: Receive, send: Send, route: Route
    ) -> None:
        """`_proxy` inside the request's SERVER span, which stays current for the layers (their
        events land on it) and ends with the response's last byte."""
        assert self._tracing is not None
        parent = self._tracing.extract(scope["headers"])
        client = scope.get("client")
        attributes: dict[str, str | int] = {
            "http.request.method": "POST",
            "http.route": route.template,
            "url.path": route.path,
            "url.scheme": scope["scheme"],
            **genai_attributes(route),
        }
        if client:
            attributes["client.address"] = client[0]
        span = tracer.start_span(
            f"POST {route.template}", context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        status = 0

        async def send_traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._proxy(scope, receive, send_traced, route)
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500 or status == 0:
                span.set_status(
                    Status(StatusCode.ERROR, f"HTTP {status}" if status else "no answer")
                )
            otel_context.detach(token)
            span.end()

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        started = self._loop.time()
        client = scope.get("client")
        path = route.path
        try:
            headers = split_request_headers(
                scope["headers"], client[0] if client else None, scope["scheme"], self._trusted
            )
            body = await read_body(receive, self._limit, headers.content_length)
            facts = _read_facts(scope, body, strict=route.kind != "other")
        except ClientGone:
            self._rejected(scope, path, CLIENT_CLOSED, started, None, headers.client)
            return
        except ValueError as exc:
            await self._reject(scope, send, route, InvalidRequest(str(exc)), started, None)
            return
        except GatewayError as error:
            await self._reject(scope, send, route, error, started, None, headers.client)
            return
        address = headers.client
        if facts.model:
            pool = self._by_model.get(facts.model)
        elif self._only is not None and route.kind != "other":
            # Named no model on one of vLLM's routes: the only pool's engine answers with its
            # default, as going direct would (its first model is the pool's name for it in
            # metrics and logs).
            pool, model = self._only
            facts = dataclasses.replace(facts, model=model)
        else:
            unnamed = InvalidRequest("the request names no model; GET /v1/models lists them")
            await self._reject(scope, send, route, unnamed, started, None, address)
            return
        if pool is None:
            unknown = ModelNotFound(f"the model {facts.model!r} does not exist")
            await self._reject(scope, send, route, unknown, started, facts.model, address)
            return
        if route.kind == "other" and pool.policy.credentials is not None:
            # The operator's own key is spent only on what the gateway knows it does.
            kept = NotFound(f"{path} is not proxied to pool {pool.name!r}, which has credentials")
            await self._reject(scope, send, route, kept, started, facts.model, address)
            return
        budget_s = pool.policy.timeouts.ceiling
        client_budget = headers.gateway.get(b"x-gateway-timeout")
        if client_budget is not None:
            try:
                budget_s = min(budget_s, _positive_seconds(client_budget))
            except ValueError:
                bad = InvalidRequest("x-gateway-timeout must be a positive number of seconds")
                await self._reject(scope, send, route, bad, started, facts.model, address)
                return
        try:
            priority = parse_priority(headers.gateway.get(b"x-gateway-priority"))
        except ValueError as exc:
            bad = InvalidRequest(str(exc))
            await self._reject(scope, send, route, bad, started, facts.model, address)
            return
        # A whole answer fetched as a stream, so a cut is continued (None: sent as it came).
        fetched = None
        if not facts.stream and self._resume_handler is not None:
            fetched = fetch_as_stream(path, facts, pool.policy.resume, body)
        query = scope["query_string"]
        task = asyncio.current_task(self._loop)
        assert task is not None
        cancellation = Cancellation(task)
        call = Call(
            pool=pool,
            route=route,
            query=query.decode("latin-1") if query else "",
            body=body if fetched is None else fetched[0],
            headers=headers.forward,
            facts=facts if fetched is None else fetched[1],
            deadline=self._loop.time() + budget_s,
            cancellation=cancellation,
            acts=acts(route, facts.request),
            priority=priority,
        )
        dialect = BY_PROTOCOL[route.protocol]
        watch = _DisconnectWatch(self._loop, cancellation, receive)
        stats = pool.stats
        status = CLIENT_CLOSED
        ttfb_s: float | None = None
        stream_error: str | None = None  # what cut a stream short after its first byte
        resume: StreamResume | None = None
        answered: UpstreamResponse | None = None  # the answer, for the span's GenAI attributes
        try:
            try:
                response = await self._handler(call)
                answered = response
            except GatewayError as error:
                status = error.status
                await send_error(send, error, call.attempts, dialect)
                return
            timeouts = call.attempt.timeouts
            assert timeouts is not None, "the deadline layer sets every attempt's timeouts"
            # A non-streamed body that still comes in pieces may pause as long as its first byte.
            idle_s = timeouts.idle_s or timeouts.first_byte_s
            whole: WholeAnswer | None = None
            if response.is_sse and response.status == 200 and self._resume_handler is not None:
                if fetched is not None:
                    whole = WholeAnswer(send, path)
                resume = self._resumable(call, whole)
            if whole is None:
                status = response.status  # sent now (a whole answer's comes with its end)
                ttfb_s = self._loop.time() - started
                stats.ttfb[facts.model].observe(ttfb_s)
            broke = await relay(
                send if whole is None else whole,
                response,
                call.attempts,
                idle_s,
                call.deadline,
                dialect,
                self.streams,
                cancellation,
                resume,
                whole if whole is not None else client_writer(scope) if response.is_sse else None,
            )
            if whole is not None:
                assert resume is not None
                ended_on = resume.instance or response.instance
                status = await whole.finish(
                    broke, call.attempts + resume.attempts, ended_on.name_header, dialect
                )
                ttfb_s = self._loop.time() - started
                stats.ttfb[facts.model].observe(ttfb_s)
            elif broke is not None:
                stream_error = broke.message
        except ResponseAborted as aborted:
            stream_error = aborted.error.message  # cut: the client saw it end short
            # uvicorn drops the connection of a response left incomplete: the client sees it.
            fields = {
                "pool": pool.name,
                "instance": response.instance.name,
                "error": aborted.error.message,
            }
            log.warning("response aborted after the commit point", extra={"fields": fields})
        except asyncio.CancelledError:
            if cancellation.consume(CLIENT_GONE):
                return
            raise
        finally:
            watch.close()
            stats.request(facts.model, status, self._loop.time() - started)
            told = None  # (model, usage) of the one answer the client got whole
            if answered is not None and status == 200 and stream_error is None:
                if resume is not None and resume.resumes > 0:
                    # Continued after a break: the usage the client was told (the rewritten
                    # one, every attempt's tokens) at the end of what it got; not timed per
                    # token, its pace being two instances'.
                    head = answered.first_chunk
                    told = model_of(head), usage_of(resume.told, head, route.protocol)
                    stats.count_usage(facts.model, told[1], None)
                else:
                    told = read_answer(answered, route.protocol)
                    streamed = answered.body is None
                    spent = answered.last_at - answered.first_at if streamed else None
                    stats.count_usage(facts.model, told[1], spent)
            if self._access is not None:
                self._log_access(
                    scope,
                    path,
                    status,
                    started,
                    facts,
                    pool.name,
                    call,
                    ttfb_s,
                    address,
                    stream_error,
                    resume,
                )
            if self._tracer is not None:
                span = trace.get_current_span()
                span.set_attribute("gen_ai.request.model", facts.model)
                if told is not None:
                    span.set_attributes(answer_attributes(*told))
                if status >= 500:
                    span.set_attribute("error.type", str(status))
                elif stream_error is not None:
                    span.set_attribute("error.type", "stream_cut")
                    span.set_status(Status(StatusCode.ERROR, "the stream was cut short"))
                span.set_attributes(
                    {
                        "gateway.pool": pool.name,
                        "gateway.attempts": call.attempts
                        + (resume.attempts if resume is not None else 0),
                        "gateway.streamed": bool(facts.stream),
                    }
                )
                instance = _instance_name(call, resume)
                if instance is not None:
                    span.set_attribute("gateway.instance", instance)
                if resume is not None and resume.resumes:
                    span.set_attribute("gateway.resumes", resume.resumes)
                if ttfb_s is not None:
                    span.set_attribute("gateway.time_to_first_byte_s", ttfb_s)
                if status == CLIENT_CLOSED:
                    span.add_event("client disconnected")


def _read_facts(scope: Scope, body: bytes, strict: bool) -> RequestFacts:
    """What routing needs from the body: a JSON object's fields, or a multipart form's
    (`strict`: see `read_facts`)."""
    if body[:1] != b"{":  # not the usual JSON object: a form, or JSON after blanks (or neither)
        for name, value in scope["headers"]:
            if name == b"content-type":
                if is_form(value):
                    return read_form_facts(body, value)
                break
    return read_facts(body, strict)


def _instance_name(call: Call, resume: StreamResume | None) -> str | None:
    """The instance that served the end of the answer."""
    if resume is not None and resume.instance is not None:
        return resume.instance.name
    instance = call.attempt.instance
    return instance.name if instance is not None else None
