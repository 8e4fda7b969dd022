"""The cost budget (`loadtests/cost/budget.toml`): the calls each request makes through the whole
gateway, counted in a fresh process (`python -m loadtests.cost`), within 5 % of their budgets.

The counts are exact, not timed: the gateway runs on wires in memory and virtual time, so the
same code counts the same calls on any machine, however busy. The other tests here hold the
harness to that: a second process counts the same, call for call, and one added call per
relayed chunk shows as exactly one, named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from loadtests.cost import budget
from loadtests.cost.harness import python_version

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, timeout_s: float = 240) -> Any:
    """Run `code` in a fresh interpreter at the repository root; what it prints, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def _costs(names: list[str] | None = None) -> budget.Costs:
    costs: budget.Costs = _run(
        "import json\n"
        "from loadtests.cost.harness import costs\n"
        f"print(json.dumps(costs({names!r})))"
    )
    return costs


@pytest.fixture(scope="module")
def measured() -> budget.Costs:
    return _costs()


def test_every_count_is_within_its_budget(measured: budget.Costs) -> None:
    version = python_version()
    limits = budget.budgets().get(version, {})
    assert set(limits) == set(measured), (
        f"budgets {sorted(limits)} against counts {sorted(measured)}: "
        "record them with `make cost-budget RECORD=1`"
    )
    problems = budget.check(measured, version)
    assert not problems, "\n".join(problems)


def test_a_second_process_counts_the_same_calls(measured: budget.Costs) -> None:
    again = _costs(["chat", "stream"])
    for name in ("chat", "stream"):
        assert again[name] == measured[name], budget.growth(again[name], measured[name])


def test_one_more_call_per_chunk_counts_as_one_and_is_named(measured: budget.Costs) -> None:
    # The relay keeps every chunk in the stream's transcript: through a wrapper, that is one
    # more call per chunk (the wrapper's call of the method it wraps).
    code = """
        import json
        from gateway.core.continuation import Transcript
        from loadtests.cost.harness import costs

        keep = Transcript.keep

        def keep_through_a_wrapper(self, chunk):
            return keep(self, chunk)

        Transcript.keep = keep_through_a_wrapper
        print(json.dumps(costs(["stream_per_chunk"])))
    """
    slower = _run(code)["stream_per_chunk"]
    before = measured["stream_per_chunk"]
    assert budget.total(slower) == pytest.approx(budget.total(before) + 1.0)
    (first, *_) = budget.growth(slower, before)
    assert "<string>:keep_through_a_wrapper" in first and "+1.00" in first, first


def test_a_count_over_its_budget_fails_and_names_what_grew(measured: budget.Costs) -> None:
    version = python_version()
    chat = dict(measured["chat"])
    limit = budget.budgets()[version]["chat"]
    # 6 % over the budget, all of it in one function.
    grown = "gateway/ingress/relay.py:relay"
    chat[grown] = chat.get(grown, 0.0) + 1.06 * limit - budget.total(chat)
    (problem,) = budget.check({"chat": chat}, version)
    assert problem.startswith("chat: ") and "over its budget" in problem, problem
    assert grown in problem.splitlines()[1], problem
    # Within 5 %, nothing to say.
    assert budget.check({"chat": measured["chat"]}, version) == []
