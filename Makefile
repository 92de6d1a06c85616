PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Most tests wait on sockets and subprocesses, not the CPU, so a few more workers
# than cores finish sooner; TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= 4

.PHONY: install demo test lint typecheck unit docs docs-serve clean test-vllm

$(BIN)/spillgate: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.dev: $(BIN)/spillgate
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# `spillgate` lives in $(VENV)/bin: `. $(VENV)/bin/activate` puts it on PATH in a shell
install: $(BIN)/spillgate
	@echo "installed; to type spillgate in this shell: . $(VENV)/bin/activate"

demo: $(BIN)/spillgate
	$(BIN)/spillgate demo

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.dev
	$(BIN)/mypy

unit: $(VENV)/.dev
	$(BIN)/pytest -q tests/unit

# The documentation site (mkdocs.yml), built with warnings as errors into a directory that
# is thrown away: it checks the pages and their links, it publishes nothing (not -q:
# mkdocs then drops the warnings --strict counts).
docs: $(VENV)/.dev
	@site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d $$site; \
	  status=$$?; rm -rf $$site; exit $$status

# the site at http://127.0.0.1:8000 while you edit its pages
docs-serve: $(VENV)/.dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test: lint typecheck docs
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

# Opt-in, not part of `test`: a real vLLM (CPU build, a tiny random Llama; the first run
# installs it into $(VLLM_VENV), minutes) started by loadtest/real_vllm/serve.sh on
# $(VLLM_PORT), then tests/vllm/ against it; the server is stopped after.
VLLM_PORT ?= 8101
VLLM_VENV ?= /tmp/vllmenv
test-vllm: $(VENV)/.dev
	VLLM_VENV=$(VLLM_VENV) loadtest/real_vllm/setup.sh
	VLLM_VENV=$(VLLM_VENV) loadtest/real_vllm/serve.sh $(VLLM_PORT) >/dev/null
	SPILLGATE_VLLM_URL=http://127.0.0.1:$(VLLM_PORT) $(BIN)/pytest -q tests/vllm; \
	  status=$$?; loadtest/real_vllm/serve.sh stop $(VLLM_PORT); exit $$status

clean:
	rm -rf $(VENV) build *.egg-info
