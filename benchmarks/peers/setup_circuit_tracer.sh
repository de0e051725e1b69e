#!/usr/bin/env bash
# Installs circuit-tracer 0.5.0 for benchmarks/circuits_vs_circuit_tracer.py.
#
# circuit-tracer pins transformers<=4.57.3 and needs transformer_lens and
# torch, which do not fit the project's own virtualenv (transformers 5), so
# it lives in its own virtualenv outside the repository and outside CI.
# Torch is pinned to 2.13.0 first: on these machines pip takes that release
# from a local CPU build; an unpinned torch would pull a CUDA build of
# several GB. Only PyPI is needed (no Hugging Face hub access: the
# benchmark builds its model offline). Idempotent: does nothing if the
# virtualenv already imports circuit_tracer.
#
# Usage: bash benchmarks/peers/setup_circuit_tracer.sh
# (VENV=... installs elsewhere, but circuits_vs_circuit_tracer.py looks only
# in the default place unless given --peer-python.)
set -euo pipefail

VENV="${VENV:-$HOME/.cache/penzai_lm/peers/circuit-tracer-venv}"
TORCH="${TORCH:-torch==2.13.0}"

PY="$VENV/bin/python"
if [ -x "$PY" ] && "$PY" -c "import circuit_tracer, transformer_lens" \
    2>/dev/null; then
  echo "circuit-tracer venv ready: $VENV"
  exit 0
fi

mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
# Torch first, pinned, so that the dependencies below find it satisfied.
"$VENV/bin/pip" install "$TORCH"
# transformer-lens pinned to the release pip's resolver settles on (it
# backtracks from 4.x under circuit-tracer's transformers<=4.57.3).
"$VENV/bin/pip" install "circuit-tracer==0.5.0" "transformer-lens==3.2.1" \
  "$TORCH"
"$PY" -c "import circuit_tracer, torch, transformers
print('circuit-tracer 0.5.0, torch', torch.__version__,
      'transformers', transformers.__version__)"
