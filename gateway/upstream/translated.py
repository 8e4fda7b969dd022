"""A request sent to a pool of the other API family, and its answer read back in the client's.

A request handed over to a fallback pool that speaks the other family (`pools.<name>.api`) is
translated before it leaves (`core.translate`): an OpenAI chat completion becomes an Anthropic
Messages request, or the reverse, sent to that family's path. Its answer is translated back
as it is read (`Translated.wrap`): a whole answer, an error body, or a stream event by event
(`core.translate_stream`). Everything above the transport sees the client's own family: the
relay, the assembly of a whole answer, the usage read from the answer. A translated stream is
not continued after a break (a continuation would have to be translated too): it ends as a
stream that cannot be resumed does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Final, Literal, Protocol

from gateway.config.routes import CHAT_PATH, MESSAGES_PATH, Route
from gateway.core.translate import Untranslatable, chat_to_messages, messages_to_chat
from gateway.core.translate_answer import (
    chat_answer_to_messages,
    error_to_chat,
    error_to_messages,
    messages_answer_to_chat,
)
from gateway.core.translate_stream import ChatToMessagesStream, MessagesToChatStream
from gateway.upstream.h1_connection import Headers
from gateway.upstream.response import HeaderLookup, ResponseHead

Family = Literal["openai", "anthropic"]
# The Messages API version a translated request is written for (Anthropic's API requires the
# header; servers that do not need it ignore it).
ANTHROPIC_VERSION: Final = "2023-06-01"
# Headers the translated body makes wrong: its length, and what the upstream said of the
# bytes it sent (an encoding the translation decoded).
_DROPPED: Final = frozenset((b"content-length", b"content-encoding", b"transfer-encoding"))


# The API family of each route protocol (None: a route of no family, sent as it is anywhere).
_FAMILIES: Final[dict[str, Family]] = {
    "openai": "openai",
    "responses": "openai",
    "anthropic": "anthropic",
}


class NotTranslated(Exception):
    """A route of one family asked of a pool of the other that is not translated (only chat
    completions and Messages are)."""


def translation_for(
    route: Route, api: Family | None, request: dict[str, Any], model: str
) -> Translated | None:
    """How a request on `route` (`request`, asking `model`) reaches a pool whose instances
    speak `api`: None when as it is (no family stated, the same family, a route of none).
    Raises NotTranslated for a route that is not translated, and `core.translate.
    Untranslatable` for a request the other family cannot express."""
    family = _FAMILIES.get(route.protocol)
    if api is None or family is None or api == family:
        return None
    if route.path not in (CHAT_PATH, MESSAGES_PATH):
        raise NotTranslated(f"{route.path} is not translated to the {api} API")
    try:
        return Translated(family, request, model)
    except Untranslatable:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as malformed:
        # A request its own family's server would refuse (a block without its text...).
        raise Untranslatable("malformed", str(malformed)) from None


class Translated:
    """How one request crosses to the other family: the path it is sent to, its body there,
    and how its answer is read back (`wrap`)."""

    __slots__ = ("_client", "_created", "_include_usage", "_model", "body", "path")

    def __init__(self, client: Family, request: dict[str, Any], model: str) -> None:
        """`request`: the client's, in its family (`client`); `model`: the one asked there.
        Raises `core.translate.Untranslatable` when the request cannot be expressed there."""
        self._client = client
        self._model = model
        self._created = int(time.time())  # an OpenAI answer's `created`: when it was asked
        if client == "openai":
            sent = chat_to_messages(request, model)
            self.path = MESSAGES_PATH
            options = request.get("stream_options")
            self._include_usage = isinstance(options, dict) and options.get("include_usage") is True
        else:
            sent = messages_to_chat(request, model)
            self.path = CHAT_PATH
            self._include_usage = False
        self.body = json.dumps(sent, separators=(",", ":"), ensure_ascii=False).encode()

    def headers(self, sent: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The request's headers as they go to the other family: its body is read back
        uncompressed (`identity`: the translation reads the bytes), and a Messages API asked
        without its version header is given the one this translation speaks."""
        out = [(n, v) for n, v in sent if n.lower() != "accept-encoding"]
        out.append(("accept-encoding", "identity"))
        if self._client == "openai" and not any(n.lower() == "anthropic-version" for n, _ in out):
            out.append(("anthropic-version", ANTHROPIC_VERSION))
        return out

    def wrap(self, head: ResponseHead) -> ResponseHead:
        """The upstream's answer, read in the client's family."""
        sse = head.headers.get("content-type", "").lower().startswith("text/event-stream")
        if self._client == "openai":
            created = self._created
            to_chat = MessagesToChatStream(self._include_usage, created=created) if sse else None

            def whole(answer: dict[str, Any]) -> dict[str, Any]:
                return messages_answer_to_chat(answer, created=created)

            return _TranslatedHead(head, to_chat, whole, error_to_chat)
        to_messages = ChatToMessagesStream(self._model) if sse else None
        return _TranslatedHead(head, to_messages, chat_answer_to_messages, error_to_messages)


class _Stream(Protocol):
    def feed(self, data: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


class _TranslatedHead:
    """A response head whose body comes out translated: a stream event by event, a whole
    answer (or an error's body) once read whole."""

    def __init__(
        self,
        head: ResponseHead,
        stream: _Stream | None,
        whole: Callable[[dict[str, Any]], dict[str, Any]],
        error: Callable[[int, bytes], bytes],
    ) -> None:
        self._head = head
        self._stream = stream
        self._whole = whole
        self._error = error
        self._ended = False
        self.status = head.status
        self.raw_headers = [(n, v) for n, v in head.raw_headers if n.lower() not in _DROPPED]
        # Its length as the upstream sent it: whether the transport reads it whole.
        self.content_length = head.content_length
        self._headers = Headers(self.raw_headers)

    @property
    def headers(self) -> HeaderLookup:
        return self._headers

    @property
    def connection(self) -> object | None:
        return self._head.connection

    async def readany(self) -> bytes:
        """The next translated piece: events as they complete (an event split across reads
        waits for its end), b"" at the end."""
        stream = self._stream
        if stream is None:
            return await self.read() if not self._ended else b""
        while not self._ended:
            chunk = await self._head.readany()
            if not chunk:
                self._ended = True
                return bytes(stream.finish())
            out = stream.feed(chunk)
            if out:
                return bytes(out)
        return b""

    async def pump(self, tap: Callable[[bytes], bool]) -> bytes | None:
        return await self.readany()  # pieces go through the translation, never to `tap`

    def stop_pump(self) -> None:
        pass

    async def read(self) -> bytes:
        """The rest of the body, translated: a stream's remaining events, or the whole answer
        (an error's body in the client's error shape)."""
        if self._stream is not None:
            pieces = []
            while piece := await self.readany():
                pieces.append(piece)
            return b"".join(pieces)
        self._ended = True
        body = await self._head.read()
        if self.status >= 400:
            return self._error(self.status, body)
        try:
            answer = json.loads(body)
        except ValueError:
            return body  # not an answer: relayed as it came, for the client to see
        if not isinstance(answer, dict):
            return body
        return json.dumps(self._whole(answer), separators=(",", ":"), ensure_ascii=False).encode()

    def release(self) -> None:
        self._head.release()

    def close(self) -> None:
        self._head.close()
