"""Compiles penzai_lm's CPU kernels on first use and registers them with XLA.

The kernels (`matvec.cc`, `attention.cc`, sharing `common.h`, and
`rows.cc`) are C++
against the XLA FFI headers that ship with jaxlib, built into one library
once per machine with the system C++ compiler
(``-O3 -march=native``: the vector width and the F16C instructions matter)
into ``$PENZAI_LM_KERNEL_CACHE`` (default ``~/.cache/penzai_lm/kernels``),
keyed by the source, the compiler, the jaxlib version and the CPU, and
loaded with ctypes. Building takes about 8 s the first time.

Where there is no compiler, or ``PENZAI_LM_CPU_KERNELS=0``, `cpu_kernels`
returns None and callers use XLA's own dots (correct, slower for bf16 and
quantized weights on CPU).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax

TARGETS = (
    "pzlm_matvec_out_f32", "pzlm_matvec_out_bf16", "pzlm_matvec_out_f16",
    "pzlm_matvec_in_f32", "pzlm_matvec_in_bf16", "pzlm_matvec_in_f16",
    "pzlm_matvec_q8", "pzlm_matvec_q8_16", "pzlm_matvec_q4",
    "pzlm_decode_attention_f32", "pzlm_decode_attention_bf16",
    "pzlm_decode_attention_f16", "pzlm_rows", "pzlm_after",
)
_DIR = pathlib.Path(__file__).parent
_SOURCES = (_DIR / "matvec.cc", _DIR / "attention.cc", _DIR / "rows.cc")
_HEADERS = (_DIR / "common.h",)
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread",
          "-w")


def _cache_dir() -> pathlib.Path:
  default = pathlib.Path.home() / ".cache" / "penzai_lm" / "kernels"
  return pathlib.Path(os.environ.get("PENZAI_LM_KERNEL_CACHE", default))


def _cpu_fingerprint() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next((line for line in f if line.startswith("flags")), "")
  except OSError:
    return platform.processor()


def _compile(compiler: str, output: pathlib.Path) -> None:
  output.parent.mkdir(parents=True, exist_ok=True)
  # Build beside the target and rename: concurrent processes (test workers)
  # never load a half-written library.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=output.parent)
  os.close(fd)
  try:
    subprocess.run(
        [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{_DIR}",
         *map(str, _SOURCES), "-o", tmp],
        check=True, capture_output=True, text=True)
    os.replace(tmp, output)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
  """The compiled kernel library, registered with XLA; None if unavailable."""
  if os.environ.get("PENZAI_LM_CPU_KERNELS", "1") == "0":
    return None
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which(
      "c++") or shutil.which("clang++")
  if compiler is None:
    warnings.warn("penzai_lm: no C++ compiler found, so CPU decoding uses "
                  "XLA's dots (slower for bfloat16 and quantized weights). "
                  "Install g++ or set CXX.", stacklevel=2)
    return None
  key = hashlib.sha256()
  for part in (*(f.read_bytes() for f in _SOURCES + _HEADERS),
               compiler.encode(), " ".join(_FLAGS).encode(),
               jax.__version__.encode(), _cpu_fingerprint().encode()):
    key.update(part)
  library = _cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
  if not library.exists():
    try:
      _compile(compiler, library)
    except (OSError, subprocess.CalledProcessError) as e:
      detail = getattr(e, "stderr", "") or str(e)
      warnings.warn(f"penzai_lm: building the CPU kernels failed, so CPU "
                    f"decoding uses XLA's dots: {detail[-2000:]}", stacklevel=2)
      return None
  lib = ctypes.cdll.LoadLibrary(str(library))
  for name in TARGETS:
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)),
                                platform="cpu")
  return lib
