# Pygmy: one entry point for people and CI. Everything runs from the virtualenv in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=
QUICK ?=

.PHONY: install run test lint bench lincheck chaos experiments compose-up compose-down compose-test clean

$(BIN)/pygmy: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/pygmy

run: install
	$(BIN)/pygmy up $(ARGS)

test: install
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python -m experiments.bench $(if $(QUICK),--quick,)
	$(BIN)/python -m experiments.soak $(if $(QUICK),--clients 20 --duration 20,)

# Linearizability runs judged by Porcupine (needs Go): RUNS fresh clusters of DURATION seconds each.
RUNS ?= 10
DURATION ?= 60
lincheck: install
	$(BIN)/python -m experiments.linearizability --runs $(RUNS) --duration $(DURATION)

# A randomized nemesis (root, iproute2, iptables, Go): DURATION seconds of faults, then the checker.
SEED ?=
chaos: install
	$(BIN)/python -m experiments.chaos --duration $(DURATION) $(if $(SEED),--seed $(SEED),) --report

experiments: install
	$(BIN)/python -m experiments.run_all $(if $(QUICK),--quick,)

compose-up: install
	bash scripts/compose.sh up

compose-down:
	bash scripts/compose.sh down

compose-test: install
	bash scripts/compose.sh test

clean:
	rm -rf $(VENV) data build *.egg-info
