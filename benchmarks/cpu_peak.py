"""This CPU's float32 multiply-add peak, the roofline of a float prompt.

Compiles (with ``$CXX``, default ``g++``, ``-O2 -march=native``) and runs a
loop of 12 independent chains of 16-float fused multiply-adds (AVX-512;
8-float AVX2 ones where the CPU has no AVX-512), on 1 thread and then on
every core's worth of threads at once, and prints GFLOP/s (2 per
multiply-add), the best of ``--repeats``. A GEMM's GFLOP/s (``jax.profiler``
over a prefill, `docs/cpu-speed.md`) read against it says how much of the
machine a float prompt uses.

  python benchmarks/cpu_peak.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile

_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
typedef __m512 V;
constexpr int kLanes = 16;
static V Set(float x) { return _mm512_set1_ps(x); }
static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static float Sum(V v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 V;
constexpr int kLanes = 8;
static V Set(float x) { return _mm256_set1_ps(x); }
static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static float Sum(V v) {
  float f[8];
  _mm256_storeu_ps(f, v);
  return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
#endif

static float Chains(long iters) {
  const V b = Set(1.0000001f), c = Set(1e-7f);
  V a0 = Set(0), a1 = Set(1), a2 = Set(2), a3 = Set(3), a4 = Set(4),
    a5 = Set(5), a6 = Set(6), a7 = Set(7), a8 = Set(8), a9 = Set(9),
    a10 = Set(10), a11 = Set(11);
  for (long n = 0; n < iters; ++n) {
    a0 = Fma(a0, b, c); a1 = Fma(a1, b, c); a2 = Fma(a2, b, c);
    a3 = Fma(a3, b, c); a4 = Fma(a4, b, c); a5 = Fma(a5, b, c);
    a6 = Fma(a6, b, c); a7 = Fma(a7, b, c); a8 = Fma(a8, b, c);
    a9 = Fma(a9, b, c); a10 = Fma(a10, b, c); a11 = Fma(a11, b, c);
  }
  return Sum(a0) + Sum(a1) + Sum(a2) + Sum(a3) + Sum(a4) + Sum(a5) +
         Sum(a6) + Sum(a7) + Sum(a8) + Sum(a9) + Sum(a10) + Sum(a11);
}

int main(int argc, char** argv) {
  const int threads = std::atoi(argv[1]);
  const long iters = 50000000;
  std::vector<float> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&sink, t, iters] { sink[t] = Chains(iters); });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(
      std::chrono::steady_clock::now() - start).count();
  const double flops = 2.0 * kLanes * 12 * iters * threads;
  std::printf("%.1f %d %g\n", flops / s / 1e9, kLanes, sink[0]);
}
"""


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  cxx = os.environ.get("CXX", "g++")
  if shutil.which(cxx) is None:
    raise SystemExit(f"no C++ compiler {cxx!r}: set CXX or install g++.")
  with tempfile.TemporaryDirectory() as tmp:
    src, exe = os.path.join(tmp, "peak.cc"), os.path.join(tmp, "peak")
    with open(src, "w") as f:
      f.write(_SOURCE)
    subprocess.run([cxx, "-O2", "-march=native", "-pthread", src, "-o", exe],
                   check=True)
    for threads in sorted({1, args.threads}):
      runs = [subprocess.run([exe, str(threads)], check=True,
                             capture_output=True, text=True).stdout.split()
              for _ in range(args.repeats)]
      best = max(float(r[0]) for r in runs)
      print(f"{threads} thread(s), {runs[0][1]}-float FMAs: {best:.0f} GFLOP/s"
            f" (best of {args.repeats})")


if __name__ == "__main__":
  main()
