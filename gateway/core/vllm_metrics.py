"""vLLM's load gauges read out of its Prometheus `/metrics` text, without a full parser.

A vLLM `/metrics` page runs to tens of kilobytes of histograms; only a few gauges matter here, so
each is found by its name at the start of a line and its samples' values are read to the end of
those lines. Several samples (one per `model_name` or engine) are combined: requests waiting
and running add up, cache usage is the fullest engine's. llama.cpp's server exports the same
queue figures under its own names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

# llama.cpp's server (`--metrics`) names its queue of requests beyond its slots "deferred".
WAITING = (b"vllm:num_requests_waiting", b"llamacpp:requests_deferred")
# Requests the engine is running (decoding or prefilling) right now.
RUNNING = (b"vllm:num_requests_running", b"llamacpp:requests_processing")
# vLLM 0.10 renamed the cache gauge; older servers only have the first name.
CACHE_USAGE = (b"vllm:gpu_cache_usage_perc", b"vllm:kv_cache_usage_perc")


def _samples(text: bytes, name: bytes) -> list[float]:
    """The values of every sample of `name` (that exact name, with or without labels)."""
    values: list[float] = []
    needle = b"\n" + name
    at = 0 if text.startswith(name) else _line_after(text.find(needle))
    while at >= 0:
        end = text.find(b"\n", at)
        rest = text[at + len(name) : end if end >= 0 else len(text)]
        if rest[:1] == b"{":
            rest = rest[rest.rfind(b"}") + 1 :]  # label values may hold spaces, not a "}" last
        elif rest[:1] != b" ":
            rest = b""  # another metric whose name only starts with this one
        fields = rest.split()
        if fields:
            try:
                value = float(fields[0])
            except ValueError:
                value = math.nan
            if not math.isnan(value):
                values.append(value)
        if end < 0:
            break
        at = _line_after(text.find(needle, end))
    return values


def _line_after(newline: int) -> int:
    return newline + 1 if newline >= 0 else -1


def _combined(
    text: bytes, names: Iterable[bytes], combine: Callable[[list[float]], float]
) -> float | None:
    for name in names:
        values = _samples(text, name)
        if values:
            return combine(values)
    return None


def read_vllm_load(text: bytes) -> tuple[float | None, float | None]:
    """`(requests waiting, KV-cache usage 0..1)`; None for a gauge the page does not have."""
    return _combined(text, WAITING, sum), _combined(text, CACHE_USAGE, max)


def read_running(text: bytes) -> float | None:
    """Requests the engine runs at once now (summed over engines); None when not exported."""
    return _combined(text, RUNNING, sum)
