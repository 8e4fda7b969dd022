"""Requests the ingress answers itself before any routing: counted by reason, logged sparingly.

The HTTP protocol (`gateway.ingress.protocol`) refuses slow or oversized requests and those
above the connection cap; the data plane refuses clients without a valid API key. Each refusal
is a plain increment here (read by /metrics and /admin/state at scrape time), a debug line, and
at most one WARNING line per reason per interval: under an attack the log stays readable and
its volume bounded, while the counter keeps the exact figure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from gateway.telemetry.logs import LogThrottle

log = logging.getLogger("gateway.ingress")

HEADER_TIMEOUT: Final = "header_timeout"
BODY_TIMEOUT: Final = "body_timeout"
URI_TOO_LONG: Final = "uri_too_long"
HEADERS_TOO_LARGE: Final = "headers_too_large"
TOO_MANY_HEADERS: Final = "too_many_headers"
OVER_CAPACITY: Final = "over_capacity"
UNAUTHORIZED: Final = "unauthorized"
# A fixed set: every reason is exported from the start (at 0), so alerts see the series.
REASONS: Final = (
    HEADER_TIMEOUT,
    BODY_TIMEOUT,
    URI_TOO_LONG,
    HEADERS_TOO_LARGE,
    TOO_MANY_HEADERS,
    OVER_CAPACITY,
    UNAUTHORIZED,
)

SUMMARY_INTERVAL_S = 10.0


class IngressRefusals:
    """Refusals of one listener (`plane`: "data" or "admin"), by reason."""

    __slots__ = ("_throttle", "counts", "plane")

    def __init__(self, plane: str = "data", clock: Callable[[], float] = time.monotonic) -> None:
        self.plane = plane
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._throttle = LogThrottle(SUMMARY_INTERVAL_S, clock)

    def count(self, reason: str, client: str | None) -> None:
        """One refusal, from a client address (never anything the client sent with it)."""
        counts = self.counts
        counts[reason] += 1
        log.debug(
            "request refused",
            extra={"fields": {"plane": self.plane, "reason": reason, "client": client}},
        )
        held = self._throttle.admit(reason)
        if held is not None:
            fields = {
                "plane": self.plane,
                "reason": reason,
                # Since this reason's previous summary line: the held-back ones and this one.
                "refused": held + 1,
                "total": counts[reason],
                "last_client": client,
            }
            log.warning("requests refused by the ingress", extra={"fields": fields})
