"""A whole answer put together from the events of a stream.

A client that asks for a whole (non-streamed) answer gets nothing until the engine has
generated all of it; a backend that dies meanwhile loses all of it, and a retry starts again
from nothing. The gateway can fetch such an answer as a stream instead (`stream_request`): a
stream that breaks is continued from where it was (`core.continuation`), so a cut costs the
prefill, not the generation. The client still gets one whole answer, assembled here from the
stream's events, as the engine would have written it:

- chat completions: `chat.completion` with one `message` per choice (its `content`, any other
  text field a delta carried such as `reasoning_content`, `tool_calls` merged by index), the
  last `finish_reason` / `stop_reason`, and the stream's `usage`;
- completions: `text_completion` with each choice's `text`;
- Anthropic Messages: the `message` of `message_start`, its content blocks built from their
  deltas (text, thinking and its signature, a tool call's input parsed from its JSON pieces),
  and `message_delta`'s `stop_reason`, `stop_sequence` and usage.

The stream's fields that are not the protocol's (an engine's own extras) are carried over as
they came. An error event is kept (`error`) for the caller to answer with. Only the routes
whose streams can be continued are fetched this way, and only requests whose stream the
engine writes exactly as its whole answer: no `stream_options` of the client's (a whole
request with them is the engine's to refuse), no tools (engines parse tool calls differently
when streaming), nothing a continuation refuses.
"""

from __future__ import annotations

from typing import Any, Final

from gateway.core.continuation import UnreadableEvent, read_object
from gateway.core.sse import parse_event

# The top-level fields of an OpenAI chunk that the whole answer builds itself.
_OPENAI_BUILT: Final = frozenset({"object", "choices", "usage"})
# A delta's fields that are set, never appended to, when they come again.
_SET_KEYS: Final = frozenset({"index", "type", "id", "role"})


class _Text(list[str]):
    """A text field's pieces, joined once at the end: appending to a string held in a dict
    copies it each time, which makes a long answer's assembly quadratic."""


class Assembly:
    """One whole answer being put together from its stream's events, in order."""

    def __init__(self) -> None:
        self.error: dict[str, Any] | None = None  # the error event's data, if one came
        self.complete = False  # the protocol's last event came

    def feed(self, event: bytes) -> None:
        """One complete event (its blank line included)."""
        if self.error is not None or self.complete:
            return  # nothing after the end counts
        name, data = parse_event(event)
        if not data:
            return
        self.take(name, data)

    def take(self, name: str | None, data: str) -> None:
        raise NotImplementedError

    def answer(self) -> dict[str, Any]:
        """The whole answer, once `complete`."""
        raise NotImplementedError


class OpenAIAssembly(Assembly):
    """Chat completions (`chat`) or completions, from `chat.completion.chunk` /
    `text_completion` chunks and `[DONE]`."""

    def __init__(self, chat: bool) -> None:
        super().__init__()
        self.chat = chat
        self.top: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: Any = None

    def take(self, name: str | None, data: str) -> None:
        if data == "[DONE]":
            self.complete = True
            return
        chunk = read_object(data)
        if "error" in chunk:
            self.error = chunk
            return
        for key, value in chunk.items():
            if key not in _OPENAI_BUILT and key not in self.top:
                self.top[key] = value
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]  # cumulative: the last one counts
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for piece in choices:
            if isinstance(piece, dict):
                self._choice(piece)

    def _choice(self, piece: dict[str, Any]) -> None:
        index = piece.get("index", 0)
        if not isinstance(index, int):
            raise UnreadableEvent("a choice's index is not a number")
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": None}
            else:
                choice["text"] = _Text()
        for key, value in piece.items():
            if key == "index":
                continue
            if key == "delta" and self.chat:
                if isinstance(value, dict):
                    _merge(choice["message"], value)
            elif key == "text" and not self.chat:
                if isinstance(value, str):
                    choice["text"].append(value)
            elif value is not None or key not in choice:
                choice[key] = value  # finish_reason, stop_reason, logprobs: the last given

    def answer(self) -> dict[str, Any]:
        whole: dict[str, Any] = {}
        for key in ("id", "created", "model"):
            if key in self.top:
                whole[key] = self.top[key]
        whole["object"] = "chat.completion" if self.chat else "text_completion"
        choices = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            calls = choice.get("message", {}).get("tool_calls")
            if isinstance(calls, list):
                # A whole answer's tool calls are a list: their stream's indices go.
                for call in calls:
                    if isinstance(call, dict):
                        call.pop("index", None)
            choice.setdefault("logprobs", None)
            choice.setdefault("finish_reason", None)
            choices.append(_joined(choice))
        whole["choices"] = choices
        for key, value in self.top.items():
            whole.setdefault(key, value)
        if self.usage is not None:
            whole["usage"] = self.usage
        return whole


def _merge(into: dict[str, Any], delta: dict[str, Any]) -> None:
    """A delta folded into what came before it, as OpenAI's own stream accumulators do:
    text appended, objects merged, lists of indexed objects (tool calls) merged by index."""
    for key, value in delta.items():
        if value is None:
            into.setdefault(key, None)
            continue
        before = into.get(key)
        if key in _SET_KEYS or before is None:
            into[key] = _fresh(value, key)
        elif isinstance(value, str) and isinstance(before, (str, _Text)):
            if isinstance(before, str):
                before = into[key] = _Text([before])
            before.append(value)
        elif isinstance(before, dict) and isinstance(value, dict):
            _merge(before, value)
        elif isinstance(before, list) and not isinstance(before, _Text) and isinstance(value, list):
            _merge_list(before, value)
        else:
            into[key] = _fresh(value, key)


def _merge_list(into: list[Any], items: list[Any]) -> None:
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("index"), int):
            for existing in into:
                if isinstance(existing, dict) and existing.get("index") == item["index"]:
                    _merge(existing, item)
                    break
            else:
                into.append(_fresh(item))
        else:
            into.append(_fresh(item))


def _joined(value: Any) -> Any:
    """`value` with its texts' pieces joined."""
    if isinstance(value, _Text):
        return "".join(value)
    if isinstance(value, dict):
        return {key: _joined(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_joined(item) for item in value]
    return value


def _fresh(value: Any, key: str | None = None) -> Any:
    """A delta's value, copied where later deltas will merge into it (its texts as pieces)."""
    if isinstance(value, str):
        return value if key in _SET_KEYS else _Text([value])
    if isinstance(value, dict):
        return {name: _fresh(item, name) for name, item in value.items()}
    if isinstance(value, list):
        return [_fresh(item) for item in value]
    return value


class AnthropicAssembly(Assembly):
    """A Messages answer from `message_start`, the content blocks' events, `message_delta`
    and `message_stop`."""

    def __init__(self) -> None:
        super().__init__()
        self.message: dict[str, Any] | None = None
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial_json: dict[int, list[str]] = {}

    def take(self, name: str | None, data: str) -> None:
        event = read_object(data)
        kind = event.get("type", name)
        if kind == "error" or name == "error":
            self.error = event
        elif kind == "message_start":
            message = event.get("message")
            self.message = _fresh(message) if isinstance(message, dict) else {}
            self.message["content"] = []
        elif kind == "content_block_start":
            block = event.get("content_block")
            self.blocks[event.get("index", 0)] = _fresh(block) if isinstance(block, dict) else {}
        elif kind == "content_block_delta":
            self._delta(event.get("index", 0), event.get("delta"))
        elif kind == "content_block_stop":
            self._close(event.get("index", 0))
        elif kind == "message_delta":
            message = self._message()
            delta = event.get("delta")
            if isinstance(delta, dict):
                message.update(delta)
            usage = event.get("usage")
            if isinstance(usage, dict):
                known = message.get("usage")
                message["usage"] = {**known, **usage} if isinstance(known, dict) else usage
        elif kind == "message_stop":
            self.complete = True

    def _message(self) -> dict[str, Any]:
        if self.message is None:
            self.message = {"type": "message", "role": "assistant", "content": []}
        return self.message

    def _delta(self, index: int, delta: Any) -> None:
        if not isinstance(delta, dict):
            return
        block = self.blocks.setdefault(index, {})
        kind = delta.get("type")
        if kind in ("text_delta", "thinking_delta"):
            key = kind[: -len("_delta")]
            pieces = block.get(key)
            if not isinstance(pieces, _Text):
                pieces = block[key] = _Text([pieces] if isinstance(pieces, str) else [])
            pieces.append(str(delta.get(key, "")))
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature", "")
        elif kind == "input_json_delta":
            self.partial_json.setdefault(index, []).append(str(delta.get("partial_json", "")))
        elif kind == "citations_delta":
            block.setdefault("citations", []).append(delta.get("citation"))
        else:
            _merge(block, {k: v for k, v in delta.items() if k != "type"})

    def _close(self, index: int) -> None:
        pieces = self.partial_json.pop(index, None)
        if pieces is None:
            return
        text = "".join(pieces)
        if text:
            self.blocks.setdefault(index, {})["input"] = read_object(text)

    def answer(self) -> dict[str, Any]:
        for index in list(self.partial_json):
            self._close(index)
        message: dict[str, Any] = _joined(self._message())
        message["content"] = [_joined(self.blocks[index]) for index in sorted(self.blocks)]
        return message


def stream_request(request: dict[str, Any], messages: bool) -> dict[str, Any]:
    """The streamed request a whole one is fetched with: the same body with `stream: true`,
    and on OpenAI routes `stream_options.include_usage`, since a whole answer has usage."""
    streamed = {**request, "stream": True}
    if not messages:
        streamed["stream_options"] = {"include_usage": True}
    return streamed


def for_route(chat: bool, messages: bool) -> Assembly:
    return AnthropicAssembly() if messages else OpenAIAssembly(chat)
