"""Server-sent events as the gateway reads them when it has to look inside a stream.

The relay forwards a stream's bytes without parsing them; these helpers serve the rare paths
(a stream to resume, an engine's error event to find): splitting a run of complete events,
reading one event's name and data, and writing one.
"""

from __future__ import annotations

import re
from typing import Final


def event_boundary(data: bytes | bytearray, start: int = 0) -> int:
    """Length of the prefix of `data` made of complete SSE events (ending in a blank line:
    the spec's lines end in LF, CRLF or CR alone), looking from `start` on; 0 if none."""
    lf = data.rfind(b"\n\n", start)
    crlf = data.rfind(b"\r\n\r\n", start)
    cr = data.rfind(b"\r\r", start)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0, cr + 2 if cr >= 0 else 0)


_BLANK_LINE: Final = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def split_events(data: bytes) -> list[bytes]:
    """The events of `data`, a run of complete events, each with its blank line (an
    unterminated rest is the last item). One pass, linear in `data`.

    Line ends are kept as they came, so an event forwarded from this list is byte for byte the
    upstream's."""
    if b"\r" not in data:  # the usual case: LF line ends
        parts = data.split(b"\n\n")
        events = [part + b"\n\n" for part in parts[:-1]]
        if parts[-1]:
            events.append(parts[-1])
        return events
    events = []
    start = 0
    for match in _BLANK_LINE.finditer(data):
        events.append(data[start : match.end()])
        start = match.end()
    if start < len(data):
        events.append(data[start:])
    return events


def parse_event(event: bytes) -> tuple[str | None, str]:
    """An event's name (`event:` field, None when absent) and its data (the `data:` lines
    joined by LF, as the SSE spec assembles them). Comments and other fields are ignored."""
    if (
        event.startswith(b"data: ")
        and event.find(b"\n") == len(event) - 2
        and event.endswith(b"\n\n")
        and b"\r" not in event
    ):
        # How vLLM and llama.cpp write every event: one data line. Read in C, without the
        # line-by-line walk below (a whole answer fetched as a stream reads each of its events).
        return None, event[6:-2].decode("utf-8", "replace")
    return parse_lines(event)


def parse_lines(event: bytes) -> tuple[str | None, str]:
    """`parse_event` for any event, line by line."""
    name: str | None = None
    data: list[str] = []
    text = event.decode("utf-8", "replace")
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not line or line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "event":
            name = value
    return name, "\n".join(data)


def format_event(data: str, name: str | None = None) -> bytes:
    """One event: `event: NAME` when named, then its data (one `data:` line per line)."""
    lines = [f"event: {name}"] if name is not None else []
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()
