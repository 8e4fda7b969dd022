"""The Responses API (`POST /v1/responses`) on the fake backend, as vLLM serves it.

- A plain answer is one `response` object: a message with one `output_text` part, `status`
  "completed" and `usage` (`input_tokens`, `output_tokens`, `total_tokens` with their details).
- A stream is named events, each `event: TYPE\\ndata: JSON\\n\\n` with a `sequence_number` from 0:
  `response.created`, `response.in_progress`, `response.output_item.added`,
  `response.content_part.added`, one `response.output_text.delta` per token event,
  `response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
  `response.completed` (the whole response, with its usage). No `[DONE]`.
- `max_output_tokens` bounds the answer (16 when absent); `input` (a string or a list of
  items) is the prompt; `model` may be left out (the first served model answers).
- Faults as on the other routes, answered in OpenAI's error shape; vLLM reports no error event
  in these streams, so `stream_error` cuts the stream as `die` does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from . import responses as r
from .asgi import Receive, Scope, Send, answer_whole, body_message, respond, start_message
from .bodies import BadRequest, parse_object
from .config import DIE, OOM, STALL, STREAM_ERROR
from .engine import EngineOOM
from .pacing import Pacer, cut_point, cut_short, pause, send_tokens

if TYPE_CHECKING:
    from .app import FakeVllm

RESPONSES = "/v1/responses"
SSE = b"text/event-stream; charset=utf-8"
MAX_TOKENS_LIMIT = 1_000_000


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def _part(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


class ResponseWriter:
    """One answer's response object and, for a stream, its events in order."""

    def __init__(self, rid: str, model: str, max_output: int, input_tokens: int) -> None:
        self.id = f"resp_{rid}"
        self.item_id = f"msg_{rid}"
        self.model = model
        self.max_output = max_output
        self.input_tokens = input_tokens
        self.created_at = int(time.time())
        self.sequence = 0

    def response(self, status: str, n: int | None) -> dict[str, Any]:
        """The response object: in progress (no output yet), or completed with `n` tokens."""
        output: list[dict[str, Any]] = []
        if n is not None:
            output.append(self._item("completed", r.text(n)))
        return {
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": None,
            "instructions": None,
            "metadata": None,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "background": False,
            "max_output_tokens": self.max_output,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": status,
            "text": None,
            "truncation": "disabled",
            "usage": None if n is None else _usage(self.input_tokens, n),
            "user": None,
        }

    def _item(self, status: str, text: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if status == "completed":
            content.append(_part(text))
        return {
            "id": self.item_id,
            "content": content,
            "role": "assistant",
            "status": status,
            "type": "message",
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + r.dumps(payload) + b"\n\n"

    def start(self) -> bytes:
        part = _part("")
        return b"".join(
            (
                self.event("response.created", response=self.response("in_progress", None)),
                self.event("response.in_progress", response=self.response("in_progress", None)),
                self.event(
                    "response.output_item.added",
                    output_index=0,
                    item=self._item("in_progress", ""),
                ),
                self.event(
                    "response.content_part.added",
                    item_id=self.item_id,
                    output_index=0,
                    content_index=0,
                    part=part,
                ),
            )
        )

    def delta(self, start: int, end: int) -> bytes:
        return self.event(
            "response.output_text.delta",
            item_id=self.item_id,
            output_index=0,
            content_index=0,
            delta=r.span(start, end),
            logprobs=[],
        )

    def finish(self, n: int) -> bytes:
        text = r.text(n)
        part = _part(text)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return b"".join(
            (
                self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=part),
                self.event(
                    "response.output_item.done", output_index=0, item=self._item("completed", text)
                ),
                self.event("response.completed", response=self.response("completed", n)),
            )
        )


def _max_output(request: dict[str, Any]) -> int:
    value = request.get("max_output_tokens")
    if value is None:
        return 16
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise BadRequest(400, f"max_output_tokens must be between 1 and {MAX_TOKENS_LIMIT}")
    return value


async def handle_responses(app: FakeVllm, scope: Scope, receive: Receive, send: Send) -> None:
    record, body = await app._receive_logged(scope, receive)
    if body is None:
        return
    try:
        request = parse_object(body)
        model = app._model(request, record)
        stream = request.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(400, "'stream' must be a boolean")
        record.stream = stream
        n = _max_output(request)
        record.max_tokens = n
        if not isinstance(request.get("input"), (str, list)):
            raise BadRequest(400, "'input' must be a string or a list of items")
    except BadRequest as exc:
        await respond(send, exc.status, r.error_body(exc.status, exc.message))
        app.log.finish(record, "error")
        return
    input_tokens = max(
        1, r.count_words(request["input"]) + r.count_words(request.get("instructions"))
    )
    faults = app.faults
    fault = faults.draw(app.rng, stream)
    if stream and fault is None:
        fault = app.forced_fault(stream=True)
    record.fault = fault
    ttft = faults.ttft_s(app.config)
    per_token_s = faults.per_token_s(app.config)
    writer = ResponseWriter(app._next_rid(), model, n, input_tokens)

    async def generate(per_token: float) -> str:
        if not stream:
            await pause(ttft + per_token * n)
            full = r.dumps(writer.response("completed", n))
            return await answer_whole(send, full, fault in (DIE, STREAM_ERROR))
        await send(start_message(200, SSE, None, [(b"cache-control", b"no-cache")]))
        # vLLM's Responses streams have no error event: an engine error cuts them too.
        cut_by = faults.die_after if fault in (DIE, STREAM_ERROR) else None
        cut = cut_point(n, faults.stall_after if fault == STALL else cut_by)
        pacer = Pacer(ttft, per_token)
        await pacer.first_token()
        await send(body_message(writer.start(), more=True))
        await send_tokens(send, pacer, n, faults.tokens_per_event_n(app.config), cut, writer.delta)
        ended = await cut_short(DIE if fault == STREAM_ERROR else fault, faults)
        if ended is not None:
            return ended
        await send(body_message(writer.finish(n), more=False))
        return "ok"

    async def run() -> str:
        if fault is not None and fault not in (DIE, STALL, STREAM_ERROR):
            return await app._fault_reply(send, fault, faults)
        engine = app.engine
        if engine is None:
            return await generate(per_token_s)
        try:
            async with engine.run(input_tokens + n) as factor:
                return await generate(per_token_s * factor)
        except EngineOOM:
            record.fault = OOM
            return await app._fault_reply(send, OOM, faults)

    await app._guarded(receive, record, model, run)
