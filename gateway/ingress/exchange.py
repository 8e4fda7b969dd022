"""What a proxied request leaves behind when it ends: the pool's counts (its status, duration
and usage), its line in the access log, and the attributes of its span (which it runs in,
tracing on: `serve_traced`). A request refused before it was routed leaves its access-log line
too (`log_refused`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from starlette.types import Message, Scope

from gateway.config.routes import Route, genai_attributes
from gateway.core.usage import Usage, model_of, usage_of
from gateway.ingress.body import Receive
from gateway.ingress.fallback import Handover
from gateway.ingress.relay import Send
from gateway.ingress.resume import StreamResume
from gateway.pipeline.attempt_span import answer_attributes, read_answer
from gateway.pipeline.call import Call, RequestFacts
from gateway.runtime import Clock
from gateway.telemetry.logs import AccessLog
from gateway.telemetry.tracing import Tracing
from gateway.upstream.response import UpstreamResponse

# What a request that ended because its client left counts as (nginx's 499).
CLIENT_CLOSED = 499


class Exchange:
    """One proxied request from its call on: what became of it, as the data plane learns it
    (the status sent, when its first byte went out, what cut its stream short, its resumes,
    the answer relayed), and what it leaves behind when it ends (`end`).

    Until something else is learned, it ended because its client left (`CLIENT_CLOSED`)."""

    __slots__ = (
        "_clock",
        "answered",
        "call",
        "client",
        "client_left",
        "facts",
        "handover",
        "prior_attempts",
        "resume",
        "routed",
        "started",
        "status",
        "stream_error",
        "ttfb_s",
    )

    def __init__(
        self, call: Call, facts: RequestFacts, started: float, client: str | None, clock: Clock
    ) -> None:
        self._clock = clock
        self.call = call
        # The request as its client sent it (a whole answer fetched as a stream is sent
        # upstream as `call.facts`, but its client asked for no stream).
        self.facts = facts
        self.started = started  # event-loop time its first byte came in
        self.client = client  # the client's address as the access log gives it
        self.status = CLIENT_CLOSED
        self.ttfb_s: float | None = None
        self.stream_error: str | None = None  # what cut a stream short after its first byte
        # Its client went away (`CLIENT_CLOSED` if before the first byte; after it, the
        # status sent stays, as in Envoy's access log with its DC flag, and this tells it).
        self.client_left = False
        self.resume: StreamResume | None = None
        self.answered: UpstreamResponse | None = None  # the answer, for its usage
        # Its way through fallback pools (`ingress.fallback`), when its pool has any: the
        # attempts made on pools other than the one that answered, and the headers naming
        # that one and how many others were tried (`x-gateway-pool`, `x-gateway-fallbacks`:
        # sent only for a request that could be handed over, as each header costs every
        # answer its encoding).
        self.handover: Handover | None = None
        self.prior_attempts = 0
        self.routed: tuple[tuple[bytes, bytes], ...] = ()

    def handed_over(self, handover: Handover) -> None:
        """Its answer came from `handover.answering`'s pool: the call relayed from now on."""
        self.handover = handover
        call = self.call = handover.answering
        self.prior_attempts = handover.attempts - call.attempts
        self.routed = (
            (b"x-gateway-pool", call.pool.name_header),
            (b"x-gateway-fallbacks", str(handover.hops).encode()),
        )

    def first_byte(self, status: int) -> None:
        """The answer's status went out, with its first byte: when, counted per model."""
        self.status = status
        self.ttfb_s = ttfb_s = self._clock() - self.started
        call = self.call
        call.pool.stats.ttfb[call.facts.model].observe(ttfb_s)

    def end(self, access: AccessLog | None, traced: bool) -> None:
        """The request is over: counted in its pool's stats, written to the access log
        (`access`, None: off), and told on its span (`traced`: the current one)."""
        call = self.call
        model = call.facts.model  # its pool's: a fallback's when one answered
        stats = call.pool.stats
        status = self.status
        stats.request(model, status, self._clock() - self.started)
        told = None  # (model, usage) of the one answer the client got whole
        answered, resume = self.answered, self.resume
        if (
            answered is not None
            and status == 200
            and self.stream_error is None
            and not self.client_left
        ):
            if resume is not None and resume.resumes > 0:
                # Continued after a break: the usage the client was told (the rewritten one,
                # every attempt's tokens) at the end of what it got; not timed per token, its
                # pace being two instances'.
                head = answered.first_chunk
                told = model_of(head), usage_of(resume.told, head, call.route.protocol)
                stats.count_usage(model, told[1], None)
            else:
                told = read_answer(answered, call.route.protocol)
                streamed = answered.body is None
                spent = answered.last_at - answered.first_at if streamed else None
                stats.count_usage(model, told[1], spent)
        if access is not None:
            self._log(access, traced)
        if traced:
            self._tell_span(told)

    def _log(self, access: AccessLog, traced: bool) -> None:
        call, resume, facts = self.call, self.resume, self.facts
        fields: dict[str, object] = {
            "method": "POST",
            "path": call.route.path,
            "status": self.status,
            "pool": call.pool.name,
            "model": facts.model,
            "instance": _instance_name(call, resume),
            "attempts": self.prior_attempts
            + call.attempts
            + (resume.attempts if resume is not None else 0),
            "streamed": facts.stream,
            "duration_s": self._clock() - self.started,
            "ttfb_s": self.ttfb_s,
            "client": self.client,
        }
        handover = self.handover
        if handover is not None and handover.hops:
            fields["fallbacks"] = handover.hops
            fields["fallback"] = ",".join(handover.reasons)
            fields["model_sent"] = call.facts.model
        if self.stream_error is not None:
            # The status went out with the first byte; what ended the stream did not.
            fields["stream_error"] = self.stream_error
        if self.client_left and self.status != CLIENT_CLOSED:
            fields["client_left"] = True  # after its first byte: the answer was not taken whole
        if resume is not None and resume.resumes:
            # Headers (x-gateway-attempts) went out before: the log tells of the resumes.
            fields["resumes"] = resume.resumes
            fields["resumed_on"] = resume.reasons
        if traced:
            span_context = trace.get_current_span().get_span_context()
            if span_context.is_valid:
                fields["trace_id"] = format(span_context.trace_id, "032x")
        access.write(fields)

    def _tell_span(self, told: tuple[str | None, Usage] | None) -> None:
        """The request's outcome on its SERVER span (`serve_traced`: the current one)."""
        call, resume, status = self.call, self.resume, self.status
        span = trace.get_current_span()
        span.set_attribute("gen_ai.request.model", self.facts.model)
        if told is not None:
            span.set_attributes(answer_attributes(*told))
        if status >= 500:
            span.set_attribute("error.type", str(status))
        elif self.stream_error is not None:
            span.set_attribute("error.type", "stream_cut")
            span.set_status(Status(StatusCode.ERROR, "the stream was cut short"))
        span.set_attributes(
            {
                "gateway.pool": call.pool.name,
                "gateway.attempts": self.prior_attempts
                + call.attempts
                + (resume.attempts if resume is not None else 0),
                "gateway.streamed": bool(self.facts.stream),
            }
        )
        instance = _instance_name(call, resume)
        if instance is not None:
            span.set_attribute("gateway.instance", instance)
        if resume is not None and resume.resumes:
            span.set_attribute("gateway.resumes", resume.resumes)
        if self.handover is not None:
            span.set_attribute("gateway.fallbacks", self.handover.hops)
        if self.ttfb_s is not None:
            span.set_attribute("gateway.time_to_first_byte_s", self.ttfb_s)
        if self.client_left or status == CLIENT_CLOSED:
            span.add_event("client disconnected")


def _instance_name(call: Call, resume: StreamResume | None) -> str | None:
    """The instance that served the end of the answer."""
    if resume is not None and resume.instance is not None:
        return resume.instance.name
    instance = call.attempt.instance
    return instance.name if instance is not None else None


def log_refused(
    access: AccessLog,
    scope: Scope,
    path: str,
    status: int,
    duration_s: float,
    model: str | None,
    client_address: str | None,
) -> None:
    """The access-log line of a request refused before it was routed (400, 401, 404, 413...),
    or whose client left while it was being read."""
    client = (client_address,) if client_address else scope.get("client")
    fields = {
        "method": scope["method"],
        "path": path,
        "status": status,
        "model": model,  # a client's string: escaped by the formatter
        "duration_s": duration_s,
        "client": client[0] if client else None,
    }
    access.write(fields)


Proxy = Callable[[Scope, Receive, Send, Route], Awaitable[None]]


async def serve_traced(
    tracing: Tracing,
    tracer: Tracer,
    proxy: Proxy,
    scope: Scope,
    receive: Receive,
    send: Send,
    route: Route,
) -> None:
    """`proxy` inside the request's SERVER span, which stays current for the layers (their
    events land on it) and ends with the response's last byte."""
    parent = tracing.extract(scope["headers"])
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
        await proxy(scope, receive, send_traced, route)
    finally:
        span.set_attribute("http.response.status_code", status)
        if status >= 500 or status == 0:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}" if status else "no answer"))
        otel_context.detach(token)
        span.end()
