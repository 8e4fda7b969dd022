"""What to send: a seeded, endless sequence of request plans with their JSON bodies ready.

The same `WorkloadSpec` (seed included) gives the same sequence, so a run through the gateway and
a direct run see identical requests. Bodies are assembled from precomputed bytes: one long ASCII
prompt text is built once and sliced per request (the fake backend counts whitespace-separated
words as prompt tokens, so one word is one token), and the JSON is concatenated rather than
serialised, which keeps 200+ requests/s with 16 KB prompts cheap.

An optional priority mix tags each plan with the gateway's admission class (interactive,
standard, batch). It is drawn from its own seeded generator, so adding a mix leaves every other
field of the sequence exactly as it was without one.

Models named in `anthropic_models` are sent with Anthropic's Messages API (kind "messages",
`POST /v1/messages`), streamed or not as drawn; the draws are the same as for any other model,
so a spec without such models gives exactly the sequence it gave before they existed.

A `long_prompt_share` of requests get a prompt of `long_prompt_tokens` instead of one drawn from
`prompt_tokens` (on a real engine, a prefill that pauses every stream decoding there). Whether a
request is long is drawn from its own seeded generator too, so a share of 0 leaves the sequence
exactly as it was without the option.
"""

from __future__ import annotations

import json
import math
import random
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

Kind = Literal["chat", "completions", "messages"]

PATHS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",  # Anthropic's Messages API
}
# The gateway's admission classes (x-gateway-priority), most urgent first.
PRIORITIES: tuple[str, ...] = ("interactive", "standard", "batch")

# Plain ASCII words: pasted into JSON strings with no escaping.
_WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
    "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango",
    "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "river", "stone", "cloud", "ember",
    "maple", "orbit", "prism", "quartz", "saddle", "timber", "velvet", "walnut", "yonder", "zephyr",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RequestPlan:
    seq: int  # 0-based order of sending
    model: str
    kind: Kind
    stream: bool
    prompt_tokens: int
    max_tokens: int
    path: str  # PATHS[kind]
    body: bytes  # the JSON request body
    priority: str | None = None  # x-gateway-priority; None: no header


@dataclass(frozen=True)
class WorkloadSpec:
    models: list[str]  # requests cycle through them in order: side-by-side models, same load
    chat_share: float = 0.7  # the rest are /v1/completions
    stream_share: float = 0.5
    prompt_tokens: tuple[int, int] = (512, 4096)  # inclusive range, uniform
    max_tokens: tuple[int, int] = (512, 4096)  # inclusive range, uniform
    seed: int = 1
    # (class, share) pairs; shares are normalised to sum to 1. Empty: no priority header.
    priorities: tuple[tuple[str, float], ...] = ()
    # Models sent with Anthropic's Messages API (kind "messages"); each must be in `models`.
    anthropic_models: tuple[str, ...] = ()
    long_prompt_share: float = 0.0
    long_prompt_tokens: int = 1500

    def __post_init__(self) -> None:
        # Frozen: the normalised mix replaces the given one in place.
        object.__setattr__(self, "priorities", normalise_priorities(self.priorities))
        object.__setattr__(self, "anthropic_models", tuple(self.anthropic_models))
        if not self.models:
            raise ValueError("a workload needs at least one model")
        unknown = [m for m in self.anthropic_models if m not in self.models]
        if unknown:
            raise ValueError(f"anthropic models not among the models: {', '.join(unknown)}")
        for name in ("chat_share", "stream_share", "long_prompt_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")
        for name in ("prompt_tokens", "max_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {low}:{high}")
        if self.long_prompt_tokens < 1:
            raise ValueError("long_prompt_tokens must be >= 1")

    @property
    def longest_prompt(self) -> int:
        """The most prompt tokens a request of this spec can have."""
        if self.long_prompt_share > 0:
            return max(self.prompt_tokens[1], self.long_prompt_tokens)
        return self.prompt_tokens[1]


def normalise_priorities(mix: Iterable[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """`mix` checked (known classes, each once, shares > 0) with shares scaled to sum to 1."""
    pairs = [(str(name), float(share)) for name, share in mix]
    names = [name for name, _ in pairs]
    for name, share in pairs:
        if name not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {name!r}")
        if not (share > 0 and math.isfinite(share)):  # NaN fails the comparison too
            raise ValueError(f"priority share must be finite and > 0, got {name}={share}")
    if len(set(names)) != len(names):
        raise ValueError(f"each priority may appear once, got {', '.join(names)}")
    total = sum(share for _, share in pairs)
    return tuple((name, share / total) for name, share in pairs)


def parse_priority_mix(text: str) -> tuple[tuple[str, float], ...]:
    """`interactive=0.2,standard=0.3,batch=0.5` -> the normalised mix; ValueError if malformed."""
    pairs = []
    for item in text.split(","):
        name, sep, share = item.partition("=")
        try:
            pairs.append((name.strip(), float(share)))
        except ValueError:
            raise ValueError(f"expected CLASS=SHARE, got {item!r}") from None
        if not sep:
            raise ValueError(f"expected CLASS=SHARE, got {item!r}")
    return normalise_priorities(pairs)


class PromptText:
    """One long prompt of words, built once; `words(start, n)` slices n words out of it."""

    def __init__(self, max_words: int, seed: int) -> None:
        rng = random.Random(f"prompt-{seed}")
        count = 2 * max_words  # any start in [0, max_words] leaves room for max_words words
        words = [rng.choice(_WORDS) for _ in range(count)]
        self.max_words = max_words
        self._text = " ".join(words).encode("ascii") + b" "
        # _starts[k]: byte offset of word k; _starts[count] is one past the trailing space.
        starts = [0] * (count + 1)
        offset = 0
        for k, word in enumerate(words):
            starts[k] = offset
            offset += len(word) + 1
        starts[count] = offset
        self._starts = starts

    def words(self, start: int, n: int) -> bytes:
        return self._text[self._starts[start] : self._starts[start + n] - 1]


def plans(spec: WorkloadSpec) -> Iterator[RequestPlan]:
    """The endless request sequence of `spec`; the same spec gives the same sequence."""
    rng = random.Random(spec.seed)
    prompt = PromptText(spec.longest_prompt, spec.seed)
    model_json = [json.dumps(m).encode() for m in spec.models]
    anthropic = [m in spec.anthropic_models for m in spec.models]
    p_low, p_high = spec.prompt_tokens
    m_low, m_high = spec.max_tokens
    # A separate generator: the main one's draws, hence every other field, stay unchanged.
    priority_rng = random.Random(f"priority-{spec.seed}")
    classes = [name for name, _ in spec.priorities]
    bounds = _cumulative([share for _, share in spec.priorities])
    long_rng = random.Random(f"long-prompt-{spec.seed}")  # likewise
    seq = 0
    while True:
        index = seq % len(spec.models)
        # Drawn in a fixed order, so the sequence depends on the seed alone.
        chat = rng.random() < spec.chat_share
        stream = rng.random() < spec.stream_share
        n_prompt = rng.randint(p_low, p_high)
        n_max = rng.randint(m_low, m_high)
        # Over the short prompts' range whatever the text's length: a wider range would take
        # other bits from `rng` and change every later draw.
        start = rng.randint(0, p_high)
        if spec.long_prompt_share and long_rng.random() < spec.long_prompt_share:
            n_prompt = spec.long_prompt_tokens
            start = long_rng.randint(0, prompt.max_words)
        kind: Kind
        if anthropic[index]:
            kind = "messages"
            body = build_messages_body(
                model_json[index], stream, prompt.words(start, n_prompt), n_max
            )
        else:
            kind = "chat" if chat else "completions"
            body = build_body(model_json[index], chat, stream, prompt.words(start, n_prompt), n_max)
        priority = classes[bisect_right(bounds, priority_rng.random())] if classes else None
        yield RequestPlan(
            seq, spec.models[index], kind, stream, n_prompt, n_max, PATHS[kind], body, priority
        )
        seq += 1


def _cumulative(shares: list[float]) -> list[float]:
    """Upper bounds of each class on [0, 1); the last is exactly 1 so rounding never overflows."""
    bounds: list[float] = []
    total = 0.0
    for share in shares:
        total += share
        bounds.append(total)
    if bounds:
        bounds[-1] = 1.0
    return bounds


_STREAM_TAIL = b',"stream":true,"stream_options":{"include_usage":true}}'
_PLAIN_TAIL = b',"stream":false}'


def build_body(
    model_json: bytes, chat: bool, stream: bool, prompt: bytes, max_tokens: int
) -> bytes:
    """The JSON body; `model_json` is already a JSON string, `prompt` needs no escaping."""
    if chat:
        head = b'{"model":%b,"messages":[{"role":"user","content":"' % model_json
        middle = b'"}],"max_tokens":'
    else:
        head = b'{"model":%b,"prompt":"' % model_json
        middle = b'","max_tokens":'
    tail = _STREAM_TAIL if stream else _PLAIN_TAIL
    return b"".join((head, prompt, middle, b"%d" % max_tokens, tail))


def build_messages_body(model_json: bytes, stream: bool, prompt: bytes, max_tokens: int) -> bytes:
    """An Anthropic Messages API body: one user message; `prompt` needs no escaping."""
    return b"".join(
        (
            b'{"model":%b,"max_tokens":%d,"messages":[{"role":"user","content":"'
            % (model_json, max_tokens),
            prompt,
            b'"}],"stream":true}' if stream else b'"}],"stream":false}',
        )
    )
