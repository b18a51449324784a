# Quick start: `make demo` and `make test` on a fresh machine. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# The pinned CPU build; it is installed before the project so no CUDA build is ever pulled.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test lint format bench clean

$(VENV)/.installed: setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m examples.demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set, each of the suite's ~1,000
# processes would compile the project's modules again (a stale file is recompiled, never used).
test: lint
	$(PY) -m compileall -q -j 0 p2p_state recovery launcher bench dataload examples tests
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/p2p-bench replicate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
