# Two entry points, each doing its own set-up on a fresh machine:
#   make serve   run the sidecar on the embedded default store under ./.kvoffload
#   make test    install everything, then lint, type-check and run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint typecheck pytest clean

$(STAMP): pyproject.toml
	# systemd-analyze for the unit tests (they skip with a reason if this fails).
	command -v systemd-analyze >/dev/null || { command -v apt-get >/dev/null && \
	  (apt-get update -qq && apt-get install -y -qq systemd >/dev/null) || true; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the local CPU build: an unpinned torch pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/kvoffload serve --dev

lint: $(STAMP)
	$(BIN)/ruff check kvoffload sidecar layouts tests scripts
	$(BIN)/ruff format --check kvoffload sidecar layouts tests scripts

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
