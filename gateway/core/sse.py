"""Server-sent events as the gateway reads them when it has to look inside a stream.

The relay forwards a stream's bytes without parsing them; these helpers serve the rare paths
(a stream to resume, an engine's error event to find): splitting a run of complete events,
reading one event's name and data, and writing one.
"""

from __future__ import annotations


def event_boundary(data: bytes | bytearray, start: int = 0) -> int:
    """Length of the prefix of `data` made of complete SSE events (ending in a blank line:
    the spec's lines end in LF, CRLF or CR alone), looking from `start` on; 0 if none."""
    lf = data.rfind(b"\n\n", start)
    crlf = data.rfind(b"\r\n\r\n", start)
    cr = data.rfind(b"\r\r", start)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0, cr + 2 if cr >= 0 else 0)


def split_events(data: bytes) -> list[bytes]:
    """The events of `data`, a run of complete events, each with its blank line.

    Line ends are kept as they came, so an event forwarded from this list is byte for byte the
    upstream's."""
    events: list[bytes] = []
    start = 0
    size = len(data)
    while start < size:
        end = _event_end(data, start)
        if end < 0:
            events.append(data[start:])
            break
        events.append(data[start:end])
        start = end
    return events


def _event_end(data: bytes, start: int) -> int:
    """Where the event starting at `start` ends (after its blank line), or -1."""
    best = -1
    for terminator in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        at = data.find(terminator, start)
        if at >= 0 and (best < 0 or at + len(terminator) < best):
            best = at + len(terminator)
    return best


def parse_event(event: bytes) -> tuple[str | None, str]:
    """An event's name (`event:` field, None when absent) and its data (the `data:` lines
    joined by LF, as the SSE spec assembles them). Comments and other fields are ignored."""
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
