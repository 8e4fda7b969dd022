"""The cost budget: the most calls each scenario may make (`budget.toml`), what was counted when
the budgets were last recorded, function by function (`profile.json`), and the comparison
that CI enforces (`tests/test_cost_budget.py`). Counts are kept per call site, `caller ->
callee`, so what grew is shown where it grew.

Budgets are per Python version (`"3.11"`): the standard library's share of the count differs
between versions. A count may exceed its budget by `TOLERANCE` (a small change need not touch
this file); beyond that the check fails and names the calls that grew since the profile
was recorded.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

Costs = dict[str, dict[str, float]]  # budget -> `caller -> callee` -> calls per request (chunk)

HERE = Path(__file__).resolve().parent
BUDGET_FILE = HERE / "budget.toml"
PROFILE_FILE = HERE / "profile.json"
TOLERANCE = 0.05
SHOWN = 15  # calls named when a budget is exceeded

_HEADER = """\
# The cost budget: Python function calls per request (per relayed chunk for *_per_chunk),
# counted through the whole gateway in one process, on wires in memory and virtual time, so a
# count is the same on any machine (README.md, "The cost budget"). One table per Python version.
#
#   chat            a chat completion answered whole (48 tokens)
#   chat_traced     the same with tracing on (every request sampled)
#   chat_retried    a chat completion whose first attempt gets a 503, retried on the other instance
#   stream          a streamed chat completion of 8 tokens (10 events with the usage and [DONE])
#   stream_traced   the same with tracing on
#   stream_per_chunk  what each further token of a stream costs (one event relayed)
#
# `make test` fails when a count exceeds its budget by more than 5 %, naming the calls
# (`caller -> callee`) that grew since profile.json was recorded. A change that lowers a count
# may lower its budget: one line. `make cost-budget` prints the counts; `make cost-budget
# RECORD=1` writes every budget of this Python version (the counts, rounded up) and
# profile.json anew.
"""


def budgets() -> dict[str, dict[str, int]]:
    """Python version -> budget -> the most calls allowed."""
    return tomllib.loads(BUDGET_FILE.read_text())


def profile() -> dict[str, Costs]:
    """Python version -> the per-function counts recorded with the budgets."""
    return json.loads(PROFILE_FILE.read_text()) if PROFILE_FILE.exists() else {}


def total(counts: dict[str, float]) -> float:
    return round(sum(counts.values()), 1)


def record(measured: Costs, version: str) -> None:
    """Write this version's budgets (the counts, rounded up) and profile; other versions'
    stay as they are."""
    tables = budgets() if BUDGET_FILE.exists() else {}
    tables[version] = {name: math.ceil(total(counts)) for name, counts in measured.items()}
    lines = [_HEADER]
    for key in sorted(tables):
        lines.append(f'["{key}"]')
        lines += [f"{name} = {limit}" for name, limit in tables[key].items()]
        lines.append("")
    BUDGET_FILE.write_text("\n".join(lines))
    recorded = profile()
    recorded[version] = measured
    PROFILE_FILE.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


def check(measured: Costs, version: str) -> list[str]:
    """What is over budget (or has none), each with the calls that grew: empty when every
    count is within its budget."""
    limits = budgets().get(version)
    if limits is None:
        return [
            f"no cost budget for Python {version} in {BUDGET_FILE.name}: record one with "
            "`make cost-budget RECORD=1`"
        ]
    recorded = profile().get(version, {})
    problems = []
    for name, counts in measured.items():
        limit = limits.get(name)
        count = total(counts)
        if limit is None:
            problems.append(f"{name}: {count:g} calls, and no budget for it")
        elif count > limit * (1 + TOLERANCE):
            over = 100 * (count / limit - 1)
            problems.append(
                f"{name}: {count:g} calls, {over:.1f} % over its budget of {limit}; "
                f"grown since the profile:\n" + "\n".join(growth(counts, recorded.get(name, {})))
            )
    return problems


def growth(counts: dict[str, float], before: dict[str, float]) -> list[str]:
    """The calls (`caller -> callee`) made more often than in `before`, the most grown first."""
    grown = sorted(
        ((counts.get(f, 0.0) - before.get(f, 0.0), f) for f in counts.keys() | before.keys()),
        key=lambda item: (-item[0], item[1]),
    )
    return [
        f"  {delta:+9.2f}  {name}  ({before.get(name, 0.0):g} -> {counts.get(name, 0.0):g})"
        for delta, name in grown[:SHOWN]
        if delta > 0
    ]


def report(measured: Costs, version: str) -> list[str]:
    """A line per budget: the count, the budget, their ratio."""
    limits = budgets().get(version, {})
    lines = [f"{'budget':<18} {'calls':>10} {'budget':>8} {'ratio':>7}"]
    for name, counts in measured.items():
        count, limit = total(counts), limits.get(name)
        ratio = f"{count / limit:.3f}" if limit else "-"
        lines.append(f"{name:<18} {count:>10g} {limit if limit else '-':>8} {ratio:>7}")
    return lines
