"""Whole answers fetched as streams, so that a backend dying mid-generation costs a resume.

A request for a whole answer on a route whose streams can be continued is sent upstream as a
stream (`fetch_as_stream`; policy `resume.whole_answers`, on by default). The relay forwards
that stream, resumes included, into a `WholeAnswer` instead of the client: it assembles the
answer (`core.assembly`) and, when the stream has ended, sends the client one JSON answer with
the final attempt count, or the error that ended the stream as a JSON error. Nothing reaches
the client before the end, so the answer is all or nothing, as a whole answer always is.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import MutableMapping
from typing import Any, Final

from gateway.config.models import ResumePolicy
from gateway.config.routes import CHAT_PATH, MESSAGES_PATH
from gateway.core.assembly import Assembly, for_route, stream_request
from gateway.core.continuation import UnreadableEvent
from gateway.core.sse import event_boundary, split_events
from gateway.errors import GatewayError, UpstreamProtocolError, UpstreamStreamCut
from gateway.ingress.dialect import Dialect
from gateway.ingress.relay import Send, send_error
from gateway.ingress.resume import refusal_for
from gateway.pipeline.call import RequestFacts

# The stream's headers that say it is a stream: a JSON answer sets its own.
_STREAM_HEADERS: Final = frozenset(
    {
        b"content-type",
        b"content-length",
        b"cache-control",
        b"x-accel-buffering",
        b"x-gateway-attempts",
        b"x-gateway-instance",
    }
)
# Requests sent as they came, whatever else they hold: the client's own `stream_options` (the
# engine's to refuse without `stream`); vLLM's fields that only a whole answer carries back
# (the KV and encoder-cache handles of disaggregated prefill) or that it refuses to stream
# (beam search). A request that turns reasoning off is one too: vLLM then sends nothing
# while the model thinks, which a stream's idle timeout would take for a hang.
_SENT_AS_THEY_CAME: Final = (
    "stream_options",
    "kv_transfer_params",
    "ec_transfer_params",
    "use_beam_search",
)
# Those, and the fields that send a request as it came when they ask for something: most
# requests name none, which one set operation tells.
_LOOKED_AT: Final = frozenset({*_SENT_AS_THEY_CAME, "tools", "functions", "include_reasoning"})


def _added_fields(messages: bool) -> bytes:
    """What `stream_request` adds, as the end of a JSON object: `,"stream":true...}`."""
    return b"," + _dumps(stream_request({}, messages))[1:]


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


# What a whole request gets at the end of its JSON object to be fetched as a stream (its object
# has `model`, so it is never empty, and it has neither field: no key is named twice).
_STREAM_FIELDS: Final = _added_fields(messages=False)
_STREAM_FIELDS_MESSAGES: Final = _added_fields(messages=True)


def fetch_as_stream(
    path: str, facts: RequestFacts, policy: ResumePolicy, body: bytes
) -> tuple[bytes, RequestFacts] | None:
    """The body and facts a whole answer is fetched with as a stream, or None to send the
    request as it came: a streamed one, one on another route, one with the client's own
    `stream_options` or tools, or one a continuation could not serve. `body`: the client's,
    which `facts.request` was parsed from."""
    if facts.stream or not (policy.enabled and policy.whole_answers):
        return None
    request = facts.request
    if refusal_for(path, request) is not None:  # another route, or what is not continued
        return None
    if not _LOOKED_AT.isdisjoint(request) and (
        any(request.get(key) is not None for key in _SENT_AS_THEY_CAME)
        or request.get("tools")
        or request.get("functions")
        or request.get("include_reasoning") is False
    ):
        return None
    messages = path == MESSAGES_PATH
    streamed = stream_request(request, messages)
    end = body.rstrip()
    if "stream" not in request and "stream_options" not in request and end.endswith(b"}"):
        # The usual request names neither field: they are added at the end of the client's
        # own bytes, which costs a tenth of encoding the body again.
        body = end[:-1] + (_STREAM_FIELDS_MESSAGES if messages else _STREAM_FIELDS)
    else:
        body = _dumps(streamed)
    return body, RequestFacts(facts.model, True, facts.max_tokens, streamed)


class WholeAnswer:
    """What the relay sends a fetched stream to (an ASGI `send`): its events assembled into
    the whole answer, which `finish` sends the client.

    The bytes are kept as they come and read in runs of `FOLD_BYTES` (and at the end): reading
    each chunk as it came cost a third more CPU per event, and a run bounds what is held raw
    (an engine's events are mostly JSON framing around a token or a few)."""

    __slots__ = ("_held", "_parts", "_route", "_send", "assembly", "headers", "unreadable")

    FOLD_BYTES = 64 * 1024

    def __init__(self, send: Send, path: str) -> None:
        self._send = send
        self._route = (path == CHAT_PATH, path == MESSAGES_PATH)
        self.assembly: Assembly = for_route(*self._route)
        self.headers: list[tuple[bytes, bytes]] = []
        self._parts: list[bytes] = []  # the stream's bytes not read yet, as they came
        self._held = 0  # their size
        self.unreadable = False

    def restart(self) -> None:
        """The answer starts again from nothing on another attempt (`resume.Restart`)."""
        self.assembly = for_route(*self._route)
        self._parts.clear()
        self._held = 0
        self.unreadable = False

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.headers = message["headers"]
            return
        body = message.get("body", b"")
        if body:
            self.write(body)

    def writable(self) -> bool:
        """A `BodyWriter` (ingress.writer): the relay may hand it a stream's pieces from the
        upstream's callback, which it keeps as `__call__` does."""
        return True

    def flush(self) -> None:
        pass  # kept as written

    def write(self, body: bytes) -> None:
        if self.unreadable:
            return  # an unreadable answer is lost: nothing more of it is kept
        self._parts.append(body)
        self._held += len(body)
        if self._held > self.FOLD_BYTES:
            self._assemble(ended=False)

    def _assemble(self, ended: bool) -> None:
        """The events kept so far, in order, into the assembly: the complete ones, and once
        the stream has `ended` an unterminated rest too."""
        data = b"".join(self._parts)
        cut = len(data) if ended else event_boundary(data)
        rest = data[cut:]
        self._parts = [rest] if rest else []
        self._held = len(rest)
        if self.unreadable:
            return
        try:
            for event in split_events(data[:cut]):  # all of `data`: the same object, no copy
                self.assembly.feed(event)
        except UnreadableEvent:
            self.unreadable = True  # the answer is lost; the stream goes on to its end

    async def finish(
        self,
        error: GatewayError | None,
        attempts: int,
        instance: bytes,
        dialect: Dialect,
        routed: tuple[tuple[bytes, bytes], ...] = (),
    ) -> int:
        """Send the client the whole answer, or what ended the stream short; its status.
        `routed`: the headers naming the pool that answered, which the stream's own headers
        carry already, for the gateway's error."""
        self._assemble(ended=True)
        assembly = self.assembly
        engine_error = assembly.error if not self.unreadable else None
        if engine_error is not None and (error is None or isinstance(error, UpstreamStreamCut)):
            # The engine's own error, as it came in the stream (perhaps with no end after
            # it): the engine's answer.
            status = dialect.error_status(engine_error)
            await self._json(status, engine_error, attempts, instance)
            return status
        if error is None:
            answer = None
            if assembly.complete and not self.unreadable:
                with contextlib.suppress(UnreadableEvent):  # a tool call's input cut short
                    answer = assembly.answer()
            if answer is not None:
                await self._json(200, answer, attempts, instance)
                return 200
            error = UpstreamProtocolError("the upstream sent a stream no answer can be made of")
        # The gateway ended the stream (its error event is in it), or no answer came of it.
        await send_error(self._send, error, attempts, dialect, routed)
        return error.status

    async def _json(self, status: int, value: Any, attempts: int, instance: bytes) -> None:
        body = _dumps(value)
        headers = [(name, v) for name, v in self.headers if name not in _STREAM_HEADERS]
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-gateway-attempts", str(attempts).encode()),
            (b"x-gateway-instance", instance),
        ]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})
