"""One error tree for everything the gateway answers by itself, and one mapping from the upstream
client's exceptions into it.

Each error knows its HTTP status and renders as OpenAI-style JSON:
`{"error": {"message": ..., "type": ..., "code": ...}}`. Its code also goes out as the
`x-gateway-error` response header, in every route's dialect: it is what tells the gateway's own
answer from a backend's (an Anthropic-shaped body has no code).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Final

from gateway.core.outcome import Outcome, Phase

ERROR_HEADER: Final = b"x-gateway-error"


def error_header(code: str) -> tuple[bytes, bytes]:
    return (ERROR_HEADER, code.encode())


class GatewayError(Exception):
    """Base of every error the gateway answers by itself."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "gateway_error"
    code: ClassVar[str] = "internal_error"
    # `x-gateway-error: <code>`, encoded once per class rather than per answer.
    header: ClassVar[tuple[bytes, bytes]] = error_header(code)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.header = error_header(cls.code)

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def body(self) -> bytes:
        payload = {"error": {"message": self.message, "type": self.type, "code": self.code}}
        return json.dumps(payload, separators=(",", ":")).encode()


# --- the client's fault (4xx) ---------------------------------------------------------------


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow  # the Allow header a 405 must carry


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Shed(GatewayError):
    """Admission refused the request for now; Retry-After says when to come back."""

    status = 429
    type = "rate_limit_error"
    code = "shed"


# --- the backends' fault (5xx) --------------------------------------------------------------


class UpstreamError(GatewayError):
    """The upstream attempt failed; `kind` names the failure for the retry policy."""

    status = 502
    type = "upstream_error"
    code = "upstream_failed"
    kind: ClassVar[str] = "error"
    # The gateway's own limit, not the instance's doing: never charged to the instance.
    local: ClassVar[bool] = False
    # Whether the attempt it ends is accounted (a stream the gateway moved elsewhere is not).
    counted: ClassVar[bool] = True

    @property
    def outcome(self) -> Outcome:
        """The attempt's result for retries, the failure rate and the breaker."""
        return _PROTOCOL


class UpstreamConnectError(UpstreamError):
    """No connection to the instance. `refused`: it actively refused one (nothing listens on
    its port: stopped, restarting, crashed), which says it is down, where a DNS, TLS or routing
    failure may be the network's or the configuration's."""

    code = "upstream_connect_failed"
    kind = "connect_failure"

    def __init__(
        self, message: str, *, refused: bool = False, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.refused = refused

    @property
    def outcome(self) -> Outcome:
        return _CONNECT_FAILURE


class UpstreamConnectionLimit(UpstreamConnectError):
    """Every connection the pool's policy allows to the instance is busy, and none came free
    within the connect timeout: retried elsewhere, never the instance's failure."""

    status = 503
    code = "upstream_connection_limit"
    local = True


class UpstreamReset(UpstreamError):
    code = "upstream_reset"
    kind = "reset"

    @property
    def outcome(self) -> Outcome:
        return _RESET


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"
    kind = "protocol"


class UpstreamLeft(UpstreamError):
    """The gateway moved a stream off its instance (isolated, or too slow) to continue it on
    another: not the instance's failure on its own, and not counted as one."""

    code = "upstream_left"
    counted: ClassVar[bool] = False

    def __init__(self, reason: str) -> None:
        super().__init__(f"the stream left its instance ({reason})")
        self.reason = reason  # isolated, slow


class UpstreamStreamCut(UpstreamProtocolError):
    """A stream that ended cleanly before its protocol's last event: as broken as a reset."""

    code = "upstream_stream_cut"


class UpstreamStreamError(UpstreamProtocolError):
    """The engine's own error event inside a stream (vLLM's `data: {"error": ...}`,
    Anthropic's `event: error`)."""

    code = "upstream_stream_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"
    kind = "timeout"

    def __init__(self, message: str, *, phase: Phase) -> None:
        super().__init__(message)
        self.phase = phase

    @property
    def outcome(self) -> Outcome:
        return Outcome.from_error("timeout", self.phase)


_PROTOCOL = Outcome.from_error("protocol")
_CONNECT_FAILURE = Outcome.from_error("connect_failure", Phase.CONNECT)
_RESET = Outcome.from_error("reset")


class NoInstanceAvailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_instance_available"


class InstancesPaused(NoInstanceAvailable):
    """Every instance that could take the request asked for a pause (a Retry-After, or the
    backoff after a 429 without one): `retry_after_s` is when the first of them ends it. The
    retry loop waits that long when the request's deadline allows; else the client gets it."""


def map_upstream_exception(exc: BaseException, *, phase: Phase) -> UpstreamError:
    """The gateway's error for an exception raised while talking to a backend. The data
    plane's client raises the gateway's own errors already; anything else that escapes it (a
    socket error while writing, a bug) is named here.

    `phase` says where it happened (`connect`, `first_byte`, `body`) so a timeout is named by
    the phase whose deadline ran out.
    """
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"the upstream timed out ({phase})", phase=phase)
    if isinstance(exc, ConnectionError):
        return UpstreamReset(f"the upstream closed the connection ({phase})")
    return UpstreamError(f"the upstream request failed: {type(exc).__name__}")


class ShuttingDown(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "shutting_down"


def shutting_down() -> ShuttingDown:
    return ShuttingDown("the gateway is shutting down", retry_after_s=1.0)
