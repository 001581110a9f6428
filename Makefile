# The README's two commands: `make demo` and `make test`. Both set up what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvscope-installed

VLLM_VENV := .venv-vllm

.PHONY: demo test lint typecheck unit vllm-contract bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvscope demo --out out

test: $(STAMP) lint typecheck unit vllm-contract

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest

# The contract tier: kvscope's hooks against the real vLLM 0.33.0 classes, and vLLM's own
# multi-turn proxy and benchmark client (from its PyPI sdist, run unchanged) against the emulator,
# in a separate venv (CPU torch, vllm --no-deps, nixl; about 3 GB, built once).
vllm-contract:
	bash scripts/vllm-venv.sh
	bash scripts/vllm-clients.sh
	$(VLLM_VENV)/bin/python -m pytest tests/vllm_contract -W ignore::DeprecationWarning -W ignore::FutureWarning

bench: $(STAMP)
	$(PY) tests/benchmarks/bench_store_throughput.py

clean:
	rm -rf out .pytest_cache .mypy_cache .ruff_cache
