#!/usr/bin/env bash
# Build .venv-vllm: real vLLM 0.33.0 (scheduler side, CPU torch) + NIXL + kvscope, for the
# contract tier (tests/vllm_contract). Recipe: shared/reference/vllm-on-cpu.md.
#
# Idempotent: a stamp holding this script's hash marks a complete venv; when it matches and the
# key imports work, the script exits at once. Any change to this file rebuilds what is missing
# (pip skips what is already installed, so a rebuild of a cached venv takes seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"
STAMP="$VENV/.kvscope-vllm-complete"
# The editable install registers kvscope's entry points: a pyproject change re-runs it.
WANT="$(cat "$0" scripts/venv-stamp.sh pyproject.toml | sha256sum | cut -d' ' -f1)"

probe() {
  VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$PY" - <<'EOF' >/dev/null 2>&1
import nixl, torch, vllm  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: F401
    NixlPullConnectorScheduler,
)
import kvscope.collector.vllm.instrumentor  # noqa: F401
import pytest, hypothesis  # noqa: F401
EOF
}

# Fast path (no imports): the stamp matches and the pinned distributions are still there.
installed() {
  compgen -G "$VENV/lib/python3*/site-packages/vllm-0.33.0.dist-info" >/dev/null &&
    compgen -G "$VENV/lib/python3*/site-packages/nixl-1.5.1.dist-info" >/dev/null
}

NAME=vllm-venv
. scripts/venv-stamp.sh
# The local index directories print one harmless "Location ... is ignored" line per package.
pip() { "$PY" -m pip install --quiet "$@" 2> >(grep -v "^WARNING: Location" >&2); }

# 1. CPU torch (the local wheel directory holds the +cpu build; PyPI's default is CUDA).
pip "torch==2.13.0"
# 2. vLLM without its declared deps: they would pull CUDA torch, triton, flashinfer, nvidia-*.
pip --no-deps "vllm==0.33.0" "xgrammar==0.2.8"
# 3. The light runtime packages vLLM's scheduler-side imports need (ranges from its metadata),
#    and python-json-logger, vLLM's --log-formatter json (the server-log contract tests).
pip packaging psutil "pyzmq>=25" urllib3 regex numpy "transformers>=5.16.1,<5.21.0" cbor2 \
  "aiohttp>=3.14.4" "requests>=2.33" "oss-harmony>=0.0.11" "openai>=2.25" "pillow>=13" \
  pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo "prometheus_client>=0.18" \
  "apache-tvm-ffi==0.1.11" "fastapi>=0.133,<0.137" partial-json-parser "llguidance>=1.7,<1.8" \
  einops "pydantic>=2.12" python-json-logger
# 4. NIXL (after CPU torch, so it does not drag a CUDA stack).
pip "nixl==1.5.1"
# 5. kvscope itself, without plotly/dash: only what the hooks and OTLP export import.
#    grpcio and the OTLP/gRPC exporter: kvscope serve's gRPC listener, and vLLM's own tracing
#    (vllm/tracing/otel.py imports the gRPC exporter; without it tracing is unavailable).
pip "opentelemetry-api>=1.27,<2" "opentelemetry-sdk>=1.27,<2" \
  "opentelemetry-exporter-otlp-proto-http>=1.27,<2" "opentelemetry-proto>=1.27,<2" \
  "grpcio>=1.63" "opentelemetry-exporter-otlp-proto-grpc>=1.27,<2" \
  "protobuf>=5,<8" "duckdb>=2.0,<3" "pyarrow>=16" "polars>=1.0,<3" "nvidia-ml-py>=12.535" \
  pytest "hypothesis>=6.100" "pytest-benchmark>=4"
pip --no-deps -e .

if ! probe; then
  echo "vllm-venv: $VENV built but the probe import failed; run:" >&2
  echo "  VLLM_TARGET_DEVICE=cpu $PY -c 'import vllm, nixl, kvscope.collector.vllm.instrumentor'" >&2
  exit 1
fi
echo "$WANT" >"$STAMP"
echo "vllm-venv: $VENV ready"
