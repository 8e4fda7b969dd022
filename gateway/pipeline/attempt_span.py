"""The layer that traces each upstream attempt: one CLIENT span, its context sent upstream.

Innermost (after the deadline layer, so the attempt's timeouts are known): the span covers the
attempt from connect to its last byte, a stream's included, and says which instance, which
attempt, which timeouts, and how it ended. The client's own `traceparent`/`tracestate` are
replaced by this attempt's, so the backend's spans hang under the attempt that called it.
Composed only when tracing is on.
"""

from __future__ import annotations

import asyncio

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.config.routes import genai_attributes
from gateway.core.outcome import Outcome
from gateway.core.usage import EDGE_BYTES, Usage, model_of, usage_of
from gateway.errors import UpstreamError
from gateway.pipeline.call import Call, Handler
from gateway.telemetry.tracing import Tracing
from gateway.upstream.response import UpstreamResponse
from gateway.upstream.stats import outcome_label


class AttemptSpans:
    def __init__(self, tracing: Tracing) -> None:
        self._tracer = tracing.tracer
        self._tracing = tracing

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        parent = trace.get_current_span()
        if not parent.is_recording():
            # The request is not sampled: no span to record, but the backend still gets the
            # trace's context (flagged not sampled), as W3C asks of every hop.
            return await _send_in(self._tracing, parent, call, next_handler)
        span = self._start(call)
        try:
            response = await _send_in(self._tracing, span, call, next_handler)
        except UpstreamError as error:
            _end(span, error.outcome, error)
            raise
        except asyncio.CancelledError:
            span.set_status(Status(StatusCode.ERROR, "cancelled"))
            span.set_attribute("gateway.outcome", "cancelled")
            span.end()
            raise
        span.set_attribute("http.response.status_code", response.status)
        if response.body is not None:
            _end(span, response.outcome, None, response)
        else:
            response.after(
                lambda r, error: _end(
                    span, error.outcome if error is not None else r.outcome, error, r
                )
            )
        return response

    def _start(self, call: Call) -> trace.Span:
        attempt = call.attempt
        instance = attempt.instance
        timeouts = attempt.timeouts
        assert instance is not None and timeouts is not None, "runs after pick and deadline"
        url = instance.url_of(call.path)
        attributes: dict[str, str | int | float | bool] = {
            "http.request.method": "POST",
            "url.full": str(url),
            "server.address": url.host or "",
            "server.port": url.port or 0,
            "gateway.instance": instance.name,
            "gateway.attempt": call.attempts,
            "gateway.probe": attempt.probe,
            "gateway.tier.k": call.k,
            "gateway.timeout.connect_s": timeouts.connect_s,
            "gateway.timeout.first_byte_s": timeouts.first_byte_s,
            **genai_attributes(call.route),
            "gen_ai.request.model": call.facts.model,
        }
        if timeouts.idle_s is not None:
            attributes["gateway.timeout.idle_s"] = timeouts.idle_s
        return self._tracer.start_span(
            f"POST {call.route.template}", kind=SpanKind.CLIENT, attributes=attributes
        )


async def _send_in(
    tracing: Tracing, span: trace.Span, call: Call, next_handler: Handler
) -> UpstreamResponse:
    """The attempt, sent with `span`'s context in place of the client's trace headers."""
    forward = call.headers
    dropped = tracing.trace_headers
    call.headers = [h for h in forward if h[0] not in dropped]
    call.headers += tracing.inject(trace.set_span_in_context(span))
    try:
        return await next_handler(call)
    finally:
        call.headers = forward


def _end(
    span: trace.Span,
    outcome: Outcome,
    error: UpstreamError | None,
    response: UpstreamResponse | None = None,
) -> None:
    label = outcome_label(outcome)
    span.set_attribute("gateway.outcome", label)
    if response is not None and outcome.kind == "ok" and error is None:
        span.set_attributes(answer_attributes(*read_answer(response, response.route.protocol)))
    if outcome.kind != "ok" or error is not None:
        # The conventions' form: an HTTP error's status code (an OOM's 500 too: the gateway's
        # own label is in gateway.outcome), else the kind of failure.
        status = outcome.status
        span.set_attribute("error.type", str(status) if status is not None else label)
        span.set_status(Status(StatusCode.ERROR, error.message if error is not None else label))
    span.end()


def read_answer(response: UpstreamResponse, protocol: str) -> tuple[str | None, Usage]:
    """The model an answer names and the usage it says (a whole body is looked at only near
    its start and end)."""
    body = response.body
    if body is not None:
        head, end = body[:EDGE_BYTES], body[-EDGE_BYTES:]
        model = model_of(head) or model_of(end)
    else:
        head, end = response.first_chunk, response.before_tail + response.tail
        model = model_of(head)
    return model, usage_of(end, head, protocol)


def answer_attributes(model: str | None, usage: Usage) -> dict[str, str | int]:
    """The GenAI attributes an answer tells: the model that answered and its usage."""
    attributes: dict[str, str | int] = {}
    if model is not None:
        attributes["gen_ai.response.model"] = model
    if usage.input_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = usage.input_tokens
    if usage.output_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = usage.output_tokens
    return attributes
