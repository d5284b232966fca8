# Pygmy: one entry point for people and CI. Everything runs from the virtualenv in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=
QUICK ?=

.PHONY: install run test test-nemesis lint k8scheck bench lincheck chaos experiments mutation compose-up compose-down compose-test clean

# The services' own dependencies only: all that `make run` installs.
$(BIN)/pygmy: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

# What the tests, benchmarks and experiments use as well (pyproject.toml's `dev` extra).
$(VENV)/.dev: $(BIN)/pygmy
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.dev

run: $(BIN)/pygmy
	$(BIN)/pygmy up $(ARGS)

# Bytecode compiled once up front: with PYTHONDONTWRITEBYTECODE set (as in some environments) every
# service process the tests start would otherwise compile the project's modules again (~0.2 s of CPU
# per process, a few hundred processes per run). Python still reads .pyc files it did not write.
# Workers: pytest-xdist runs the suite on 3 processes (on 2 cores, 2 and 4 were slower, and 4 failed
# timing tests); WORKERS=0 runs it in one. Work stealing: a worker that runs out takes tests still
# queued on a busy one, so the minutes-long system tests (handed out first, tests/conftest.py) do
# not leave the others idle at the end (a share of them to every worker at the start was slower:
# three clusters under load at once). scripts/check_prereqs.py names what is missing at once.
COMPILE = $(BIN)/python -m compileall -q -j 0 catalog client experiments frontend order pygmy
WORKERS ?= 3
test: install
	$(BIN)/ruff check .
	$(BIN)/python scripts/check_prereqs.py
	$(COMPILE)
	$(BIN)/pytest -q -n $(WORKERS) --dist worksteal -m "not nemesis_run" --durations=30

# The quick nemesis runs (tests/verify/test_chaos.py): a cluster in network namespaces under every
# fault kind, and a broken build caught. They take both cores for a minute or two each, which make
# test's 10 minutes cannot hold; .ci/run runs them after make test.
test-nemesis: install
	$(BIN)/python scripts/check_prereqs.py
	$(COMPILE)
	$(BIN)/pytest -q -n 2 -m nemesis_run

lint: install
	$(BIN)/ruff check .

# The Kubernetes manifests, validated offline (tools/k8scheck, needs Go 1.26; docs/containers.md).
k8scheck: install
	$(BIN)/python -m pygmy.verify.k8scheck

bench: install
	$(BIN)/python -m pygmy.experiments.bench $(if $(QUICK),--quick,)
	$(BIN)/python -m pygmy.experiments.writepath $(if $(QUICK),--quick,)
	$(BIN)/python -m pygmy.experiments.soak $(if $(QUICK),--clients 20 --duration 20,)
	$(BIN)/python -m pygmy.experiments.store_size --no-progress $(if $(QUICK),--quick,)
	$(BIN)/python -m pygmy.experiments.rebuild $(if $(QUICK),--quick,)

# Linearizability runs judged by Porcupine (needs Go): RUNS fresh clusters of DURATION seconds each.
RUNS ?= 10
DURATION ?= 60
lincheck: install
	$(BIN)/python -m pygmy.verify.linearizability --runs $(RUNS) --duration $(DURATION)

# A randomized nemesis (root, iproute2, iptables, Go): DURATION seconds of faults, then the checker.
# KINDS narrows the faults (comma-separated; `host` for the host kinds), e.g. KINDS=host,kill.
SEED ?=
KINDS ?=
chaos: install
	$(BIN)/python -m pygmy.experiments.chaos_report --duration $(DURATION) $(if $(SEED),--seed $(SEED),) $(if $(KINDS),--kinds $(KINDS),)

experiments: install
	$(BIN)/python -m pygmy.experiments.run_all $(if $(QUICK),--quick,)

# Mutation testing with mutmut (configured in pyproject.toml): the five modules of issue #20 against
# the fast in-process unit tests only. Not part of `make test`: 6-45 min on 2 cores, depending on
# what else runs (docs/testing.md, "Mutation score"). Always from scratch (mutmut keeps old verdicts
# otherwise). A full run stores its results in docs/mutation/results.json (survivors by function and
# mutated line, reasons from docs/mutation/reasons.toml) and rewrites the generated part of
# docs/testing.md from them. MUTANTS narrows the run, e.g. MUTANTS='pygmy.order.state.*', and only prints
# the table and the survivors. On a shared machine run `nice -n 19 make mutation`.
MUTANTS ?=
mutation: install
	$(BIN)/python scripts/mutation_report.py stage
	commit=$$(git rev-parse --short HEAD) && start=$$(date +%s) && cd build/mutation \
		&& ../../$(BIN)/mutmut run --max-children 2 $(MUTANTS) \
		&& echo $$(( $$(date +%s) - start )) > mutants/run-seconds && echo $$commit > mutants/run-commit
	cd build/mutation && ../../$(BIN)/mutmut results
	$(if $(MUTANTS),$(BIN)/python scripts/mutation_report.py print,$(BIN)/python scripts/mutation_report.py collect && $(BIN)/python scripts/mutation_report.py docs)

compose-up: install
	bash scripts/compose.sh up

compose-down:
	bash scripts/compose.sh down

compose-test: install
	bash scripts/compose.sh test

clean:
	rm -rf $(VENV) data build *.egg-info
