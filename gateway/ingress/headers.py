"""Header handling in both directions: hop-by-hop removal, forwarding headers, our own headers."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from starlette.types import Scope

from gateway.core.admission import Priority
from gateway.errors import InvalidRequest
from gateway.ingress.forwarded import TrustedProxies
from gateway.pipeline.admit import parse_priority

# RFC 9110 §7.6.1 hop-by-hop headers: they describe one connection, never the exchange.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_RESPONSE_DROP = _HOP_BY_HOP
# Requests also lose what the proxy recomputes itself (host, content-length) and `expect`
# (the body was already received).
_REQUEST_DROP = _HOP_BY_HOP | {b"host", b"content-length", b"expect"}
GATEWAY_PREFIX = b"x-gateway-"
# What an HTTP/1.1 header value may not contain (tab is allowed).
_CONTROL_CHARS = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


def _connection_tokens(value: bytes) -> set[bytes]:
    return {token.strip().lower() for token in value.split(b",") if token.strip()}


class RequestHeaders:
    """What the ingress needs from the client's headers, read in one pass."""

    __slots__ = ("client", "content_length", "forward", "gateway")

    def __init__(self, client: str | None) -> None:
        self.client = client  # the client's address: the peer, or from a trusted proxy's XFF
        self.content_length: int | None = None
        self.forward: list[tuple[str, str]] = []
        self.gateway: dict[bytes, bytes] = {}

    def terms(self, ceiling_s: float) -> tuple[float, Priority | None]:
        """What the client's own headers ask: its time budget (`x-gateway-timeout`, within
        the pool's `ceiling_s`) and its priority class (`x-gateway-priority`; None: the
        pool's default). InvalidRequest when either cannot be read."""
        budget_s = ceiling_s
        asked = self.gateway.get(b"x-gateway-timeout")
        if asked is not None:
            try:
                budget_s = min(budget_s, _positive_seconds(asked))
            except ValueError:
                raise InvalidRequest(
                    "x-gateway-timeout must be a positive number of seconds"
                ) from None
        try:
            priority = parse_priority(self.gateway.get(b"x-gateway-priority"))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return budget_s, priority

    def fallback_allowed(self) -> bool:
        """Whether the client lets its request go to a fallback pool (`x-gateway-fallback:
        off` keeps it on its model's pool); InvalidRequest when the header says neither."""
        asked = self.gateway.get(b"x-gateway-fallback")
        if asked is None:
            return True
        value = asked.strip().lower()
        if value not in (b"on", b"off"):
            raise InvalidRequest("x-gateway-fallback must be on or off")
        return value == b"on"


def _positive_seconds(raw: bytes) -> float:
    value = float(raw)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(raw)
    return value


def split_request_headers(
    raw: Iterable[tuple[bytes, bytes]],
    client_host: str | None,
    scheme: str,
    trusted: TrustedProxies | None = None,
) -> RequestHeaders:
    """Sort the client's headers into the ones to forward and the gateway's own.

    X-Forwarded-For / X-Forwarded-Proto are believed only from a peer in `trusted`: its XFF is
    kept and the peer appended; anyone else's are replaced by the peer and our scheme.
    Raises ValueError for a Content-Length that is not a non-negative integer.
    """
    out = RequestHeaders(client_host)
    forward = out.forward
    named_by_connection: set[bytes] | None = None
    forwarded_for: bytes | None = None
    proto: bytes | None = None
    for name, value in raw:
        if name in _REQUEST_DROP:
            if name == b"connection":
                named_by_connection = (named_by_connection or set()) | _connection_tokens(value)
            elif name == b"content-length":
                if not value.isdigit():
                    raise ValueError("invalid Content-Length")
                out.content_length = int(value)
            continue
        if name.startswith(GATEWAY_PREFIX):
            out.gateway[name] = value
            continue
        if name == b"x-forwarded-for":
            forwarded_for = value if forwarded_for is None else forwarded_for + b", " + value
            continue
        if name == b"x-forwarded-proto":
            proto = value if proto is None else proto
            continue
        forward.append((name.decode("latin-1"), value.decode("latin-1")))
    if named_by_connection:
        forward[:] = [(n, v) for n, v in forward if n.encode("latin-1") not in named_by_connection]
    if not client_host:  # no peer address (a Unix socket): nothing to check nor append
        forward.append(("x-forwarded-proto", scheme))
        return out
    if trusted and client_host in trusted:
        if forwarded_for is not None:
            chain = forwarded_for.decode("latin-1")
            out.client = trusted.client(chain, client_host)
            forward.append(("x-forwarded-for", f"{chain}, {client_host}"))
        else:
            forward.append(("x-forwarded-for", client_host))
        forward.append(("x-forwarded-proto", scheme if proto is None else proto.decode("latin-1")))
    else:
        forward.append(("x-forwarded-for", client_host))
        forward.append(("x-forwarded-proto", scheme))
    return out


def client_address(scope: Scope, trusted: TrustedProxies | None) -> str | None:
    """The client's address as the access log gives it (the peer, or what a trusted proxy's
    X-Forwarded-For says), found as for a proxied request."""
    peer = scope.get("client")
    host: str | None = peer[0] if peer else None
    try:
        headers = split_request_headers(scope["headers"], host, scope["scheme"], trusted)
    except ValueError:  # an invalid Content-Length: the peer, then
        return host
    return headers.client


def response_headers(
    raw: Iterable[tuple[bytes, bytes]], *, drop_length: bool
) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers for the client, names lowercased for ASGI.

    Drops hop-by-hop headers, the gateway's own `x-gateway-*` (an upstream cannot speak for
    the gateway), and any value with control characters: the HTTP server would refuse it only
    after the response had started, leaving the client with nothing. `drop_length` removes
    Content-Length when the body sent may differ from the upstream's (an SSE stream that can
    end with an error event of ours, a 204/304).
    """
    headers: list[tuple[bytes, bytes]] = []
    named_by_connection: set[bytes] = set()
    for name, value in raw:
        lname = name.lower()
        if lname in _RESPONSE_DROP:
            if lname == b"connection":
                named_by_connection |= _connection_tokens(value)
            continue
        if (
            (drop_length and lname == b"content-length")
            or lname.startswith(GATEWAY_PREFIX)
            or _CONTROL_CHARS.search(value)
        ):
            continue
        headers.append((lname, value))
    if named_by_connection:
        headers = [(n, v) for n, v in headers if n not in named_by_connection]
    return headers
