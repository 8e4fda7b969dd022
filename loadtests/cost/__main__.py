"""Count the calls per request through the whole gateway and compare them with the budget.

python -m loadtests.cost                 # print the counts against the budget; exit 1 if over
python -m loadtests.cost --record        # write this Python's budgets and profile anew
python -m loadtests.cost --json FILE     # write the counts, per function, as JSON
python -m loadtests.cost --only chat     # some budgets only (repeatable)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from loadtests.cost import budget
from loadtests.cost.harness import costs, python_version


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.cost", description=__doc__)
    parser.add_argument("--record", action="store_true", help="write the budgets anew")
    parser.add_argument("--json", metavar="FILE", help="write the counts per function here")
    parser.add_argument("--only", action="append", metavar="BUDGET", help="measure this one")
    args = parser.parse_args(argv)
    measured = costs(args.only)
    version = python_version()
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"python": version, "costs": measured}, out, indent=1, sort_keys=True)
        return 0
    if args.record:
        if args.only:
            parser.error("--record writes every budget: measure them all")
        budget.record(measured, version)
        print(f"recorded in {budget.BUDGET_FILE} and {budget.PROFILE_FILE}")
    print("\n".join(budget.report(measured, version)))
    problems = budget.check(measured, version)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
