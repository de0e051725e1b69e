"""A prompt's products on XLA's GEMM: float32, bfloat16, and bfloat16
converted to float32 first.

Times one SmolLM2-135M layer's seven projections (out-major weights, as the
loaders lay them out) as ``jax.lax.dot_general`` with float32 results, the
product `penzai_lm.kernels.layers.kernel_contract` writes for more rows
than a decode step, three ways: float32 operands; bfloat16 operands (XLA's
bf16 dot: YNNPACK, on ``vdpbf16ps`` where the CPU has it); bfloat16 values
converted to float32 before the dot (what the kernel layers do where
`wide_bf16_in_float32` is true: x86-64 without ``avx512_bf16`` or
``amx_bf16``). Prints the minimum over repeats and GFLOP/s.

  python benchmarks/prompt_products.py [--rows 128,1024] [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm.kernels import build
from penzai_lm.kernels import layers

# SmolLM2-135M: hidden 576, 9 query heads and 3 key/value heads of 64, MLP
# 1536. Out-major [N, K]: q, k, v, o, gate, up, down.
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576),
          (1536, 576), (576, 1536))
MODES = ("float32", "bfloat16", "bfloat16 in float32")


def _layer(mode):
  def products(xs, ws):
    outs = []
    for w in ws:
      x = xs[w.shape[1]]
      if mode == "bfloat16 in float32":
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
      outs.append(jax.lax.dot_general(
          x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32))
    return outs
  return jax.jit(products)


def _time(rows, mode, repeats, rng):
  dtype = jnp.float32 if mode == "float32" else jnp.bfloat16
  xs = {k: jnp.asarray(rng.standard_normal((rows, k), np.float32), dtype)
        for k in {k for _, k in SHAPES}}
  ws = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.05, dtype)
        for s in SHAPES]
  fn = _layer(mode)
  jax.block_until_ready(fn(xs, ws))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(xs, ws))
    times.append(time.perf_counter() - start)
  return min(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="128,1024",
                      help="comma-separated row counts (default 128,1024)")
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args()
  try:
    rows_list = [int(r) for r in args.rows.split(",")]
  except ValueError:
    parser.error(f"--rows {args.rows!r}: give comma-separated integers")
  if any(r < 1 for r in rows_list) or args.repeats < 1:
    parser.error("--rows and --repeats must be positive")
  flags = build.cpu_flags()
  print("CPU bf16 instructions:",
        ", ".join(sorted({"avx512_bf16", "amx_bf16"} & flags)) or "none",
        "| kernel layers convert bf16 to float32:",
        layers.wide_bf16_in_float32())
  rng = np.random.default_rng(0)
  for rows in rows_list:
    flops = 2 * rows * sum(n * k for n, k in SHAPES)
    for mode in MODES:
      t = _time(rows, mode, args.repeats, rng)
      print(f"{rows:5d} rows  {mode:20s} {t * 1e3:8.2f} ms"
            f"  {flops / t / 1e9:7.1f} GFLOP/s (min of {args.repeats})")


if __name__ == "__main__":
  main()
