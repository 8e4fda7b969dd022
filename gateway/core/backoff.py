"""How long to wait before a retry: our own backoff, or what the backend asked for."""

from __future__ import annotations

import math
import random
from datetime import UTC
from email.utils import parsedate_to_datetime

# 2**62 times any sane base is far above any cap: stops the float from overflowing.
_MAX_DOUBLINGS = 62


def backoff_s(
    attempt: int, base_s: float, cap_s: float, rng: random.Random, fixed: float = 0.0
) -> float:
    """Exponential backoff with full jitter before retry number `attempt` (1 for the first).

    `uniform(0, min(cap_s, base_s·2^(attempt-1)))`: the full jitter spreads the retries of
    requests that failed together (AWS Architecture Blog, "Exponential Backoff and Jitter").
    `fixed`: the share of that ceiling always waited, the jitter spread over the rest (0.5 is
    the blog's "equal jitter": a wait that must give something time to come back).
    Raises ValueError when `attempt` < 1.
    """
    if attempt < 1:
        raise ValueError(f"retry numbers start at 1, got {attempt}")
    ceiling = min(cap_s, base_s * 2.0 ** min(attempt - 1, _MAX_DOUBLINGS))
    return rng.uniform(fixed * ceiling, ceiling)


def rate_limit_pause_s(in_row: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """How long an instance that answered 429 without a usable Retry-After is left alone, after
    `in_row` such answers in a row (1 for the first).

    Equal jitter from twice the base: `uniform(c/2, c)`, `c = min(cap_s, 2·base_s·2^(in_row-1))`;
    so at least `base_s`, `2·base_s`, `4·base_s`... until the cap halves it: a backend that
    rate-limits without saying for how long gets a pause that grows while it goes on refusing
    (the client's SDK would back off so), and the spread keeps the requests that waited it out
    together from all coming back at once. Raises ValueError when `in_row` < 1.
    """
    return backoff_s(in_row, 2.0 * base_s, cap_s, rng, fixed=0.5)


def _delta_seconds(text: str, scale: float) -> float | None:
    try:
        value = float(text) * scale
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0.0 else None


def _http_date_delta(text: str, now_wall: float) -> float | None:
    try:
        when = parsedate_to_datetime(text)
    except (ValueError, TypeError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # asctime dates carry no zone; HTTP-dates are always GMT
        when = when.replace(tzinfo=UTC)
    return when.timestamp() - now_wall


def retry_after_s(
    retry_after: str | None,
    retry_after_ms: str | None,
    *,
    now_wall: float,
    cap_s: float,
) -> float | None:
    """The wait a backend asked for, in seconds, at most `cap_s`; None when it asked nothing usable.

    - `retry-after-ms` (OpenAI's header: milliseconds, decimals allowed) wins when it parses;
    - else `Retry-After`: delta-seconds (decimals accepted, as clients such as OpenAI's SDK do),
      or an HTTP-date, counted from `now_wall` (wall-clock seconds since the epoch, as
      `time.time()`: the backend's date is wall-clock too);
    - None for absent, unparsable, non-finite or negative values, and for a date in the past
      (most likely clock skew: the caller's own backoff is the better guess).
    """
    value: float | None = None
    if retry_after_ms is not None:
        value = _delta_seconds(retry_after_ms, 0.001)
    if value is None and retry_after is not None:
        value = _delta_seconds(retry_after, 1.0)
        if value is None:
            value = _http_date_delta(retry_after, now_wall)
            if value is not None and value < 0.0:
                value = None
    return None if value is None else min(value, cap_s)
