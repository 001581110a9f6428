# The README's two commands: `make demo` and `make test`. Both set up what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvscope-installed

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvscope demo --out out

test: $(STAMP) lint typecheck unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) tests/benchmarks/bench_store_throughput.py

clean:
	rm -rf out .pytest_cache .mypy_cache .ruff_cache
