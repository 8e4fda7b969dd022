"""`gateway check FILE...` run as a real process: exit codes, stdout and stderr lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
POLICIES = sorted((REPO / "policies").glob("*.yaml"))

BAD_POLICY = """\
pools:
  chat:
    models: [demo-chat]
    instances:
      - {name: a, url: ftp://10.0.0.11:8000}
      - {name: b, url: http://10.0.0.12:8000}
    timeouts:
      floor: 90s
      ceiling: 60s
      initial: 3 parsecs
"""


def gateway_cli(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`gateway ARGS...` as a process, with only `env` (and PATH): nothing else the policies
    might name."""
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *map(str, args)],
        cwd=REPO,
        env=base,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def _check(*files: str | Path) -> subprocess.CompletedProcess[str]:
    # policies/sidecar.yaml names its instance after its pod.
    return gateway_cli("check", "--resolve", *files, env={"POD_NAME": "vllm-llama-8b-0"})


def _problem_re(path: Path) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(str(path))}:\d+: \S+: .+$")


@pytest.fixture
def bad_file(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_POLICY, encoding="utf-8")
    return path


def test_all_shipped_policies_are_ok() -> None:
    assert POLICIES
    result = _check(*POLICIES)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{path}: ok" for path in POLICIES]
    assert result.stderr == ""


def test_bad_file_exits_1_with_one_line_per_problem(bad_file: Path) -> None:
    result = _check(bad_file)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    # The cross-field check (floor vs ceiling) only runs once the fields are valid.
    assert len(lines) == 2, result.stderr
    pattern = _problem_re(bad_file)
    for line in lines:
        assert pattern.match(line), line
    assert lines[0].startswith(f"{bad_file}:5: pools.chat.instances[0].url: ")
    assert lines[1].startswith(f"{bad_file}:10: pools.chat.timeouts.initial: ")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("90s", "first_token_max (90s) is above ceiling (60s)"),
        ("0s", "Input should be greater than 0"),
        ("soon", "invalid duration 'soon'"),
    ],
)
def test_a_bad_first_token_max_is_reported_at_its_key(
    tmp_path: Path, value: str, message: str
) -> None:
    path = tmp_path / "limit.yaml"
    path.write_text(
        "pools:\n"
        "  chat:\n"
        "    models: [demo-chat]\n"
        "    instances: [{name: a, url: http://10.0.0.11:8000}]\n"
        f"    timeouts: {{ceiling: 60s, first_token_max: {value}}}\n",
        encoding="utf-8",
    )
    result = _check(path)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{path}:5: pools.chat.timeouts.first_token_max: {message}"), line


def test_good_and_bad_file_together(bad_file: Path) -> None:
    good = POLICIES[0]
    result = _check(good, bad_file, POLICIES[-1])
    assert result.returncode == 1
    # Every good file is still reported, before and after the bad one.
    assert result.stdout.splitlines() == [f"{good}: ok", f"{POLICIES[-1]}: ok"]
    lines = result.stderr.splitlines()
    assert lines
    pattern = _problem_re(bad_file)
    assert all(pattern.match(line) for line in lines), result.stderr


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-policy.yaml"
    result = _check(missing)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"{missing}:")
    assert "cannot read" in result.stderr
    assert "No such file" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_file_is_a_usage_error() -> None:
    result = _check()
    assert result.returncode == 2
    assert "usage:" in result.stderr


def test_shipped_policies_check_clean_as_shipped_without_their_environment() -> None:
    result = gateway_cli("check", *POLICIES)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{path}: ok" for path in POLICIES]


def test_resolve_checks_with_the_environment_as_run_does() -> None:
    sidecar = REPO / "policies" / "sidecar.yaml"
    missing = gateway_cli("check", "--resolve", sidecar)
    assert missing.returncode == 1
    assert "environment variable POD_NAME is not set" in missing.stderr
    assert gateway_cli("check", "--resolve", sidecar, env={"POD_NAME": "vllm-0"}).returncode == 0


def test_secrets_are_read_only_when_resolving(tmp_path: Path) -> None:
    policy = tmp_path / "secrets.yaml"
    policy.write_text(
        """\
auth: {api_keys_file: /run/secrets/no-such-keys}
pools:
  chat:
    models: [m]
    instances: [{name: a, url: "https://10.0.0.1:8000"}]
    credentials: {from_env: UPSTREAM_KEY}
    tls: {ca_file: no-such-ca.pem}
"""
    )
    assert gateway_cli("check", policy).returncode == 0
    resolved = gateway_cli("check", "--resolve", policy)
    assert resolved.returncode == 1
    for problem in ("no-such-keys", "UPSTREAM_KEY", "no-such-ca.pem"):
        assert problem in resolved.stderr
    assert "Traceback" not in resolved.stderr


def test_a_value_only_the_environment_can_tell_is_noted_not_failed(tmp_path: Path) -> None:
    """Checked alone, `${NAME}` stands for "1" (a name, host, port, number or password): a
    value that still cannot be told without the environment is a note, and the file is ok;
    `--resolve` checks it, and fails it when the environment's value is wrong."""
    policy = tmp_path / "refs.yaml"
    policy.write_text(
        """\
listen: "0.0.0.0:${PORT}"
shared: {redis_url: "${REDIS_URL}"}
pools:
  chat:
    models: [m]
    instances: [{name: "${POD_NAME}", url: "http://${VLLM_HOST:-127.0.0.1}:8000"}]
"""
    )
    alone = gateway_cli("check", policy)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout == f"{policy}: ok (1 value(s) not checked without the environment)\n"
    (note,) = alone.stderr.splitlines()
    assert note.startswith(f"{policy}:2: shared.redis_url: not checked: the value holds ")
    assert "${REDIS_URL}" in note and "--resolve" in note
    env = {"REDIS_URL": "redis://redis:6379/0", "POD_NAME": "p-0", "PORT": "8080"}
    assert gateway_cli("check", "--resolve", policy, env=env).returncode == 0
    wrong = gateway_cli("check", "--resolve", policy, env={**env, "REDIS_URL": "http://x"})
    assert wrong.returncode == 1 and "shared.redis_url" in wrong.stderr
    # A real mistake beside a reference still fails alone.
    policy.write_text(policy.read_text().replace("models: [m]", "models: []"))
    assert gateway_cli("check", policy).returncode == 1


def test_resolve_refuses_what_run_refuses_an_exposed_admin_plane_without_its_token() -> None:
    compose = REPO / "deploy" / "compose-policy.yaml"  # admin on 0.0.0.0: needs the token
    assert gateway_cli("check", compose).returncode == 0
    bare = gateway_cli("check", "--resolve", compose)
    assert bare.returncode == 1
    assert "without a token: set GATEWAY_ADMIN_TOKEN" in bare.stderr
    assert (
        gateway_cli("check", "--resolve", compose, env={"GATEWAY_ADMIN_TOKEN": "t"}).returncode == 0
    )


def test_version() -> None:
    result = gateway_cli("--version")
    assert result.returncode == 0
    assert re.fullmatch(r"gateway \d+\.\d+\.\d+\S*\n", result.stdout)
