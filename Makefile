PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck unit clean

$(BIN)/spillgate: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.dev: $(BIN)/spillgate
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/spillgate
	$(BIN)/spillgate demo

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.dev
	$(BIN)/mypy

unit: $(VENV)/.dev
	$(BIN)/pytest -q tests/unit

test: lint typecheck
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
