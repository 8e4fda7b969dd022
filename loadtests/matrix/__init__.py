"""The fault matrix: every chaos scenario at pool sizes 1, 2 and 3, direct and through the
gateway, in one table (`python -m loadtests.matrix`, `make loadtest-matrix`).

Each cell is an ordinary chaos run (`loadtests.chaos.runner.run_scenario`) of a scenario whose
pools were resized to N instances, with fewer requests than a full run; faults on instances that
a smaller pool lacks are moved or dropped by the rule in `loadtests.matrix.resize`. The outputs,
in `loadtests/out/matrix-<time>/`: matrix.md (failure rate, p99 and OOMs per cell, both ways, and
whether the gateway failed no more than direct), matrix.json, matrix.png, and each cell's run
directory with its own report.md.
"""
