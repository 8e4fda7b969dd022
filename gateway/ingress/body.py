"""Reading the request body within the size limit, and the few fields routing needs from it."""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.pipeline.call import RequestFacts

Receive = Any  # the ASGI receive callable


class ClientGone(Exception):
    """The client disconnected before its request was complete."""


async def read_body(receive: Receive, limit: int, declared_length: int | None) -> bytes:
    """The whole request body, refusing (413) as soon as it is known to exceed `limit`.

    A declared Content-Length over the limit is refused before a byte is read; a chunked
    body is refused as soon as the running total passes the limit.
    """
    if declared_length is not None and declared_length > limit:
        raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):  # the common case: one message holds it all
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
        return body
    parts = [body]
    size = len(body)
    while True:
        if size > limit:
            raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        parts.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            if size > limit:
                raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
            return b"".join(parts)


def read_facts(body: bytes, strict: bool = True) -> RequestFacts:
    """Parse the JSON body once for `model`, `stream` and `max_tokens`; 400 if it is not usable.
    A body without `model` names none (""): the gateway's only pool takes it, as the engine's
    default model would. So does an empty body (a route that takes none, such as the
    Responses API's cancel). Not `strict` (a route the gateway does not know, whose fields may
    mean something else): `stream` and `max_tokens` are read only when they are what the
    gateway takes them for, and are left to the backend otherwise."""
    if not body.strip():
        return RequestFacts("", False, None, {})
    try:
        data = json.loads(body)
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = data.get("model")
    if model is None:
        model = ""
    elif not isinstance(model, str):
        raise InvalidRequest("'model' must be a string")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        if strict:
            raise InvalidRequest("'stream' must be true or false")
        stream = False
    max_tokens = data.get("max_tokens")
    if max_tokens is None:  # chat completions' newer name for it, and the Responses API's
        max_tokens = data.get("max_completion_tokens", data.get("max_output_tokens"))
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0
    ):
        if strict:
            raise InvalidRequest("'max_tokens' must be a non-negative integer")
        max_tokens = None
    return RequestFacts(model, stream, max_tokens, data)
