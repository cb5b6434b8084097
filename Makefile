# Two entry points: `make demo` (set up + run the main job on the embedded default)
# and `make test` (set up + run the whole test suite). Both create their own venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow bench clean

$(STAMP): pyproject.toml scripts/install_torch.sh
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	bash scripts/install_torch.sh $(BIN)/pip $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/fidelity ab --out reports --run-id example
	$(BIN)/fidelity needle --out reports --run-id example --results reports/needle/example-results.jsonl

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=20 tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m slow tests

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV)
