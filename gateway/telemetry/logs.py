"""Structured logs: one line per event, as `key=value` text or as JSON objects.

Every line is a message plus fields (`extra={"fields": {...}}`): the access line of each
request, each breaker transition, the shared-state connection's changes. Nothing is logged per
stream chunk. Values that come from clients (a model name) are escaped: JSON escapes control
characters itself; the text format writes them as `\\xNN`, and quotes values with spaces, so a
crafted value can never forge a line or a field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Hashable
from typing import Any, Literal, TextIO

LogFormat = Literal["text", "json"]

_UNSAFE = re.compile(r'[\x00-\x1f\x7f-\x9f"\\]')
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\\": "\\\\"}


def escape(value: str) -> str:
    """A client-supplied string made safe for a one-line `key=value` log."""
    text = _UNSAFE.sub(lambda m: _ESCAPES.get(m.group(), f"\\x{ord(m.group()):02x}"), value)
    if not text or " " in text or "=" in text or text != value:
        return f'"{text}"'
    return text


def _text_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return escape(str(value))


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if fields:
            data.update(fields)
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, separators=(",", ":"), default=str)


def configure_logging(level: str, log_format: LogFormat) -> None:
    """One handler on stderr, in the chosen format, for every logger of the process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))


class LogThrottle:
    """At most one line per key per interval, with the count of the events held back between.

    For events that can repeat hundreds of times a second (a breaker trip the isolation cap
    refuses, connections an attacker gets refused): the first is logged at once, the rest of
    the interval only counted, and the next line after it carries that count. Keys must come
    from a bounded set (pools and instances, fixed reasons): one entry per key is kept.
    """

    __slots__ = ("_clock", "_interval_s", "_keys")

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._keys: dict[Hashable, tuple[float, int]] = {}  # last logged at, held back since

    def admit(self, key: Hashable, now: float | None = None) -> int | None:
        """None: hold this event back (it is counted). Otherwise log it: the value is how many
        events of `key` were held back since its previous line (0 for its first)."""
        now = self._clock() if now is None else now
        last = self._keys.get(key)
        if last is not None and now - last[0] < self._interval_s:
            self._keys[key] = (last[0], last[1] + 1)
            return None
        self._keys[key] = (now, 0)
        return 0 if last is None else last[1]

    def clear(self) -> None:
        self._keys.clear()


class AccessLog:
    """The access log: one line per request, in the process's log format, written in batches.

    Going through `logging` (a record, a formatter, a locked write and flush per line) cost a
    third of the gateway's throughput; here a line is one f-string or one `json.dumps`, kept
    in a buffer that goes out in one write at most every 50 ms (or every 256 lines). The same
    shape as the other lines: `TextFormatter`'s prefix, or `JsonFormatter`'s keys.
    """

    FLUSH_AFTER_S = 0.05
    FLUSH_LINES = 256

    def __init__(self, log_format: LogFormat, stream: TextIO | None = None) -> None:
        self._json = log_format == "json"
        self._stream = stream
        self._lines: list[str] = []
        self._timer: asyncio.TimerHandle | None = None
        self._second = -1
        self._stamp = ""

    def write(self, fields: dict[str, Any]) -> None:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime(
                "%Y-%m-%dT%H:%M:%S" if self._json else "%Y-%m-%d %H:%M:%S", time.gmtime(now)
            )
        millis = int((now - second) * 1000)
        if self._json:
            data = {
                "ts": f"{self._stamp}.{millis:03d}Z",
                "level": "info",
                "logger": "gateway.access",
                "msg": "access",
                **fields,
            }
            line = json.dumps(data, separators=(",", ":"), default=str)
        else:
            pairs = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
            line = f"{self._stamp},{millis:03d} INFO gateway.access access {pairs}"
        self._lines.append(line + "\n")
        if len(self._lines) >= self.FLUSH_LINES:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.FLUSH_AFTER_S, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._lines:
            stream = self._stream or sys.stderr
            stream.write("".join(self._lines))
            stream.flush()
            self._lines.clear()


class AccessLogSwitch:
    """The access log, on or off as the policy says (a reload may switch it), always in the
    format chosen at startup (`--log-format` or `telemetry.log_format`)."""

    def __init__(self, log_format: LogFormat, enabled: bool) -> None:
        self._format = log_format
        self.current: AccessLog | None = AccessLog(log_format) if enabled else None

    def set(self, enabled: bool) -> AccessLog | None:
        """Turn it on or off. One turned off writes its buffered lines first (which also
        cancels its flush timer); nothing writes to it afterwards, so no timer is armed on it
        again. Returns the one now in use."""
        current = self.current
        if enabled == (current is not None):
            return current
        if current is not None:
            current.flush()
        self.current = AccessLog(self._format) if enabled else None
        return self.current

    def flush(self) -> None:
        if self.current is not None:
            self.current.flush()
