# The two commands of the README. Both set everything up first (scripts/install.sh).
VENV ?= .venv
CONFIG ?= configs/app.yaml
PYTEST_ARGS ?=

.PHONY: install serve test test-fast

install:
	VENV=$(VENV) scripts/install.sh

# Start the server on the embedded default model (CPU). Ctrl-C stops it.
serve: install
	$(VENV)/bin/adaspec serve $(CONFIG)

# The whole test suite: fast unit tests, then the real Ray Serve + vLLM stack.
test: install
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Seconds: no engine.
test-fast: install
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)
