"""Relative file paths in a policy (CA bundles, credentials, client keys) name files next to the
policy file, wherever the gateway was started from."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from gateway.config import PolicyError, load_policy, parse_policy

POLICY = """
auth: {api_keys_file: keys.txt}
pools:
  chat:
    models: [m]
    instances: [{name: a, url: "https://127.0.0.1:8443"}]
    tls: {ca_file: certs/ca.pem}
    credentials: {header: x-api-key, from_file: ../secrets/upstream-key}
"""


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """tmp/conf/policy.yaml, tmp/conf/keys.txt, tmp/conf/certs/ca.pem, tmp/secrets/upstream-key"""
    conf = tmp_path / "conf"
    (conf / "certs").mkdir(parents=True)
    (tmp_path / "secrets").mkdir()
    trustme.CA().cert_pem.write_to_path(str(conf / "certs" / "ca.pem"))
    (conf / "keys.txt").write_text("client-key-1\n")
    (tmp_path / "secrets" / "upstream-key").write_text("upstream-secret\n")
    (conf / "policy.yaml").write_text(POLICY)
    return tmp_path


def test_relative_paths_are_taken_from_the_policy_files_folder(
    layout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = layout / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    policy = load_policy(Path("..") / "conf" / "policy.yaml")  # a relative policy path too
    pool = policy.pools["chat"]
    assert pool.tls is not None and pool.tls.ca_file == str(layout / "conf" / "certs" / "ca.pem")
    assert pool.tls.ca_pem is not None and "BEGIN CERTIFICATE" in pool.tls.ca_pem
    assert pool.credentials is not None
    assert pool.credentials.source == f"file:{layout / 'secrets' / 'upstream-key'}"
    assert pool.credentials.header_value() == "upstream-secret"
    assert policy.auth is not None and policy.auth.keys == ("client-key-1",)


def test_absolute_paths_are_kept(layout: Path) -> None:
    absolute = POLICY.replace("keys.txt", str(layout / "conf" / "keys.txt"))
    (layout / "conf" / "policy.yaml").write_text(absolute)
    policy = load_policy(layout / "conf" / "policy.yaml")
    assert policy.auth is not None and policy.auth.api_keys_file == str(
        layout / "conf" / "keys.txt"
    )


def test_a_missing_file_is_reported_with_the_path_it_was_looked_for_at(layout: Path) -> None:
    (layout / "conf" / "keys.txt").unlink()
    with pytest.raises(PolicyError) as caught:
        load_policy(layout / "conf" / "policy.yaml")
    assert f"API key file '{layout / 'conf' / 'keys.txt'}' does not exist" in str(caught.value)


def test_policy_text_without_a_file_reads_from_the_working_directory(
    layout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(layout / "conf")
    text = "auth: {api_keys_file: keys.txt}\npools:\n  chat:\n    models: [m]\n"
    text += '    instances: [{name: a, url: "http://127.0.0.1:8000"}]\n'
    policy = parse_policy(text)
    assert policy.auth is not None and policy.auth.api_keys_file == "keys.txt"
    assert policy.auth.keys == ("client-key-1",)
