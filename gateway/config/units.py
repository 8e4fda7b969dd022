"""Durations (`250ms`, `3s`, `2m`) and sizes (`64KiB`, `8MiB`) as policy files write them."""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import BeforeValidator

_DURATION_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(us|ms|s|m|h)?\s*$")
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

_SIZE_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$")
_SIZE_UNITS = {
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
}


def parse_duration(value: object) -> float:
    """Seconds from `250ms`, `3s`, `1.5m`, `1h`, `500us`, or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 250ms, 3s or 2m")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value)
        if not match:
            raise ValueError(f"invalid duration {value!r}: use a number with us, ms, s, m or h")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    else:
        raise ValueError("expected a duration such as 250ms, 3s or 2m")
    if not math.isfinite(seconds):
        raise ValueError("a duration must be a finite number")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from `64KiB`, `8MiB`, `1GB`, or a bare number of bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 64KiB or 8MiB")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match:
            raise ValueError(
                f"invalid size {value!r}: use a number with B, KiB, MiB, GiB (or KB, MB, GB)"
            )
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"])
    else:
        raise ValueError("expected a size such as 64KiB or 8MiB")
    if size < 0:
        raise ValueError("a size cannot be negative")
    return size


Duration = Annotated[float, BeforeValidator(parse_duration)]
"""Seconds, written in a policy as `250ms`, `3s`, `2m`..."""

Size = Annotated[int, BeforeValidator(parse_size)]
"""Bytes, written in a policy as `64KiB`, `8MiB`..."""
