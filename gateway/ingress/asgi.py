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
from collections.abc import Callable
from typing import Any

from starlette.types import Scope

from gateway.config.models import LimitsPolicy
from gateway.config.routes import KNOWN_ROUTES, MODELS_PATH, Route, acts, route_for
from gateway.core.translate import Untranslatable
from gateway.errors import GatewayError, InvalidRequest, MethodNotAllowed, ModelNotFound, NotFound
from gateway.ingress.auth import OPEN_PATHS, ClientAuth, send_unauthorized
from gateway.ingress.body import ClientGone, Receive, read_body
from gateway.ingress.dialect import BY_PROTOCOL
from gateway.ingress.exchange import CLIENT_CLOSED, Exchange, log_refused, serve_traced
from gateway.ingress.fallback import Fallbacks, Handover
from gateway.ingress.form import read_request_facts
from gateway.ingress.forwarded import TrustedProxies
from gateway.ingress.headers import RequestHeaders, client_address, split_request_headers
from gateway.ingress.protocol import ConnectionLimits, HardenedProtocol
from gateway.ingress.refusals import UNAUTHORIZED, IngressRefusals
from gateway.ingress.relay import ResponseAborted, Send, relay, send_error, send_json
from gateway.ingress.resume import StreamResume, stream_resume
from gateway.ingress.streams import OpenStreams
from gateway.ingress.whole import WholeAnswer, fetch_as_stream
from gateway.ingress.writer import client_writer
from gateway.pipeline.call import Call, Handler, RequestFacts
from gateway.runtime import CLIENT_GONE, Cancellation
from gateway.telemetry.logs import AccessLog
from gateway.telemetry.tracing import Tracing
from gateway.upstream.pool import PoolState
from gateway.upstream.registry import Registry
from gateway.upstream.response import Owned, UpstreamResponse
from gateway.upstream.translated import NotTranslated, Translated, translation_for

log = logging.getLogger("gateway.ingress")


# Most requests finish within milliseconds: a timer is cheaper than a task, so only a request
# still running after this long gets a task that waits for its client to disconnect.
WATCH_AFTER_S = 0.02


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


def _model_listing(
    by_model: dict[str, PoolState],
) -> tuple[bytes, dict[str, bytes], tuple[PoolState, str] | None]:
    """`GET /v1/models` encoded, each model's own answer, and the pool a request naming no
    model goes to (the only one, with its first model; None with several)."""
    models = [
        {"id": model, "object": "model", "created": 0, "owned_by": pool.name}
        for model, pool in by_model.items()
    ]
    listing = json.dumps({"object": "list", "data": models}, separators=(",", ":")).encode()
    bodies = {
        str(model["id"]): json.dumps(model, separators=(",", ":")).encode() for model in models
    }
    pools: dict[int, tuple[PoolState, str]] = {}
    for model, pool in by_model.items():
        pools.setdefault(id(pool), (pool, model))  # its first model
    return listing, bodies, next(iter(pools.values())) if len(pools) == 1 else None


def _translation(route: Route, pool: PoolState, facts: RequestFacts) -> Translated | None:
    """How a request reaches its pool when the pool states its API family (`api`): None
    when as it is; an error the client is told when it cannot be translated there."""
    try:
        return translation_for(route, pool.policy.api, facts.request, facts.model)
    except Untranslatable as refused:
        raise InvalidRequest(
            f"pool {pool.name!r} speaks the {pool.policy.api} API, which cannot express this "
            f"request ({refused.reason})"
        ) from None
    except NotTranslated as refused:
        raise NotFound(f"{refused}: pool {pool.name!r} speaks the {pool.policy.api} API") from None


async def _answer_or_fall_back(
    fallbacks: Fallbacks, exchange: Exchange, handler: Handler
) -> UpstreamResponse:
    """The answer of the request's pool or, when it cannot answer, of a fallback's: the
    exchange goes on with the call that got it."""
    handover = Handover(exchange.call)
    try:
        return await fallbacks.answer(handover, handler)
    finally:
        exchange.handed_over(handover)


class DataPlane:
    """The data plane's ASGI app: the proxied routes (`_proxy`, step by step), the gateway's
    own small answers (`/v1/models`, `/healthz`, `/readyz`), and the refusals before a route."""

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
        self._fallbacks = Fallbacks(registry.pools, self._loop.time, tracing is not None)
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
        self._models_body, self._model_bodies, self._only = _model_listing(self._by_model)

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
                assert self._tracing is not None
                await serve_traced(
                    self._tracing, self._tracer, self._proxy, scope, receive, send, route
                )
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
        client = client_address(scope, self._trusted)
        self.refusals.count(UNAUTHORIZED, client)
        self._rejected(scope, path, 401, started, None, client)

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
            duration_s = self._loop.time() - started
            log_refused(self._access, scope, path, status, duration_s, model, client_address)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        """A request to proxy, step by step (`gateway.request_path`): its body read and
        checked, its pool, its deadline and priority, its `Call`; then the pipeline, the
        relay of its answer, and what it leaves behind (`Exchange.end`)."""
        started = self._loop.time()
        request = await self._read_request(scope, receive, send, route, started)
        if request is None:
            return
        headers, body, facts = request
        address = headers.client
        try:
            pool, facts = self._route(route, facts)
            # Handed over to another pool if its own cannot answer (`ingress.fallback`).
            fallback = bool(pool.policy.fallbacks or pool.policy.context_fallbacks)
            if fallback:
                fallback = headers.fallback_allowed()
            call, whole = self._call(scope, route, headers, body, facts, pool, fallback)
        except GatewayError as refused:  # logged with the model it names, if any
            await self._reject(scope, send, route, refused, started, facts.model or None, address)
            return
        exchange = Exchange(call, facts, started, address, self._loop.time)
        watch = _DisconnectWatch(self._loop, call.cancellation, receive)
        try:
            try:
                if fallback:
                    response = await _answer_or_fall_back(self._fallbacks, exchange, self._handler)
                else:
                    response = await self._handler(call)
            except GatewayError as error:
                exchange.status = error.status
                dialect = BY_PROTOCOL[route.protocol]
                attempts = exchange.prior_attempts + exchange.call.attempts
                await send_error(send, error, attempts, dialect, exchange.routed)
                return
            exchange.answered = response
            await self._relay(scope, send, exchange, response, whole)
        except ResponseAborted as aborted:
            exchange.stream_error = aborted.error.message  # cut: the client saw it end short
            # uvicorn drops the connection of a response left incomplete: the client sees it.
            fields = {
                "pool": exchange.call.pool.name,
                "instance": response.instance.name,
                "error": aborted.error.message,
            }
            log.warning("response aborted after the commit point", extra={"fields": fields})
        except asyncio.CancelledError:
            if call.cancellation.consume(CLIENT_GONE):
                exchange.client_left = True
                return
            raise
        finally:
            watch.close()
            exchange.end(self._access, self._tracer is not None)

    async def _read_request(
        self, scope: Scope, receive: Receive, send: Send, route: Route, started: float
    ) -> tuple[RequestHeaders, bytes, RequestFacts] | None:
        """The request's headers, its body (within its cap) and what routing needs of it; None
        when it was refused (answered and logged) or its client left meanwhile."""
        client = scope.get("client")
        try:
            headers = split_request_headers(
                scope["headers"], client[0] if client else None, scope["scheme"], self._trusted
            )
            body = await read_body(receive, self._limit, headers.content_length)
            facts = read_request_facts(scope["headers"], body, strict=route.kind != "other")
        except ClientGone:
            self._rejected(scope, route.path, CLIENT_CLOSED, started, None, headers.client)
            return None
        except ValueError as exc:
            await self._reject(scope, send, route, InvalidRequest(str(exc)), started, None)
            return None
        except GatewayError as error:
            await self._reject(scope, send, route, error, started, None, headers.client)
            return None
        return headers, body, facts

    def _route(self, route: Route, facts: RequestFacts) -> tuple[PoolState, RequestFacts]:
        """The pool the request goes to, by the model it names, and its facts (the model
        filled in when it named none); a GatewayError when it goes nowhere."""
        if facts.model:
            pool = self._by_model.get(facts.model)
        elif self._only is not None and route.kind != "other":
            # Named no model on one of vLLM's routes: the only pool's engine answers with its
            # default, as going direct would (its first model is the pool's name for it in
            # metrics and logs).
            pool, model = self._only
            facts = dataclasses.replace(facts, model=model)
        else:
            raise InvalidRequest("the request names no model; GET /v1/models lists them")
        if pool is None:
            raise ModelNotFound(f"the model {facts.model!r} does not exist")
        if route.kind == "other" and pool.policy.credentials is not None:
            # The operator's own key is spent only on what the gateway knows it does.
            path = route.path
            raise NotFound(f"{path} is not proxied to pool {pool.name!r}, which has credentials")
        return pool, facts

    def _call(
        self,
        scope: Scope,
        route: Route,
        headers: RequestHeaders,
        body: bytes,
        facts: RequestFacts,
        pool: PoolState,
        fallback: bool,
    ) -> tuple[Call, bool]:
        """The request as the pipeline takes it: its deadline (the pool's ceiling from now, or
        less when the client asks) and priority (`RequestHeaders.terms`: InvalidRequest when
        they cannot be read); and whether it is a whole answer fetched as a stream (so that a
        cut is continued)."""
        budget_s, priority = headers.terms(pool.policy.timeouts.ceiling)
        fetched = None
        if not facts.stream and self._resume_handler is not None:
            fetched = fetch_as_stream(route.path, facts, pool.policy.resume, body)
        if fetched is not None:
            body, sent = fetched
        else:
            sent = facts
        translation = None
        if pool.policy.api is not None:  # a pool of the other API family: translated
            translation = _translation(route, pool, sent)
            body = body if translation is None else translation.body
        query = scope["query_string"]
        task = asyncio.current_task(self._loop)
        assert task is not None
        call = Call(
            pool=pool,
            route=route,
            query=query.decode("latin-1") if query else "",
            body=body,
            headers=headers.forward,
            facts=sent,
            deadline=self._loop.time() + budget_s,
            cancellation=Cancellation(task),
            acts=acts(route, facts.request),
            priority=priority,
            handover=fallback,
            translation=translation,
        )
        return call, fetched is not None

    async def _relay(
        self, scope: Scope, send: Send, exchange: Exchange, response: UpstreamResponse, whole: bool
    ) -> None:
        """The answer relayed to the client as it comes, or, for a whole answer fetched as a
        stream (`whole`), into one JSON answer sent at its end. The response is finished when
        the relay ends, before a whole answer goes out."""
        call = exchange.call
        timeouts = call.attempt.timeouts
        assert timeouts is not None, "the deadline layer sets every attempt's timeouts"
        # A non-streamed body that still comes in pieces may pause as long as its first byte.
        idle_s = timeouts.idle_s or timeouts.first_byte_s
        dialect = BY_PROTOCOL[call.route.protocol]
        answer: WholeAnswer | None = None
        resume: StreamResume | None = None
        with Owned(response) as current:
            if response.is_sse and response.status == 200 and self._resume_handler is not None:
                if whole:
                    answer = WholeAnswer(send, call.route.path)
                resume = exchange.resume = stream_resume(
                    call,
                    self._resume_handler,
                    self._loop.time,
                    self._tracer is not None,
                    answer.restart if answer is not None else None,
                    self._fallbacks.continuation if exchange.handover is not None else None,
                )
            if answer is None:
                exchange.first_byte(response.status)  # sent now
            broke = await relay(
                send if answer is None else answer,
                current,
                exchange.prior_attempts + call.attempts,
                exchange.routed,
                idle_s,
                call.deadline,
                dialect,
                self.streams,
                call.cancellation,
                resume,
                answer if answer is not None else client_writer(scope) if response.is_sse else None,
            )
        if answer is not None:
            assert resume is not None
            ended_on = resume.instance or response.instance
            status = await answer.finish(
                broke,
                exchange.prior_attempts + call.attempts + resume.attempts,
                ended_on.name_header,
                dialect,
                exchange.routed,
            )
            exchange.first_byte(status)  # a whole answer's status comes with its end
        elif broke is not None:
            exchange.stream_error = broke.message
