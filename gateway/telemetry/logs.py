"""Structured logs: one line per event, as `key=value` text or as JSON objects.

Every line is a message plus fields (`extra={"fields": {...}}`): the access line of each
request, each breaker transition, the shared-state connection's changes. Nothing is logged per
stream chunk. Values that come from clients (a model name) are escaped: JSON escapes control
characters itself; the text format writes them as `\\xNN`, and quotes values with spaces, so a
crafted value can never forge a line or a field.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, Literal

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


ACCESS = logging.getLogger("gateway.access")


def enable_access_log(enabled: bool) -> None:
    """The access log has its own switch, whatever the process's log level."""
    ACCESS.setLevel(logging.INFO if enabled else logging.CRITICAL + 1)
    ACCESS.disabled = not enabled
