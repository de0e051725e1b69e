"""A prompt's products: float32 and bfloat16 on XLA's GEMM, and Q4_0 / Q4_1
on their tiles' float GEMM against XLA's on the dequantized weight.

Times SmolLM2-135M's seven projections a layer (out-major weights, as the
loaders lay them out), for ``--layers`` layers of distinct weights (30 is
SmolLM2's: the weights then come from memory, as in a prefill, not from
cache), as ``jax.lax.dot_general`` with float32 results, the product
`penzai_lm.kernels.layers.kernel_contract` writes for more rows than a
decode step: float32 operands; bfloat16 operands (XLA's bf16 dot:
YNNPACK, on ``vdpbf16ps`` where the CPU has it); bfloat16 values
converted to float32 before the dot (what the kernel layers do where
`wide_bf16_in_float32` is true: x86-64 without ``avx512_bf16`` or
``amx_bf16``). For Q4_0 and Q4_1 weights in tiles of 16 outputs (what
`load` keeps on an AVX-512 CPU): the tiles dequantized to float32 for
XLA's GEMM (the quantized layers' prompt products before gemm_float.cc),
and `tiles.float_gemm` (since). Prints the minimum over repeats and
GFLOP/s. The products are independent (XLA may run two at once) unless
``--chained``: then each layer's products take the layer before's output,
in a layer's order (q, k, v; o of their sum; gate and up; down of
``silu(gate) * up``), as in a prefill, one product at a time.

  python benchmarks/prompt_products.py [--rows 128,1024] [--repeats 15] \
      [--layers 30] [--chained] [--modes "float32,q4_0 on its tiles"]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm.kernels import build
from penzai_lm.kernels import layers
from penzai_lm.kernels import ops
from penzai_lm.kernels import tiles
from penzai_lm.quantization import formats

# SmolLM2-135M: hidden 576, 9 query heads and 3 key/value heads of 64, MLP
# 1536. Out-major [N, K]: q, k, v, o, gate, up, down.
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576),
          (1536, 576), (576, 1536))
FLOAT_MODES = ("float32", "bfloat16", "bfloat16 in float32")
TILE_MODES = ("q4_0 dequantized", "q4_0 on its tiles", "q4_1 dequantized",
              "q4_1 on its tiles")
MODES = FLOAT_MODES + TILE_MODES


def _product(mode):
  """The product of one projection in ``mode``: (x, weight) -> f32."""
  if mode.endswith("on its tiles"):
    return lambda x, w: tiles.float_gemm(x, *w)
  if mode.endswith("dequantized"):
    return lambda x, w: jax.lax.dot_general(
        x, tiles.dequantize(*w), (((1,), (1,)), ((), ())))
  def dense(x, w):
    if mode == "bfloat16 in float32":
      x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    return jax.lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return dense


def _weight(mode, shape, rng):
  w = rng.standard_normal(shape, np.float32) * 0.05
  if mode in FLOAT_MODES:
    return jnp.asarray(w, jnp.float32 if mode == "float32" else jnp.bfloat16)
  fmt = mode.split()[0]
  q = formats.quantize(w, fmt)
  return tiles.to_tiles(q.qs, q.scale, *([q.mins] if fmt == "q4_1" else []))


def _chain(product, x, ws):
  """A prefill's order of products over the layers (see the module
  docstring); the small elementwise steps stand in for the rest."""
  for q, k, v, o, gate, up, down in ws:
    kv = product(x, k) + product(x, v)
    x = x + 0.01 * product(product(x, q) + jnp.tile(kv, (1, 3)), o)
    h = jax.nn.silu(product(x, gate)) * product(x, up)
    x = x + 0.01 * product(h, down)
  return x


def _time(rows, mode, repeats, n_layers, rng, chained=False):
  dtype = jnp.bfloat16 if mode.startswith("bfloat16") else jnp.float32
  xs = {k: jnp.asarray(rng.standard_normal((rows, k), np.float32), dtype)
        for k in {k for _, k in SHAPES}}
  ws = [[_weight(mode, s, rng) for s in SHAPES] for _ in range(n_layers)]
  product = _product(mode)
  if chained:
    fn = jax.jit(lambda xs, ws: _chain(
        lambda x, w: product(x.astype(dtype), w).astype(jnp.float32),
        xs[576].astype(jnp.float32), ws))
  else:
    fn = jax.jit(lambda xs, ws: [product(xs[k], w) for layer in ws
                                 for (_, k), w in zip(SHAPES, layer)])
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
  parser.add_argument("--layers", type=int, default=1,
                      help="layers of distinct weights (SmolLM2 has 30)")
  parser.add_argument("--chained", action="store_true",
                      help="each layer's products on the layer before's"
                      " output, one at a time, as in a prefill")
  parser.add_argument("--modes", default=",".join(MODES),
                      help=f"comma-separated, of {', '.join(MODES)}")
  args = parser.parse_args()
  modes = args.modes.split(",")
  if unknown := [m for m in modes if m not in MODES]:
    parser.error(f"--modes: unknown {unknown}; choose from {MODES}")
  if any(m in TILE_MODES for m in modes) and not (
      ops.available() and ops.float_gemm()):
    parser.error("the Q4 modes need the kernels' AVX-512 float GEMM"
                 " (ops.float_gemm() is false here)")
  try:
    rows_list = [int(r) for r in args.rows.split(",")]
  except ValueError:
    parser.error(f"--rows {args.rows!r}: give comma-separated integers")
  if any(r < 1 for r in rows_list) or args.repeats < 1 or args.layers < 1:
    parser.error("--rows, --repeats and --layers must be positive")
  flags = build.cpu_flags()
  print("CPU bf16 instructions:",
        ", ".join(sorted({"avx512_bf16", "amx_bf16"} & flags)) or "none",
        "| kernel layers convert bf16 to float32:",
        layers.wide_bf16_in_float32())
  rng = np.random.default_rng(0)
  for rows in rows_list:
    flops = 2 * rows * sum(n * k for n, k in SHAPES) * args.layers
    for mode in modes:
      t = _time(rows, mode, args.repeats, args.layers, rng, args.chained)
      print(f"{rows:5d} rows  {mode:20s} {t * 1e3:8.2f} ms"
            f"  {flops / t / 1e9:7.1f} GFLOP/s (min of {args.repeats})")


if __name__ == "__main__":
  main()
