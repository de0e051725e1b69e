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
# Usage: bash benchmarks/peers/setup_llamacpp.sh [noamx]
# (VENV=... builds elsewhere, but generate_vs_peers.py looks only in the
# default places, llamacpp_engine.VENV_PYTHON and NOAMX_VENV_PYTHON.)
#
# "noamx" builds a second llama.cpp, native but for the AMX instructions
# (-mno-amx-*), into llamacpp-noamx-venv: on a CPU with AMX, llama.cpp's
# repacked AMX buffers take its quantized products, and on this project's
# Intel machines (Xeon, AMX-INT8, KVM) that path dies of SIGILL at its
# first prompt (docs/cpu-speed.md). Without AMX it repacks into its
# AVX-512 interleaved layouts instead, as it does on CPUs without AMX.
set -euo pipefail

FLAVOUR="${1:-}"
EXTRA_FLAGS=""
if [ "$FLAVOUR" = noamx ]; then
  VENV="${VENV:-$HOME/.cache/penzai_lm/peers/llamacpp-noamx-venv}"
  EXTRA_FLAGS="-DCMAKE_C_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16 -DCMAKE_CXX_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16"
elif [ -n "$FLAVOUR" ]; then
  echo "usage: $0 [noamx]" >&2
  exit 2
fi
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
CMAKE_ARGS="-DGGML_NATIVE=ON $EXTRA_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=2 \
  "$VENV/bin/pip" install --no-cache-dir --verbose llama-cpp-python
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
