# The README's two commands are the contract: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
NODE_CLIENT := tests/clients/node

.PHONY: install install-test run test lint protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: a CPU build of 2.13.0 lies on disk here, and a looser
# requirement would download a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	touch $@

$(NODE_CLIENT)/node_modules/.installed: $(NODE_CLIENT)/package.json $(NODE_CLIENT)/package-lock.json
	cd $(NODE_CLIENT) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test $(NODE_CLIENT)/node_modules/.installed

run: install
	$(BIN)/reflow up

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install-test lint
	$(BIN)/python -m pytest

# Regenerates reflow/v1/*_pb2*.py from protos/ (tests fail when they are stale).
protos: $(VENV)/.installed-test
	$(BIN)/python -m reflow.protogen

clean:
	rm -rf $(VENV) $(NODE_CLIENT)/node_modules .pytest_cache .ruff_cache
