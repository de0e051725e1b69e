"""The kernels on every instruction path this CPU can run.

The suite's other kernel tests run the library built for this CPU (its best
path: AVX-512 with VNNI here). Each test here forces a lower target with
``PENZAI_LM_CPU_ISA`` (`penzai_lm.kernels.build.ISAS`), builds that library
into a folder of its own, and runs the kernels' parity tests against numpy
and penzai on it in a fresh process: the products (float, bfloat16,
float16, int8, 4-bit, int8 groups of 16), the int8-activation products,
the 4-bit float products on tiles and
decode and prompt attention. A target this CPU lacks is skipped, saying which
instructions are missing, and so is the target the native build already is
(an AVX2-only CPU's).
"""

import os
import pathlib
import platform
import subprocess
import sys

import pytest

from penzai_lm.kernels import build
from penzai_lm.kernels import ops

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason="no C++ compiler for the kernels")

HERE = pathlib.Path(__file__).parent
# The int8 path each forced target compiles to (int8_dot.h's Isa()).
EXPECTED = {"avx512": "avx512bw", "avx2": "avx2", "portable": "portable"}
TESTS = ["test_ops.py", "test_int8_activations.py", "test_tiles.py",
         "test_float_tiles.py", "test_gemm_float.py",
         "test_gguf_blocks.py::test_values_are_gguf_pys_bit_for_bit",
         "test_gguf_blocks.py::test_quantized_weights_decode_to_gguf_pys_values",
         "test_attention.py::test_kernel_matches_reference",
         "test_attention.py::test_prompt_kernel_matches_reference"]


def _env(isa: str, cache: pathlib.Path) -> dict:
  return dict(os.environ, PENZAI_LM_CPU_ISA=isa,
              PENZAI_LM_KERNEL_CACHE=str(cache), JAX_PLATFORMS="cpu")


@pytest.mark.parametrize("isa", sorted(EXPECTED))
def test_the_kernels_on_a_forced_path(isa, tmp_path):
  if platform.machine() not in ("x86_64", "AMD64"):
    pytest.skip("the forced targets are x86-64 levels")
  missing = build.ISAS[isa][1] - set(build._cpu_fingerprint().split())
  if missing:
    pytest.skip(f"this CPU lacks {sorted(missing)} for {isa}")
  if ops.int8_dot_isa() == EXPECTED[isa] and ops.int8_gemm_isa() == "none":
    # An AVX2-only CPU's native build is the avx2 path itself (4 minutes
    # of the suite there to run the same tests on a second copy of it).
    pytest.skip(f"the native build here is the {isa} path"
                f" (int8_dot_isa() == {EXPECTED[isa]!r}): the rest of"
                " tests/kernels runs it")
  cache = tmp_path / "kernels"
  env = _env(isa, cache)
  probe = subprocess.run(
      [sys.executable, "-c", "from penzai_lm.kernels import build, ops;"
       " print(build.compile_flags()); print(ops.int8_dot_isa());"
       " print(ops.int8_gemm_isa())"],
      env=env, capture_output=True, text=True, timeout=900)
  assert probe.returncode == 0, probe.stderr[-3000:]
  flags, path, tiles = probe.stdout.strip().splitlines()[-3:]
  assert "-march=native" not in flags and path == EXPECTED[isa]
  assert tiles == "none"  # no forced target has AMX: prompts run as rows
  assert len(list(cache.glob("kernels-*.so"))) == 1
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
       "-o", "addopts=", *(str(HERE / t) for t in TESTS)],
      env=env, capture_output=True, text=True, timeout=1800, cwd=HERE)
  assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
  assert " passed" in done.stdout and "failed" not in done.stdout


def test_a_target_the_cpu_lacks_or_a_typo_is_refused(monkeypatch):
  monkeypatch.setenv("PENZAI_LM_CPU_ISA", "avx1024")
  with pytest.raises(ValueError, match="avx1024.*native"):
    build.compile_flags()
  monkeypatch.setenv("PENZAI_LM_CPU_ISA", "avx512")
  monkeypatch.setattr(build, "_cpu_fingerprint", lambda: "flags: sse2 avx2")
  if platform.machine() in ("x86_64", "AMD64"):
    with pytest.raises(ValueError, match="needs avx512bw.*lacks"):
      build.compile_flags()
  monkeypatch.setenv("PENZAI_LM_CPU_ISA", "")
  assert "-march=native" in build.compile_flags()
