# Sourced by scripts/vllm-venv.sh and scripts/vllm-cpu-venv.sh once they have set NAME, VENV, PY,
# PYTHON, STAMP and WANT (a hash of what the venv is built from, this file included) and defined
# installed() (the pinned distributions are there, checked without importing them).
# A complete venv, one whose stamp holds WANT, ends the calling script at once; otherwise the
# venv is made if it is missing and the caller goes on to install into it.
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && installed; then
  echo "$NAME: $VENV is complete"
  exit 0
fi
test -x "$PY" || "$PYTHON" -m venv "$VENV"
