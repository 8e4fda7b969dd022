"""Client authentication on the data plane (the policy's optional `auth` section).

A client presents one of the configured API keys as `Authorization: Bearer <key>` or
`x-api-key: <key>`; anything else gets a 401 in the gateway's error shape with
`www-authenticate: Bearer`. `/healthz` and `/readyz` stay open (probes carry no key).

The keys are kept as SHA-256 digests only, and the presented key's digest is compared with
every one of them in constant time (`hmac.compare_digest`, no early exit), so the answer's
timing tells neither how much of a key was right nor which key matched.

One `ClientAuth` lives as long as the data plane: a policy reload swaps its keys in place, so a
rotated key file or variable takes effect at the next reload without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from gateway.config.models import AuthPolicy
from gateway.config.routes import MESSAGES_PATH

# The paths that never ask for a key: Kubernetes probes and load balancers call them.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})

_BEARER = b"bearer "
_MESSAGE = "missing or invalid API key: send Authorization: Bearer <key> or x-api-key: <key>"
_OPENAI_BODY = json.dumps(
    {"error": {"message": _MESSAGE, "type": "authentication_error", "code": "invalid_api_key"}},
    separators=(",", ":"),
).encode()
# Anthropic's clients read their own error shape.
_ANTHROPIC_BODY = json.dumps(
    {"type": "error", "error": {"type": "authentication_error", "message": _MESSAGE}},
    separators=(",", ":"),
).encode()


def _headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
        (b"x-gateway-error", b"invalid_api_key"),
    ]


_OPENAI_HEADERS = _headers(_OPENAI_BODY)
_ANTHROPIC_HEADERS = _headers(_ANTHROPIC_BODY)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key a client presented: `Authorization: Bearer <key>` first, else `x-api-key`."""
    api_key: bytes | None = None
    for name, value in headers:
        if name == b"authorization":
            if value[:7].lower() == _BEARER:
                return value[7:].strip()
        elif name == b"x-api-key" and api_key is None:
            api_key = value.strip()
    return api_key


class ClientAuth:
    """The configured keys (as digests) and the check; `enabled` is False without `auth`."""

    __slots__ = ("_digests", "enabled")

    def __init__(self, policy: AuthPolicy | None = None) -> None:
        self._digests: tuple[bytes, ...] = ()
        self.enabled = False
        self.update(policy)

    def update(self, policy: AuthPolicy | None) -> None:
        """Take the keys of a (re)loaded policy."""
        self._digests = tuple(_digest(k.encode()) for k in policy.keys) if policy else ()
        self.enabled = bool(self._digests)

    def allows(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        key = presented_key(headers)
        if not key:
            return False
        given = _digest(key)
        matched = False
        for digest in self._digests:  # every key, whatever matched before: constant time
            matched |= hmac.compare_digest(given, digest)
        return matched


async def send_unauthorized(send: Callable[[dict[str, Any]], Awaitable[None]], path: str) -> None:
    """The 401, in the error shape of the route's API."""
    if path == MESSAGES_PATH:
        body, headers = _ANTHROPIC_BODY, _ANTHROPIC_HEADERS
    else:
        body, headers = _OPENAI_BODY, _OPENAI_HEADERS
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
