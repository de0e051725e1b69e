#!/usr/bin/env bash
# Builds llama.cpp (through llama-cpp-python) for generate_vs_peers.py.
#
# The build lives in its own virtualenv outside the repository and outside
# CI: llama-cpp-python has no wheel on PyPI, so `pip install` compiles
# llama.cpp from source (10 minutes on 2 idle cores, 25 when shared). Idempotent: does
# nothing if the virtualenv already imports llama_cpp. Then run
# `python benchmarks/peers/make_ggufs.py` (from the repository's own
# virtualenv or this one) to write the GGUF variants.
#
# Usage: bash benchmarks/peers/setup_llamacpp.sh
# (VENV=... builds elsewhere, but generate_vs_peers.py looks only in the
# default place, llamacpp_engine.VENV_PYTHON.)
set -euo pipefail

VENV="${VENV:-$HOME/.cache/penzai_lm/peers/llamacpp-venv}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, gguf, numpy" 2>/dev/null; then
  echo "llama.cpp venv ready: $VENV ($("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)'))"
  exit 0
fi

mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install numpy gguf
# Compiles llama.cpp for this CPU (AVX2/AVX-512 as available).
CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
  "$VENV/bin/pip" install --no-cache-dir --verbose llama-cpp-python
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
