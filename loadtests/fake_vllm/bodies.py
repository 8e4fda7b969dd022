"""Request bodies as both of the fake's protocols read them: a JSON object, or a 4xx."""

from __future__ import annotations

import json
from typing import Any


class BadRequest(Exception):
    """A request the fake refuses; each protocol renders it in its own error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise BadRequest(400, f"invalid JSON body: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest(400, "the JSON body must be an object")
    return value
