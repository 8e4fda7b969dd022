"""Static configuration of a fake backend, and the faults that can be switched at run time."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Fault names as recorded in the request log's `fault` field.
ERROR = "error"
OOM = "oom"
RATE_LIMIT = "rate_limit"
HANG = "hang"
STALL = "stall"
DIE = "die"
# Anthropic Messages API only (POST /v1/messages): vLLM has no such answers.
OVERLOADED = "overloaded"
STREAM_ERROR = "stream_error"


@dataclass(frozen=True)
class FakeConfig:
    """What a fake backend serves and how fast; fixed for the life of the process."""

    name: str = "fake"
    models: tuple[str, ...] = ("fake-model",)
    ttft_s: float = 0.02
    per_token_s: float = 0.001
    seed: int = 0
    # Tokens per SSE event (vLLM's stream interval); the last event of a stream may carry fewer.
    tokens_per_event: int = 1
    # Answer every POST /v1/* with one precomputed body: no parsing, sleeping, faults or log.
    fixed_body: bool = False
    log_size: int = 10_000
    # The simulated engine (engine.py); all off by default. At most `max_running` requests
    # generate at once, the rest wait in FIFO order (0: unlimited, vLLM's max_num_seqs).
    max_running: int = 0
    # KV-cache size in tokens; a request starting without room for prompt + max_tokens fails
    # as on a GPU out-of-memory error (0: unlimited).
    kv_tokens: int = 0
    # Per-token time grows by this fraction of the batch's fullness as a request starts.
    batch_slowdown: float = 0.0
    # No batch bound, and a GPU out-of-memory error for a request starting past this many
    # running (0: never), as an engine run without a safe `max_num_seqs`.
    oom_above: int = 0
    # False: GET /metrics is a 404, as from a server that exports no load gauges.
    metrics: bool = True
    # Log the exact `x-api-key` and `authorization` of Anthropic requests (`credentials` field);
    # off, the log shows only whether they were present and a short hash of the key.
    record_credentials: bool = False
    # Stream an Anthropic prefill again before its continuation, as llama.cpp's server does.
    echo_prefill: bool = False
    # The model's context window in tokens (words here): a prompt plus max_tokens over it is
    # refused with a 400 as vLLM words it (Anthropic's wording on /v1/messages); 0: no limit.
    max_model_len: int = 0

    @property
    def engine_enabled(self) -> bool:
        """False keeps the fake as it was before the engine: no queue, no KV limit."""
        return (
            self.max_running > 0
            or self.kv_tokens > 0
            or self.batch_slowdown > 0
            or self.oom_above > 0
        )


@dataclass(frozen=True)
class Faults:
    """Run-time fault switches. Field names are the JSON keys of `/_fake/faults`."""

    error_rate: float = 0.0
    error_status: int = 500
    error_message: str = "injected error"  # the message of the `error_status` answers
    oom_rate: float = 0.0
    hang_rate: float = 0.0
    hang_s: float = 3600.0
    stall_rate: float = 0.0
    stall_after: int = 3
    die_rate: float = 0.0
    die_after: int = 3
    # The next this many streams are cut after `die_after` tokens, whatever the rates.
    die_next: int = 0
    # The next this many streams end with the engine's error event after `stall_after` tokens.
    error_next: int = 0
    # The next this many generation requests, once `die_next` and `error_next` are spent, get
    # the `error_status` error before any token.
    refuse_next: int = 0
    rate_limit_rate: float = 0.0
    retry_after: int = 1
    # Anthropic requests only: a 529 overloaded_error before any token. Any stream: the
    # engine's error event after `stall_after` tokens (Anthropic's `event: error`, vLLM's
    # `data: {"error": ...}` then `[DONE]`), which ends it.
    overloaded_rate: float = 0.0
    stream_error_rate: float = 0.0
    slow_factor: float = 1.0
    unhealthy: bool = False
    ttft: float | None = None
    per_token: float | None = None
    tokens_per_event: int | None = None  # None: the command line's --tokens-per-event

    @property
    def any_random(self) -> bool:
        """True when some request-level fault may fire; lets the hot path skip drawing."""
        return (
            self.error_rate > 0
            or self.oom_rate > 0
            or self.hang_rate > 0
            or self.stall_rate > 0
            or self.die_rate > 0
            or self.rate_limit_rate > 0
            or self.overloaded_rate > 0
            or self.stream_error_rate > 0
        )

    def draw(self, rng: random.Random, stream: bool, anthropic: bool = False) -> str | None:
        """The one fault to inject into a request, or None.

        Checked in a fixed order so a seeded generator gives the same sequence on every run;
        a rate of 0 consumes no randomness. The Anthropic-only faults come last and are drawn
        only for Anthropic requests (`anthropic`), so they never disturb the OpenAI routes.
        """
        if not self.any_random:
            return None
        for name, rate in (
            (RATE_LIMIT, self.rate_limit_rate),
            (ERROR, self.error_rate),
            (OOM, self.oom_rate),
            (HANG, self.hang_rate),
            (DIE, self.die_rate),
            (STALL, self.stall_rate if stream else 0.0),
            (OVERLOADED, self.overloaded_rate if anthropic else 0.0),
            (STREAM_ERROR, self.stream_error_rate if stream else 0.0),
        ):
            if rate > 0 and rng.random() < rate:
                return name
        return None

    def ttft_s(self, config: FakeConfig) -> float:
        base = config.ttft_s if self.ttft is None else self.ttft
        return base * self.slow_factor

    def per_token_s(self, config: FakeConfig) -> float:
        base = config.per_token_s if self.per_token is None else self.per_token
        return base * self.slow_factor

    def tokens_per_event_n(self, config: FakeConfig) -> int:
        return config.tokens_per_event if self.tokens_per_event is None else self.tokens_per_event

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def merged(self, patch: Mapping[str, Any]) -> Faults:
        """A copy with `patch` applied; ValueError names the first bad key."""
        current = self.as_dict()
        for key, value in patch.items():
            if key not in current:
                raise ValueError(f"unknown fault field {key!r}")
            current[key] = _check(key, value)
        return Faults(**current)


_RATES = {
    "error_rate",
    "oom_rate",
    "hang_rate",
    "stall_rate",
    "die_rate",
    "rate_limit_rate",
    "overloaded_rate",
    "stream_error_rate",
}
_COUNTS = {"stall_after", "die_after", "die_next", "error_next", "retry_after"}
_OPTIONAL_SECONDS = {"ttft", "per_token"}


def _number(key: str, value: Any) -> float:
    # bool is an int subclass; `true` is never a sensible rate or duration.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number")
    return float(value)


def _check(key: str, value: Any) -> Any:
    if key == "unhealthy":
        if not isinstance(value, bool):
            raise ValueError("unhealthy must be a boolean")
        return value
    if key == "error_message":
        if not isinstance(value, str) or not value:
            raise ValueError("error_message must be a non-empty string")
        return value
    if key in _OPTIONAL_SECONDS and value is None:
        return None
    if key == "tokens_per_event":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("tokens_per_event must be an integer >= 1 or null")
        return value
    number = _number(key, value)
    if key in _RATES:
        if not 0.0 <= number <= 1.0:
            raise ValueError(f"{key} must be between 0 and 1")
        return number
    if key in _COUNTS or key == "error_status":
        if number != int(number):
            raise ValueError(f"{key} must be an integer")
        if key == "error_status" and not 400 <= number <= 599:
            raise ValueError("error_status must be between 400 and 599")
        if number < 0:
            raise ValueError(f"{key} must be >= 0")
        return int(number)
    if number < 0:
        raise ValueError(f"{key} must be >= 0")
    return number
