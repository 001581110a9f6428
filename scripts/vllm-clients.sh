#!/usr/bin/env bash
# Fetch vLLM 0.33.0's multi-turn proxy and benchmark client, unchanged, for the contract tier
# (tests/vllm_contract/test_vllm_clients.py), and install what they import into .venv-vllm.
#
# The two scripts ship only in vLLM's sdist (not in the wheel), and vLLM's code is never copied
# into this repository: the sdist is downloaded (sha256-checked) into the venv's cache folder,
# and just these files are extracted next to it:
#   examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py
#   benchmarks/multi_turn/{benchmark_serving_multi_turn,bench_dataset,bench_utils}.py
# pip resolves the sdist from the machine's configured package index (so a mirror works; no
# index is named here) and checks its sha256 before running anything from it. pip then
# prepares the sdist's metadata, which runs vLLM's setup.py: without build isolation, on
# .venv-vllm's CPU torch, with no target device and the version pinned (so no CUDA toolkit is
# asked for and the metadata's version is the one requested), that is a few seconds of Python.
#
# VLLM_SDIST=/path/to/vllm-0.33.0.tar.gz uses a local copy instead (checked against the same
# digest). Idempotent: a stamp holding this script's hash marks a complete set-up; when it
# matches and the files are there, the script exits at once. Needs .venv-vllm
# (bash scripts/vllm-venv.sh) first.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"
CACHE="$VENV/vllm-sdist"
ROOT="$CACHE/vllm-0.33.0"
TARBALL="$CACHE/vllm-0.33.0.tar.gz"
STAMP="$CACHE/.kvscope-clients-complete"
DOWNLOAD="$CACHE/download"
SDIST_SHA256="f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
FILES=(
  examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py
  benchmarks/multi_turn/benchmark_serving_multi_turn.py
  benchmarks/multi_turn/bench_dataset.py
  benchmarks/multi_turn/bench_utils.py
)
WANT="$(sha256sum "$0" | cut -d' ' -f1)"

extracted() {
  local f
  for f in "${FILES[@]}"; do test -f "$ROOT/$f" || return 1; done
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && extracted; then
  echo "vllm-clients: $ROOT is complete"
  exit 0
fi

if ! test -x "$PY"; then
  echo "vllm-clients: $PY not found; build it first: bash scripts/vllm-venv.sh" >&2
  exit 1
fi
mkdir -p "$CACHE"

digest_ok() { echo "$SDIST_SHA256  $1" | sha256sum --check --status; }

if ! { test -f "$TARBALL" && digest_ok "$TARBALL"; }; then
  if [ -n "${VLLM_SDIST:-}" ]; then
    cp "$VLLM_SDIST" "$TARBALL.part"
  else
    # What vLLM's setup.py imports at metadata time beyond .venv-vllm (torch, packaging and
    # jinja2 are there already); its build-system pins setuptools below 81.
    "$PY" -m pip install --quiet "setuptools>=77.0.3,<81" "setuptools-scm>=8" setuptools-rust \
      2> >(grep -v "^WARNING: Location" >&2)
    rm -rf "$DOWNLOAD"
    mkdir -p "$DOWNLOAD"
    # --require-hashes: pip checks the archive before it runs the sdist's setup.py.
    echo "vllm==0.33.0 --hash=sha256:$SDIST_SHA256" >"$DOWNLOAD/requirement.txt"
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=0.33.0 \
      "$PY" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
      --require-hashes -r "$DOWNLOAD/requirement.txt" -d "$DOWNLOAD" \
      2> >(grep -v "^WARNING: Location" >&2)
    mv "$DOWNLOAD/vllm-0.33.0.tar.gz" "$TARBALL.part"
    rm -rf "$DOWNLOAD"
  fi
  if ! digest_ok "$TARBALL.part"; then
    rm -f "$TARBALL.part"
    echo "vllm-clients: the sdist's sha256 is not $SDIST_SHA256" \
      "(${VLLM_SDIST:-from the configured package index})" >&2
    exit 1
  fi
  mv "$TARBALL.part" "$TARBALL"
fi
tar -xzf "$TARBALL" -C "$CACHE" "${FILES[@]/#/vllm-0.33.0/}"

# What the scripts import beyond .venv-vllm's vLLM set-up (benchmarks/multi_turn/requirements.txt
# and the proxy's docstring): pandas, tqdm, numpy, transformers, aiohttp; fastapi, uvicorn,
# httpx. xlsxwriter is only for the benchmark's -e/--excel-output, which the tier does not use.
probe() {
  "$PY" - <<'EOF' >/dev/null 2>&1
import aiohttp, fastapi, httpx, numpy, pandas, tqdm, transformers, uvicorn  # noqa: F401
EOF
}
if ! probe; then
  "$PY" -m pip install --quiet "pandas>=2.0.0" "tqdm>=4.66" uvicorn httpx \
    2> >(grep -v "^WARNING: Location" >&2)
  if ! probe; then
    echo "vllm-clients: installed, but the probe import failed; run:" >&2
    echo "  $PY -c 'import aiohttp, fastapi, httpx, numpy, pandas, tqdm, transformers, uvicorn'" >&2
    exit 1
  fi
fi
echo "$WANT" >"$STAMP"
echo "vllm-clients: $ROOT ready"
