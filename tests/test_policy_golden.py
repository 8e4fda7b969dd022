"""Golden-file tests of policy errors, and the shipped policies must validate.

Each `tests/golden/<case>.yaml` is a small policy with one (sometimes two) mistakes; the matching
`<case>.expected` holds the exact lines of `str(PolicyError)`, with the file name written `<file>`.

Regenerate after an intended change of messages with
`UPDATE_GOLDEN=1 pytest tests/test_policy_golden.py`, then review every diff by hand: the LINE of
each problem must be the line of the offending key (for a missing key, the line of its parent).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gateway.config import Policy, PolicyError, load_policy, parse_policy

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
POLICIES = REPO / "policies"
PLACEHOLDER = "<file>"
UPDATE = os.environ.get("UPDATE_GOLDEN", "") not in ("", "0")
MIN_CASES = 14

CASES = sorted(GOLDEN.glob("*.yaml"))
SHIPPED = sorted(POLICIES.glob("*.yaml"))
PROBLEM_LINE = re.compile(r"^<file>:(\d+): (\S[^:]*): (.+)$")


def _errors(text: str, filename: str) -> PolicyError:
    """The PolicyError the text raises; fails the test when the text validates."""
    try:
        parse_policy(text, filename)
    except PolicyError as exc:
        return exc
    pytest.fail(f"{filename}: expected a PolicyError, but the policy validates")


def test_golden_folder_is_complete() -> None:
    assert len(CASES) >= MIN_CASES, f"only {len(CASES)} golden cases in {GOLDEN}"
    expected = {p.stem for p in GOLDEN.glob("*.expected")}
    cases = {p.stem for p in CASES}
    assert not expected - cases, f".expected without .yaml: {sorted(expected - cases)}"
    if not UPDATE:
        assert not cases - expected, f".yaml without .expected: {sorted(cases - expected)}"


@pytest.mark.parametrize("case", CASES, ids=[p.stem for p in CASES])
def test_golden(case: Path) -> None:
    text = case.read_text(encoding="utf-8")
    actual = str(_errors(text, PLACEHOLDER)).splitlines()
    expected_file = case.with_suffix(".expected")
    if UPDATE:
        expected_file.write_text("\n".join(actual) + "\n", encoding="utf-8")
    assert expected_file.exists(), f"missing {expected_file.name}: run with UPDATE_GOLDEN=1"
    expected = expected_file.read_text(encoding="utf-8").splitlines()
    assert actual == expected

    # Every line has the documented shape and points inside the file.
    last_line = max(1, len(text.splitlines()))
    for line in expected:
        match = PROBLEM_LINE.match(line)
        assert match, f"not `FILE:LINE: dotted.path: message`: {line!r}"
        assert 1 <= int(match.group(1)) <= last_line, line


@pytest.mark.parametrize("case", CASES, ids=[p.stem for p in CASES])
def test_golden_via_load_policy(case: Path) -> None:
    """`load_policy(path)` reports the same problems, under the real file name."""
    expected_file = case.with_suffix(".expected")
    assert expected_file.exists(), f"{expected_file} is missing"
    with pytest.raises(PolicyError) as info:
        load_policy(case)
    expected = expected_file.read_text(encoding="utf-8").replace(PLACEHOLDER, str(case))
    assert str(info.value).splitlines() == expected.splitlines()
    assert all(problem.file == str(case) for problem in info.value.problems)
    assert [p.line for p in info.value.problems] == sorted(p.line for p in info.value.problems)


def test_shipped_policies_exist() -> None:
    assert SHIPPED, f"no policies in {POLICIES}"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_policy_validates(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "vllm-llama-8b-0")  # policies/sidecar.yaml
    policy = load_policy(path)
    assert isinstance(policy, Policy)
    assert policy.pools


# --- edge cases of error reporting ------------------------------------------------------------

_POOL = "pools:\n  chat:\n    models: [demo-chat]\n    instances:\n"
_ONE_INSTANCE = _POOL + "      - {name: a, url: http://10.0.0.11:8000}\n"


def test_merge_keys_with_overrides_validate() -> None:
    text = (
        "defaults: &pool\n  models: [m1]\n  instances: [{name: a, url: 'http://h:1'}]\n"
        "pools:\n  one:\n    <<: *pool\n  two:\n    <<: *pool\n    models: [m2]\n"
    )
    with pytest.raises(PolicyError) as info:  # `defaults` is not a policy key...
        parse_policy(text, PLACEHOLDER)
    # ...but the override of `models` in pool two is not a duplicate key.
    assert [p.path for p in info.value.problems] == ["defaults"]


EDGE_CASES: dict[str, tuple[str, str | None, str | None]] = {
    # name: (policy text, text that must appear in the errors, text that must not)
    "single_bad_instance_no_spurious_too_short": (
        _POOL + "      - {name: a, url: 'ftp://10.0.0.11:8000'}\n",
        "scheme must be http or https",
        "needs at least 1 item",
    ),
    "misplaced_key_not_suggested_to_itself": (
        _ONE_INSTANCE + "    timeout: 5s\n",
        "unknown key 'timeout'",
        "did you mean 'timeout'",
    ),
    "negative_duration_with_unit": (
        _ONE_INSTANCE + "    timeouts: {floor: -250ms}\n",
        "negative",
        None,
    ),
    "infinite_duration_rejected": (_ONE_INSTANCE + "    timeouts: {ceiling: .inf}\n", "", None),
    "nan_duration_rejected": (_ONE_INSTANCE + "    timeouts: {jitter: .nan}\n", "", None),
    "listen_as_bare_port": ("listen: 8080\n" + _ONE_INSTANCE, "host:port", None),
    "credentials_not_echoed": (
        _POOL + "      - {name: a, url: 'ftp://admin:s3cret@10.0.0.11:8000'}\n",
        "credentials do not belong",
        "s3cret",
    ),
    "admin_port_taken_by_wildcard_listen": (
        "listen: 0.0.0.0:8080\nadmin: {listen: 127.0.0.1:8080}\n" + _ONE_INSTANCE,
        "admin.listen",
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_loader_edge_case(name: str) -> None:
    text, wanted, unwanted = EDGE_CASES[name]
    message = str(_errors(text, PLACEHOLDER))
    if wanted is not None:
        assert wanted in message
    if unwanted is not None:
        assert unwanted not in message


def test_shipped_sidecar_and_central_policies_share_their_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    central = load_policy(POLICIES / "central.yaml")
    assert central.shared is not None
    for inst in central.pools["chat-8b"].instances:
        monkeypatch.setenv("POD_NAME", inst.name)
        sidecar = load_policy(POLICIES / "sidecar.yaml")
        assert sidecar.shared is not None
        same = ("redis_url", "key_prefix", "decision_ttl")
        assert [getattr(sidecar.shared, k) for k in same] == [
            getattr(central.shared, k) for k in same
        ]
        assert [i.name for i in sidecar.pools["chat-8b"].instances] == [inst.name]
