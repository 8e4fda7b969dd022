"""An engine's load gauges read out of its Prometheus `/metrics` text, without a full parser.

A vLLM `/metrics` page runs to tens of kilobytes of histograms; only a few gauges matter here, so
each is found by its name at the start of a line and its samples' values are read to the end of
those lines. Several samples (one per `model_name` or engine) are combined: requests waiting
and running add up, cache usage is the fullest engine's, KV-cache sizes add up over engines.
llama.cpp's server, SGLang and TGI export the same queue figures under their own names (SGLang
its cache usage too; none of them a cache size this reads).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# llama.cpp's server (`--metrics`) names its queue of requests beyond its slots "deferred";
# SGLang and Hugging Face's TGI export the same figures under their own names.
WAITING = (
    b"vllm:num_requests_waiting",
    b"llamacpp:requests_deferred",
    b"sglang:num_queue_reqs",
    b"tgi_queue_size",
)
# Requests the engine is running (decoding or prefilling) right now.
RUNNING = (
    b"vllm:num_requests_running",
    b"llamacpp:requests_processing",
    b"sglang:num_running_reqs",
    b"tgi_batch_current_size",
)
# vLLM 0.10 renamed the cache gauge; older servers only have the first name.
CACHE_USAGE = (b"vllm:gpu_cache_usage_perc", b"vllm:kv_cache_usage_perc", b"sglang:token_usage")
# vLLM's cache settings as labels of an info gauge: the KV cache holds blocks x block size tokens.
CACHE_CONFIG = b"vllm:cache_config_info"
_LABEL = re.compile(rb'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What one read of an engine's page says; None for what it does not export."""

    waiting: float | None = None  # requests in the engine's own queue
    running: float | None = None  # requests it runs at once now
    cache_usage: float | None = None  # share of its KV cache in use, 0..1
    kv_tokens: int | None = None  # the size of its KV cache, in tokens

    @property
    def empty(self) -> bool:
        """No load gauge at all: not an engine this gateway can read."""
        return self.waiting is None and self.running is None and self.cache_usage is None


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


def read_engine_load(text: bytes) -> EngineLoad:
    """Every gauge the page has (see `EngineLoad`)."""
    return EngineLoad(
        _combined(text, WAITING, sum),
        _combined(text, RUNNING, sum),
        _combined(text, CACHE_USAGE, max),
        read_kv_tokens(text),
    )


def read_kv_tokens(text: bytes) -> int | None:
    """vLLM's KV-cache size in tokens, `num_gpu_blocks x block_size` from `cache_config_info`
    (added up over its engines); None when the page does not say (or says "None")."""
    total = 0
    needle = b"\n" + CACHE_CONFIG + b"{"
    at = 0 if text.startswith(CACHE_CONFIG + b"{") else _line_after(text.find(needle))
    while at >= 0:
        end = text.find(b"\n", at)
        labels = dict(_LABEL.findall(text[at : end if end >= 0 else len(text)]))
        blocks, size = labels.get(b"num_gpu_blocks", b""), labels.get(b"block_size", b"")
        if blocks.isdigit() and size.isdigit():
            total += int(blocks) * int(size)
        if end < 0:
            break
        at = _line_after(text.find(needle, end))
    return total or None
