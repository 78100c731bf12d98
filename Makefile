# `make train` and `make test` set up .venv on first use (CPU torch pinned; the deploy and docs extras, so their
# tests run), then run. `make docs` serves the documentation site at http://127.0.0.1:8000.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline

.PHONY: setup train test smoke docs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH) -e '.[dev,deploy,docs]'
	touch $@

train: setup
	$(OFFLINE) $(BIN)/python train.py $(ARGS)

smoke: setup
	$(OFFLINE) $(BIN)/python train.py experiment=smoke $(ARGS)

# both cores: one torch thread per process (tests/conftest.py), two workers; loadfile keeps a file's module
# fixtures (trained runs) built once, on one worker, and the files go out longest first (tests/conftest.py's
# order, not xdist's by number of tests); the 15 slowest tests are listed at the end (the suite's budget)
test: setup
	$(OFFLINE) $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15 $(ARGS)

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve
