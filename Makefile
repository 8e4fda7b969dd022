# Every target runs from the repo root; `make install` is idempotent.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install lock upgrade-check engine test cost-budget fuzz lint demo bench bench-propagation bench-fallback bench-admission bench-operations loadtest loadtest-matrix system-deps clean

install: $(STAMP)

# .venv holds exactly what uv.lock names for the project and its `dev` extra, each file checked
# against the lock's sha256: first uv itself (scripts/bootstrap-uv), then uv installs the rest
# and removes whatever the lock does not name. `--locked` refuses a lock that pyproject.toml's
# dependencies have moved away from: run `make lock`. Every module is compiled to bytecode
# once here: the tests start hundreds of Python processes (gateways, fake engines), and where
# the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE) each of them would
# otherwise compile its imports from source again (about a second of CPU per start).
$(STAMP): pyproject.toml uv.lock scripts/bootstrap-uv
	$(PY) scripts/bootstrap-uv $(VENV)
	$(BIN)/uv sync --quiet --locked --extra dev --compile-bytecode
	touch $(STAMP)

# uv.lock after a change to pyproject.toml's dependencies: every pin that still fits is kept.
# `make lock UPGRADE=1` moves every pin to the newest release the ranges allow.
lock:
	$(PY) scripts/bootstrap-uv $(VENV)
	$(BIN)/uv lock $(if $(UPGRADE),--upgrade)

# What the newest releases the ranges allow would break: a scratch venv with them, then the
# linters and a fast test subset (not part of CI; RESOLUTION=lowest-direct tries the lowest).
upgrade-check: install system-deps
	./scripts/upgrade-check $(RESOLUTION)

# Programs the tests run for real (redis-server, nginx, wrk); installed when missing.
system-deps:
	@./scripts/install-system-deps

# llama.cpp's server, the real inference engine some tests run; built once per machine, cached.
engine: install
	./scripts/install-llama-server

# Two workers, a test file each at a time (its module fixtures start once): see README.
# The project's own modules are compiled first, for the processes the tests start (see install).
test: install system-deps engine
	$(BIN)/python -m compileall -q gateway loadtests
	$(BIN)/pytest -q -n 2 --dist loadfile

# The calls per request and per relayed chunk against loadtests/cost/budget.toml (`make test`
# enforces it); RECORD=1 writes this Python's budgets anew.
cost-budget: install
	$(BIN)/python -m loadtests.cost $(if $(RECORD),--record)

# The upstream client's fuzzing, long: fresh random examples each run (FUZZ_EXAMPLES=N).
fuzz: install
	HYPOTHESIS_PROFILE=long $(BIN)/pytest -q tests/conformance/test_h1_fuzz.py --hypothesis-show-statistics

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

demo: install
	$(BIN)/python -m loadtests.demo

bench: install
	$(BIN)/python -m loadtests.bench_overhead $(BENCH_ARGS)

# How fast an isolation reaches every replica sharing decisions via Redis (pub/sub, TTL backstop).
bench-propagation: install system-deps
	$(BIN)/python -m loadtests.bench_propagation $(BENCH_ARGS)

# Every primary instance killed and restarted under traffic, three replicas sharing decisions
# via Redis: requests failed, which pool answered each second, how soon the primary is back, and
# what reached it during the outage.
bench-fallback: install system-deps
	$(BIN)/python -m loadtests.bench_fallback $(BENCH_ARGS)

# A step from 100 % to 300 % of the backends' capacity, through the gateway without and with
# admission control: p99 per priority class and OOMs.
bench-admission: install
	$(BIN)/python -m loadtests.bench_admission $(BENCH_ARGS)

# Policy reloads and a SIGTERM drain while traffic flows: requests failed (must be 0).
bench-operations: install
	$(BIN)/python -m loadtests.bench_operations $(BENCH_ARGS)

# A chaos scenario, direct vs through the gateway; report in loadtests/out/<scenario>-<time>/.
SCENARIO ?= chaos-mix
loadtest: install
	$(BIN)/python -m loadtests.chaos $(SCENARIO) $(if $(REQUESTS),--requests $(REQUESTS)) \
		$(if $(RATE),--rate $(RATE)) $(if $(CPUS),--cpus $(CPUS))

# Every scenario at pools of 1, 2 and 3 instances, direct vs gateway, in one table (~300 requests
# per cell); in loadtests/out/matrix-<time>/. SCENARIOS=a,b and SIZES=1,2 narrow it.
loadtest-matrix: install
	$(BIN)/python -m loadtests.matrix $(if $(REQUESTS),--requests $(REQUESTS)) \
		$(if $(RATE),--rate $(RATE)) $(if $(SCENARIOS),--scenarios $(SCENARIOS)) \
		$(if $(SIZES),--sizes $(SIZES))

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
