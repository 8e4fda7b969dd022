"""Environment variables in policy values: `${NAME}` and `${NAME:-default}`."""

from __future__ import annotations

import pytest

from gateway.config import parse_policy
from gateway.config.loader import PolicyError

TEXT = """
shared: {redis_url: "redis://:${T_REDIS_PASSWORD}@redis:6379/0", decision_ttl: "${T_TTL:-3s}"}
pools:
  chat:
    models: [m]
    instances:
      - {name: "${T_POD_NAME}", url: "http://127.0.0.1:8000"}
"""


def test_values_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T_REDIS_PASSWORD", "s3cret")
    monkeypatch.setenv("T_POD_NAME", "vllm-llama-8b-2")
    monkeypatch.delenv("T_TTL", raising=False)
    policy = parse_policy(TEXT)
    assert policy.shared is not None
    assert policy.shared.redis_url == "redis://:s3cret@redis:6379/0"
    assert policy.shared.decision_ttl == 3.0  # the default, parsed like any duration
    assert policy.pools["chat"].instances[0].name == "vllm-llama-8b-2"


def test_a_value_cannot_change_the_file_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T_REDIS_PASSWORD", "x")
    monkeypatch.setenv("T_POD_NAME", "a}\n  evil: {url: http://attacker")
    with pytest.raises(PolicyError, match=r"instances\[0\]\.name: invalid name"):
        parse_policy(TEXT)  # one (invalid) name, never a new key


def test_an_empty_variable_takes_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T_REDIS_PASSWORD", "x")
    monkeypatch.setenv("T_POD_NAME", "a")
    monkeypatch.setenv("T_TTL", "")
    policy = parse_policy(TEXT)
    assert policy.shared is not None and policy.shared.decision_ttl == 3.0
