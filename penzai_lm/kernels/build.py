"""Compiles penzai_lm's CPU kernels on first use and registers them with XLA.

The kernels (`matvec.cc`, `matvec_x8.cc`, `matvec_tiles.cc`,
`matvec_q4_tiles.cc`, `gemm_x8.cc`, `gemm_float.cc`, `dequantize.cc`,
`attention.cc`, `prompt_attention.cc` and `sampler.cc`, sharing `common.h`;
the two attention kernels also `attend.h`; `sampler.cc` also
`row_ops.h`, `matvec.cc` and `dequantize.cc` also `float_vec.h` and
`weight_formats.h`, `matvec_x8.cc` and `matvec_tiles.cc`
also `int8_dot.h` and `q8_blocks.h`, as does `gemm_x8.cc`, and
`matvec_x8.cc` and `gemm_x8.cc` `gemm_x8.h`; and `rows.cc`; and
`gguf_blocks.cc`, the loader's, called with ctypes, not XLA) are C++
against the XLA FFI headers that ship with jaxlib, built into one library
once per machine with the system C++ compiler (``-O3 -march=native``:
the vector width and the F16C instructions matter) and loaded with
ctypes. A cold build is one g++ process compiling the sources one after
the other (`sampler.cc` adds about 4 s of CPU time): four cold builds
(g++ 12.2) on this project's 2-core development machine took 25-37 s of
CPU time each, and 85-149 s of wall time, as other processes shared the
cores (load average 11-15); an idle core needs about the CPU time.

The library lives in ``$PENZAI_LM_KERNEL_CACHE`` if set, else
``$PENZAI_LM_CACHE/kernels`` (`penzai_lm.paths.cache_dir`), named by a
sha256 of everything it is built from: the sources and headers, the
compiler (its resolved path and ``--version`` output), the flags, the
jaxlib version (its FFI headers) and the CPU's flags. A sidecar
(``<library>.sha256``: size and sha256, written atomically after the
build) is checked before the library is loaded: a truncated library
crashed the process with SIGBUS when loaded, and a damaged one failed every
run. A damaged library (or one without its sidecar) is rebuilt with a
warning naming it; one that matches its sidecar but does not load (built
for another system) is rebuilt once, quietly.

Loading a library runs its code, so the folder must be the user's own: it
is created ``0700``, and a folder (or library) that another user owns or
that its group or others can write is refused (`penzai_lm.paths.
unsafe_reason`): nothing is loaded from it, a warning says why and how to
fix it, and decoding uses XLA's dots.

Where there is no compiler, or ``PENZAI_LM_CPU_KERNELS=0``, `cpu_kernels`
returns None and callers use XLA's own dots (correct, slower for bf16 and
quantized weights on CPU).

Which instructions: the library is built for the CPU it runs on
(``-march=native``), and the kernels pick their code paths from what that
enables when they are compiled (AVX-512 with VNNI and BF16, AVX-512, AVX2
with or without AVX-VNNI, or portable loops: `ops.int8_dot_isa` names
the int8 path, `ops.int8_gemm_isa` whether prompts use AMX tiles).
``PENZAI_LM_CPU_ISA`` forces a lower target on x86-64
(`ISAS`: ``avx512`` without VNNI, ``avx2``, ``portable``), each its own
library in the cache: the tests build and run every path this CPU can run,
and a path the CPU cannot run is refused rather than built.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from typing import Callable
import warnings

import jax

from penzai_lm import paths

TARGETS = (
    "pzlm_matvec_out_f32", "pzlm_matvec_out_bf16", "pzlm_matvec_out_f16",
    "pzlm_matvec_out_bf16_rows",
    "pzlm_matvec_in_f32", "pzlm_matvec_in_bf16", "pzlm_matvec_in_f16",
    "pzlm_matvec_q8", "pzlm_matvec_q8_16", "pzlm_matvec_q4",
    "pzlm_matvec_q4_0", "pzlm_matvec_q8_x8", "pzlm_matvec_q4_x8",
    "pzlm_matvec_q4_0_x8", "pzlm_matvec_q8_16_x8", "pzlm_matvec_q4_0_x8_tiles",
    "pzlm_matvec_q8_0_x8_tiles", "pzlm_matvec_q4_1_x8_tiles",
    "pzlm_matvec_q5_0_x8_tiles", "pzlm_matvec_q8_16_x8_tiles",
    "pzlm_matvec_q4_0_tiles", "pzlm_matvec_q4_1_tiles",
    "pzlm_gemm_q4_0_tiles", "pzlm_gemm_q4_1_tiles",
    "pzlm_decode_attention_f32", "pzlm_decode_attention_bf16",
    "pzlm_decode_attention_f16", "pzlm_prompt_attention_f32",
    "pzlm_prompt_attention_bf16", "pzlm_prompt_attention_f16", "pzlm_rows",
    "pzlm_after", "pzlm_sample", "pzlm_split", "pzlm_dequantize_q8", "pzlm_dequantize_q8_16",
    "pzlm_dequantize_q4", "pzlm_dequantize_q4_0_tiles",
    "pzlm_dequantize_q8_0_tiles", "pzlm_dequantize_q4_1_tiles",
    "pzlm_dequantize_q5_0_tiles", "pzlm_dequantize_q8_16_tiles",
)
_DIR = pathlib.Path(__file__).parent
_SOURCES = (_DIR / "matvec.cc", _DIR / "matvec_x8.cc", _DIR / "matvec_tiles.cc",
            _DIR / "matvec_q4_tiles.cc",
            _DIR / "gemm_x8.cc", _DIR / "gemm_float.cc",
            _DIR / "dequantize.cc", _DIR / "attention.cc",
            _DIR / "prompt_attention.cc", _DIR / "rows.cc",
            _DIR / "sampler.cc", _DIR / "gguf_blocks.cc")
_HEADERS = (_DIR / "common.h", _DIR / "attend.h", _DIR / "row_ops.h",
            _DIR / "int8_dot.h", _DIR / "q8_blocks.h", _DIR / "gemm_x8.h", _DIR / "float_vec.h",
            _DIR / "weight_formats.h")
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")

# PENZAI_LM_CPU_ISA -> (target flags, CPU flags it needs). x86-64 levels:
# v4 is AVX-512 F/BW/CD/DQ/VL (no VNNI), v3 AVX2 with FMA and F16C.
ISAS = {
    "native": (("-march=native",), frozenset()),
    "avx512": (("-march=x86-64-v4", "-mtune=native"),
               frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    "avx2": (("-march=x86-64-v3", "-mtune=native"),
             frozenset({"avx2", "fma", "f16c"})),
    "portable": (("-march=x86-64", "-mtune=native"), frozenset()),
}


def isa() -> str:
  """The target the kernels are built for: ``PENZAI_LM_CPU_ISA`` (one of
  `ISAS`), ``native`` by default.

  Raises:
    ValueError: For an unknown name, a forced target off x86-64, or one
      whose instructions this CPU lacks (the library would die of SIGILL).
  """
  name = os.environ.get("PENZAI_LM_CPU_ISA", "native") or "native"
  if name not in ISAS:
    raise ValueError(
        f"PENZAI_LM_CPU_ISA={name!r} is not a kernel target; choose one of"
        f" {', '.join(ISAS)} (native: this CPU's best).")
  if name != "native" and platform.machine() not in ("x86_64", "AMD64"):
    raise ValueError(
        f"PENZAI_LM_CPU_ISA={name!r} is an x86-64 target and this is"
        f" {platform.machine()}; unset it (native).")
  missing = ISAS[name][1] - set(_cpu_fingerprint().split())
  if missing:
    raise ValueError(
        f"PENZAI_LM_CPU_ISA={name!r} needs {', '.join(sorted(missing))},"
        " which this CPU lacks; choose a lower target or unset it.")
  return name


def compile_flags() -> tuple[str, ...]:
  """The compiler flags of the library for `isa`."""
  return _FLAGS + ISAS[isa()][0]


def _cache_dir() -> pathlib.Path:
  return paths.kernels_dir()


def _cpu_fingerprint() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next((line for line in f if line.startswith("flags")), "")
  except OSError:
    return platform.processor()


def cpu_flags() -> frozenset[str]:
  """This CPU's feature flags as Linux lists them (``avx512_bf16``,
  ``amx_tile``, ...); empty where /proc/cpuinfo has no ``flags`` line
  (other systems, other architectures)."""
  line = _cpu_fingerprint()
  if not line.startswith("flags"):
    return frozenset()
  return frozenset(line.partition(":")[2].split())


def _compiler_identity(compiler: str) -> str:
  """The compiler's resolved path and version (a new g++ behind the same
  path is a new key)."""
  try:
    version = subprocess.run([compiler, "--version"], capture_output=True,
                             text=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError):
    version = ""
  found = shutil.which(compiler)
  return f"{os.path.realpath(found) if found else compiler}|{version}"


def library_key(compiler: str) -> str:
  """sha256 of everything the library is built from (module docstring)."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  key = hashlib.sha256()
  for path in _SOURCES + _HEADERS:
    key.update(f"{path.name}\0".encode())
    key.update(path.read_bytes())
  for part in (_compiler_identity(compiler), " ".join(compile_flags()),
               jaxlib.__version__, _cpu_fingerprint()):
    key.update(b"\0" + part.encode())
  return key.hexdigest()


def library_path(compiler: str) -> pathlib.Path:
  """Where the library built by ``compiler`` is kept (named by its key)."""
  return _cache_dir() / f"kernels-{library_key(compiler)[:32]}.so"


def _sha256(path: str | os.PathLike) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 20):
      digest.update(block)
  return digest.hexdigest()


def _sidecar(library: pathlib.Path) -> pathlib.Path:
  return library.with_name(library.name + ".sha256")


def check_library(library: pathlib.Path) -> str | None:
  """Why ``library`` may not be loaded (None: intact by its sidecar).

  Reads and hashes the file (0.75 MB: milliseconds); never loads it.
  """
  try:
    size, digest = _sidecar(library).read_text().split()
    recorded = int(size)
  except (OSError, ValueError):
    return f"no valid record of its build ({_sidecar(library).name})"
  try:
    found = os.stat(library).st_size
    if not os.path.isfile(library):
      return "it is not a regular file"
    if found != recorded:
      return f"it is {found} bytes, {recorded} when it was built"
    if _sha256(library) != digest:
      return "its sha256 differs from the one recorded when it was built"
  except OSError as e:
    return f"it cannot be read ({e})"
  return None


@contextlib.contextmanager
def _build_lock(library: pathlib.Path):
  """One build at a time per library (test workers start together)."""
  try:
    import fcntl  # pylint: disable=g-import-not-at-top
    f = open(library.with_name(f".{library.name}.lock"), "w")
  except (ImportError, OSError):  # No fcntl, or a read-only directory.
    yield
    return
  with f:
    fcntl.flock(f, fcntl.LOCK_EX)
    yield


def _remove(path: pathlib.Path) -> None:
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path)
  elif os.path.lexists(path):
    path.unlink()


def cached_library(library: pathlib.Path,
                   build: Callable[[pathlib.Path], None]) -> pathlib.Path:
  """``library``, built with ``build(path)`` unless intact, ready to load.

  The build writes a temporary file beside the library, which is renamed
  into place; then the sidecar is written the same way. A library present
  but damaged is rebuilt with a warning naming it.

  Raises:
    OSError, subprocess.CalledProcessError: If building fails.
  """
  if check_library(library) is None:
    return library
  paths.private_dir(library.parent)
  with _build_lock(library):
    why = check_library(library)  # Another process may have built it meanwhile.
    if why is None:
      return library
    if os.path.lexists(library):
      warnings.warn(f"penzai_lm: the cached CPU kernel library {library} is"
                    f" damaged ({why}); rebuilding it.", stacklevel=3)
      _remove(library)
    with _temporary(library) as tmp:
      build(tmp)
      record = f"{os.path.getsize(tmp)} {_sha256(tmp)}\n"
      os.replace(tmp, library)
    with _temporary(library) as tmp:
      tmp.write_text(record)
      os.replace(tmp, _sidecar(library))
  return library


@contextlib.contextmanager
def _temporary(beside: pathlib.Path):
  """A new empty file's path in ``beside``'s directory, removed unless
  renamed away."""
  fd, tmp = tempfile.mkstemp(prefix=f".{beside.name}.", suffix=".tmp",
                             dir=beside.parent)
  os.close(fd)
  try:
    yield pathlib.Path(tmp)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _compile(compiler: str, output: pathlib.Path) -> None:
  subprocess.run(
      [compiler, *compile_flags(), f"-I{jax.ffi.include_dir()}", f"-I{_DIR}",
       *map(str, _SOURCES), "-o", str(output)],
      check=True, capture_output=True, text=True)


def find_compiler() -> str | None:
  """``$CXX``, else the first of g++, c++ and clang++ on the PATH."""
  return os.environ.get("CXX") or shutil.which("g++") or shutil.which(
      "c++") or shutil.which("clang++")


def _unsafe(library: pathlib.Path) -> str | None:
  """Why ``library`` may not be loaded from where it is (its folder or the
  file another user's, or writable by others), or None."""
  problem = paths.unsafe_reason(library.parent)
  what = f"the folder {library.parent}"
  if problem is None and hasattr(os, "getuid") and os.path.exists(library):
    st = os.stat(library)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
      problem = (f"not yours alone (owner {st.st_uid}, mode"
                 f" {st.st_mode & 0o777:o})", "")
      what = f"the library {library}"
  if problem is None:
    return None
  why, fix = problem
  return (f"penzai_lm: refusing to load the CPU kernels from {what}: it is"
          f" {why}. Loading a library runs its code, so it must be yours and"
          f" writable by you alone: {fix}point PENZAI_LM_KERNEL_CACHE (or"
          " PENZAI_LM_CACHE) at a folder of your own. CPU decoding uses"
          " XLA's dots meanwhile.")


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
  """The compiled kernel library, registered with XLA; None if unavailable.

  Raises:
    penzai_lm.paths.CacheDirError: If the cache directory cannot be made.
    ValueError: If ``PENZAI_LM_CPU_ISA`` names no target this CPU runs
      (`isa`).
  """
  if os.environ.get("PENZAI_LM_CPU_KERNELS", "1") == "0":
    return None
  compiler = find_compiler()
  if compiler is None:
    warnings.warn("penzai_lm: no C++ compiler found, so CPU decoding uses "
                  "XLA's dots (slower for bfloat16 and quantized weights). "
                  "Install g++ or set CXX.", stacklevel=2)
    return None
  library = library_path(compiler)
  build = functools.partial(_compile, compiler)
  try:
    refused = _unsafe(library)  # Before building into the folder,
    if refused is None:
      cached_library(library, build)
      refused = _unsafe(library)  # and before loading what is there.
    if refused:
      warnings.warn(refused, stacklevel=2)
      return None
    try:
      lib = ctypes.cdll.LoadLibrary(str(library))
    except OSError:  # Intact by its sidecar, but built for another system.
      _remove(library)
      _remove(_sidecar(library))
      cached_library(library, build)
      lib = ctypes.cdll.LoadLibrary(str(library))
    capsules = [jax.ffi.pycapsule(getattr(lib, name)) for name in TARGETS]
  except (OSError, AttributeError, subprocess.CalledProcessError) as e:
    detail = getattr(e, "stderr", "") or str(e)
    warnings.warn(f"penzai_lm: building or loading the CPU kernels ({library})"
                  f" failed, so CPU decoding uses XLA's dots: {detail[-2000:]}",
                  stacklevel=2)
    return None
  for name, capsule in zip(TARGETS, capsules):
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  return lib
