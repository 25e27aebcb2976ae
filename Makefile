# Two commands: `make demo` and `make test`. Both build .venv on a fresh machine first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.kvflow-installed

.PHONY: demo test setup clean bench-quick

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: a bare `torch` requirement would let pip fetch a multi-GB CUDA wheel.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvflow demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench-quick: $(STAMP)
	$(BIN)/kvflow bench pool --quick

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
