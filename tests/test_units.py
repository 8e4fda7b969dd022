"""Durations and sizes as policy files write them, and the defaults a minimal policy gets."""

from __future__ import annotations

import pytest
import yaml

from gateway.config import parse_policy, split_host_port
from gateway.config.units import parse_duration, parse_size

MiB = 1024 * 1024

GOOD_DURATIONS: list[tuple[object, float]] = [
    (0, 0.0),
    (3, 3.0),
    (1.5, 1.5),
    ("3", 3.0),
    ("0.5", 0.5),
    ("250ms", 0.25),
    ("1.5s", 1.5),
    ("3s", 3.0),
    ("2m", 120.0),
    ("1.5m", 90.0),
    ("1h", 3600.0),
    ("500us", 0.0005),
    (" 3s ", 3.0),
    ("3 s", 3.0),
    ("0ms", 0.0),
]

BAD_DURATIONS: list[tuple[object, str]] = [
    (True, "expected a duration"),
    (False, "expected a duration"),
    (None, "expected a duration"),
    ([1], "expected a duration"),
    (-1, "negative"),
    (-0.5, "negative"),
    ("3 parsecs", "invalid duration"),
    ("1d", "invalid duration"),
    ("3sec", "invalid duration"),
    ("ms", "invalid duration"),
    ("", "invalid duration"),
    ("   ", "invalid duration"),
    ("-1s", "negative"),
    (float("inf"), "finite"),
    (float("nan"), "finite"),
    ("1,5s", "invalid duration"),
]

GOOD_SIZES: list[tuple[object, int]] = [
    (0, 0),
    (1024, 1024),
    ("100", 100),
    ("512B", 512),
    ("64KiB", 64 * 1024),
    ("8MiB", 8 * MiB),
    ("1GiB", 1024 * MiB),
    ("2KB", 2000),
    ("5MB", 5_000_000),
    ("1GB", 1_000_000_000),
    ("1.5KiB", 1536),
    (" 8 MiB ", 8 * MiB),
]

BAD_SIZES: list[tuple[object, str]] = [
    (True, "expected a size"),
    (False, "expected a size"),
    (None, "expected a size"),
    (1.5, "expected a size"),
    (-1, "negative"),
    ("8 MiBs", "invalid size"),
    ("1TB", "invalid size"),
    ("lots", "invalid size"),
    ("", "invalid size"),
    ("-1KiB", "negative"),
]


@pytest.mark.parametrize(("value", "seconds"), GOOD_DURATIONS, ids=repr)
def test_parse_duration_good(value: object, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds)
    assert isinstance(parse_duration(value), float)


@pytest.mark.parametrize(("value", "message"), BAD_DURATIONS, ids=repr)
def test_parse_duration_bad(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_duration(value)


@pytest.mark.parametrize(("value", "size"), GOOD_SIZES, ids=repr)
def test_parse_size_good(value: object, size: int) -> None:
    result = parse_size(value)
    assert result == size
    assert type(result) is int


@pytest.mark.parametrize(("value", "message"), BAD_SIZES, ids=repr)
def test_parse_size_bad(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(value)


@pytest.mark.parametrize(
    ("value", "parts"),
    [
        ("0.0.0.0:8080", ("0.0.0.0", 8080)),
        ("127.0.0.1:9901", ("127.0.0.1", 9901)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:9901", ("::1", 9901)),
    ],
)
def test_split_host_port_good(value: str, parts: tuple[str, int]) -> None:
    assert split_host_port(value) == parts


@pytest.mark.parametrize("value", ["localhost", "8080", ":8080", "host:http", "host:65536", ""])
def test_split_host_port_bad(value: str) -> None:
    with pytest.raises(ValueError):
        split_host_port(value)


# --- defaults of a minimal policy (DESIGN.md §4) ---------------------------------------------

MINIMAL = """\
pools:
  chat:
    models: [demo-chat]
    instances:
      - {name: a, url: http://10.0.0.11:8000/}
"""


def test_minimal_policy_defaults() -> None:
    policy = parse_policy(MINIMAL, "minimal.yaml")
    assert policy.listen == "0.0.0.0:8080"
    assert policy.admin.listen == "127.0.0.1:9901"
    assert policy.admin.token_env == "GATEWAY_ADMIN_TOKEN"
    assert policy.limits.max_request_bytes == 8 * MiB
    assert policy.shared is None
    assert policy.telemetry.service_name == "llm-gateway"

    pool = policy.pools["chat"]
    assert pool.models == ("demo-chat",)
    assert [(i.name, i.url) for i in pool.instances] == [("a", "http://10.0.0.11:8000")]

    assert pool.health.enabled is True
    assert pool.health.path == "/health"
    assert pool.health.interval == 2.0
    assert pool.health.timeout == 1.0

    timeouts = pool.timeouts
    assert timeouts.smoothing == 0.85
    assert timeouts.initial == 30.0
    assert timeouts.min_samples == 10
    assert timeouts.floor == 0.25
    assert timeouts.ceiling == 600.0
    assert timeouts.jitter == pytest.approx(0.005)
    assert timeouts.connect == 1.0


def test_minimal_policy_retry_and_breaker_defaults() -> None:
    pool = parse_policy(MINIMAL, "minimal.yaml").pools["chat"]
    retries = pool.retries
    assert retries.failure_smoothing == 0.97
    assert [(t.below, t.max_retries, t.backoff, t.k) for t in retries.tiers] == [
        (0.005, 2, 0.025, (1.2, 1.8)),
        (0.05, 3, 0.05, (1.8, 3.0)),
        (1.0, 1, 0.1, (3.0, 4.0)),
    ]
    assert retries.budget.ratio == 0.2
    assert retries.budget.min_per_second == 5.0
    assert retries.on == ("connect_failure", "reset", "timeout", 429, 500, 502, 503, 504, 529)

    breaker = pool.breaker
    assert breaker.consecutive_timeouts == 3
    assert breaker.error_rate == 0.15
    assert breaker.window == 60.0
    assert breaker.min_requests == 20
    assert breaker.isolation == 5.0
    assert breaker.max_isolation == 120.0
    assert breaker.max_isolated_fraction == 0.5


def test_retries_on_is_read_as_a_string_key() -> None:
    text = MINIMAL + "    retries:\n      on: [timeout, 503]\n"
    # Plain YAML 1.1 reads `on:` as the boolean True; the loader must keep it as "on".
    assert True in yaml.safe_load(text)["pools"]["chat"]["retries"]
    retries = parse_policy(text, "on.yaml").pools["chat"].retries
    assert retries.on == ("timeout", 503)
    # The rest of the retry settings keep their defaults.
    assert len(retries.tiers) == 3


def test_units_in_a_policy() -> None:
    text = (
        "limits: {max_request_bytes: 64KiB}\n"
        + MINIMAL
        + "    timeouts: {initial: 1.5s, floor: 500us, ceiling: 2m, connect: 250ms}\n"
    )
    policy = parse_policy(text, "units.yaml")
    assert policy.limits.max_request_bytes == 64 * 1024
    timeouts = policy.pools["chat"].timeouts
    assert timeouts.initial == pytest.approx(1.5)
    assert timeouts.floor == pytest.approx(0.0005)
    assert timeouts.ceiling == pytest.approx(120.0)
    assert timeouts.connect == pytest.approx(0.25)
