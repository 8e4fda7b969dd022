"""The README's policy reference names every key the policy model accepts."""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from gateway.config.models import Policy

README = Path(__file__).resolve().parents[1] / "README.md"


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (Union, UnionType, dict, tuple, list):
        return [m for arg in get_args(annotation) for m in _models(arg)]
    return [m for arg in get_args(annotation) for m in _models(arg)]


def policy_keys(model: type[BaseModel] = Policy) -> set[str]:
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        keys.add(field.alias or name)
        for sub in _models(field.annotation):
            keys |= policy_keys(sub)
    return keys


def test_every_policy_key_is_in_the_readme() -> None:
    text = README.read_text()
    missing = sorted(key for key in policy_keys() if f"{key}:" not in text)
    assert not missing, f"README.md does not document: {missing}"


def test_the_walk_reaches_nested_sections() -> None:
    keys = policy_keys()
    assert {"pools", "admission", "vllm_signals", "max_cache_usage", "trusted_proxies"} <= keys
