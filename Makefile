# kvtool: `make run` chats with the default model, `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU wheel of torch 2.13.0: a plain `torch` requirement could pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
MODEL  ?= smollm2

.PHONY: install bytecode run test lint clean

# Two stamps: `make run` installs what a chat needs (torch, the runtime dependencies); `make
# install`, `make test` and `make lint` add the test and dev extras (Triton, pytest, ruff, mypy).
install: $(VENV)/.dev bytecode

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime
	$(PIP) install --quiet -e '.[dev]'
	touch $@

# pip writes bytecode for what it installs, but an editable install leaves kvtool's own modules as
# source; with PYTHONDONTWRITEBYTECODE set, every start would compile them again.
bytecode: $(VENV)/.runtime
	$(PY) -m compileall -q kvtool commands kernels

run: $(VENV)/.runtime bytecode
	$(VENV)/bin/kvtool models fetch $(MODEL)
	$(VENV)/bin/kvtool run -m $(MODEL)

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy commands kvtool kernels

clean:
	rm -rf $(VENV) build dist *.egg-info
	find kvtool commands kernels tests -name __pycache__ -prune -exec rm -rf {} +
