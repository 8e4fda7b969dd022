"""`gateway state | isolate | restore | reload` against a running gateway's admin API, as real
processes: output, exit codes, the token from the environment, and what each call changes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    Backend,
    Gateway,
    closed_port,
    pool_policy,
    running_backends,
    start_gateway,
)
from tests.test_cli_check import gateway_cli

TOKEN = "cli-admin-token-7f3a"


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    yield from running_backends(("a", "b"), ["m"])


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    path = tmp_path_factory.mktemp("cli") / "policy.yaml"
    gw = start_gateway(path, pool_policy(backends), {"GATEWAY_ADMIN_TOKEN": TOKEN})
    try:
        yield gw
    finally:
        gw.stop()


def cli(*args: str, token: str | None = TOKEN, **env: str) -> subprocess.CompletedProcess[str]:
    if token is not None:
        env["GATEWAY_ADMIN_TOKEN"] = token
    return gateway_cli(*args, env=env)


def state_of(gateway: Gateway, *args: str) -> Any:
    result = cli("state", "--admin", gateway.admin_url, *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_state_prints_the_admin_state_as_json(gateway: Gateway) -> None:
    state = state_of(gateway)
    assert [i["name"] for i in state["pools"]["chat"]["instances"]] == ["a", "b"]
    pool = state_of(gateway, "--pool", "chat")
    assert [i["name"] for i in pool["instances"]] == ["a", "b"]
    unknown = cli("state", "--admin", gateway.admin_url, "--pool", "nope")
    assert unknown.returncode == 1 and "no pool 'nope'" in unknown.stderr


def test_the_admin_url_can_come_from_the_environment(gateway: Gateway) -> None:
    result = cli("state", GATEWAY_ADMIN_URL=gateway.admin_url)
    assert result.returncode == 0, result.stderr
    assert "chat" in json.loads(result.stdout)["pools"]


def test_isolate_and_restore_an_instance(gateway: Gateway) -> None:
    isolated = cli("isolate", "chat", "b", "--admin", gateway.admin_url)
    assert isolated.returncode == 0, isolated.stderr
    (b,) = [i for i in state_of(gateway, "--pool", "chat")["instances"] if i["name"] == "b"]
    assert b["state"] == "ISOLATED" and b["forced"]
    restored = cli("restore", "chat", "b", "--admin", gateway.admin_url)
    assert restored.returncode == 0, restored.stderr
    (b,) = [i for i in state_of(gateway, "--pool", "chat")["instances"] if i["name"] == "b"]
    assert not b["forced"]
    missing = cli("isolate", "chat", "zz", "--admin", gateway.admin_url)
    assert missing.returncode == 1
    assert "HTTP 404" in missing.stderr and "no such instance" in missing.stderr


def test_reload_applies_the_policy_file_or_says_why_not(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    gw = start_gateway(path, pool_policy(backends), {"GATEWAY_ADMIN_TOKEN": TOKEN})
    try:
        done = cli("reload", "--admin", gw.admin_url)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["reloaded"] is True
        path.write_text(pool_policy(backends).replace("models: [m]", "models: []"))
        refused = cli("reload", "--admin", gw.admin_url)
        assert refused.returncode == 1
        assert "HTTP 400" in refused.stderr and "pools.chat.models" in refused.stderr
    finally:
        gw.stop()


def test_a_wrong_or_missing_token_is_refused_and_named(gateway: Gateway) -> None:
    for token in ("wrong", None):
        result = cli("state", "--admin", gateway.admin_url, token=token)
        assert result.returncode == 1
        assert "HTTP 401" in result.stderr and "$GATEWAY_ADMIN_TOKEN" in result.stderr
    other = cli(
        "state", "--admin", gateway.admin_url, "--token-env", "OTHER", token=None, OTHER=TOKEN
    )
    assert other.returncode == 0, other.stderr


def test_an_unreachable_gateway_is_an_error_not_a_traceback() -> None:
    result = cli("state", "--admin", f"http://127.0.0.1:{closed_port()}")
    assert result.returncode == 1
    assert "cannot reach the admin API" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_token_is_never_shown_and_never_sent_through_a_proxy(gateway: Gateway) -> None:
    # Surrounding whitespace (a Secret file's newline) is dropped; a control inside is refused.
    assert cli("state", "--admin", gateway.admin_url, token=TOKEN + "\r\n").returncode == 0
    broken = cli("state", "--admin", gateway.admin_url, token=TOKEN[:4] + "\x01" + TOKEN[4:])
    assert broken.returncode == 1
    assert "GATEWAY_ADMIN_TOKEN holds characters" in broken.stderr
    assert TOKEN not in broken.stderr + broken.stdout
    # A proxy in the environment (here a closed port) is not used for the admin API.
    proxied = f"http://127.0.0.1:{closed_port()}"
    result = cli("state", "--admin", gateway.admin_url, HTTP_PROXY=proxied, http_proxy=proxied)
    assert result.returncode == 0, result.stderr


def test_names_that_need_quoting_are_sent_quoted_not_a_traceback(gateway: Gateway) -> None:
    result = cli("isolate", "chat", "a b/../c", "--admin", gateway.admin_url)
    assert result.returncode == 1
    assert "HTTP 404" in result.stderr and "Traceback" not in result.stderr
    bad_url = cli("state", "--admin", "http://127.0.0.1:port")
    assert bad_url.returncode == 1 and "cannot reach the admin API" in bad_url.stderr
    assert "Traceback" not in bad_url.stderr
