"""Where a pool hands a request over when it cannot answer it, as the policy sets it: the
fallback pools in order (and the model to ask there), the pools for a prompt too long for the
pool's context window, and the causes that hand over. `checks.fallback_errors` checks the graph
they make (unknown pools, loops, depth)."""

from __future__ import annotations

from typing import Annotated, Final, Literal, get_args

from pydantic import AfterValidator, BeforeValidator, Field

from gateway.config.fields import Strict

# Why a pool could not answer (`gateway_fallbacks_total{reason}`):
# - unavailable: no instance could take the request (all down, isolated or refusing
#   connections);
# - shed: the pool's admission refused it (queue full, waited too long);
# - retries_exhausted: its attempts failed (timed out, reset, broke) and no retry was left;
# - rate_limited: a 429 after the retries the pool allows;
# - server_error: a 5xx (529 included) after those retries;
# - context_length: the prompt does not fit the model's context window (a 400 as vLLM,
#   llama.cpp, OpenAI or Anthropic word it). Handed only to `context_fallbacks`, always.
FallbackCause = Literal["unavailable", "shed", "retries_exhausted", "rate_limited", "server_error"]
FALLBACK_CAUSES: Final[tuple[FallbackCause, ...]] = get_args(FallbackCause)
CONTEXT_LENGTH: Final = "context_length"
# The longest chain of hand-overs the policy may describe (A -> B -> C -> D), and so the most
# pools one request is tried on besides its own: each costs the client a wait.
MAX_FALLBACK_DEPTH: Final = 3

Api = Literal["openai", "anthropic"]


def _as_target(value: object) -> object:
    """`- pool-b` is `- {pool: pool-b}`: the model is then the pool's first."""
    return {"pool": value} if isinstance(value, str) else value


class FallbackTarget(Strict):
    """One pool a request may be handed over to, and the model asked there (absent: the first
    of that pool's `models`). The request's body is sent with that `model`."""

    pool: str
    model: Annotated[str, Field(min_length=1)] | None = None


Target = Annotated[FallbackTarget, BeforeValidator(_as_target)]


def _no_duplicates(targets: tuple[FallbackTarget, ...]) -> tuple[FallbackTarget, ...]:
    seen: set[tuple[str, str | None]] = set()
    for target in targets:
        key = (target.pool, target.model)
        if key in seen:
            raise ValueError(f"pool {target.pool!r} is listed twice")
        seen.add(key)
    return targets


Targets = Annotated[tuple[Target, ...], AfterValidator(_no_duplicates)]
