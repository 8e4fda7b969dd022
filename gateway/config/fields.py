"""What every section of the policy is built from: the strict base model, the field types
checked on their own, and the switches that turn a section off."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class Strict(BaseModel):
    """Unknown keys are errors: a typo must never fall back to a default silently."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _check_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("a path must start with '/'")
    return value


UrlPath = Annotated[str, AfterValidator(_check_path)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Smoothing = Annotated[float, Field(ge=0.0, lt=1.0)]
# A header's name, lower-cased: an HTTP token.
TOKEN_RE = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")


def off_or_defaults(value: object) -> object:
    """`section: false` turns an optional-with-defaults section off (None); `true`, or the key
    with no value, keeps its defaults."""
    if value is False:
        return None
    if value is True or value is None:
        return {}
    return value


def switch(value: object) -> object:
    """`section: false` turns a section off, `section: true` keeps its defaults."""
    if value is False:
        return {"enabled": False}
    if value is True:
        return {}
    return value
