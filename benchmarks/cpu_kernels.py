"""The CPU kernels against XLA's dots on one decode step's products.

Every product of a SmolLM2-135M decode step (30 layers of q, k, v, o, gate,
up, down, and the tied 576x49152 unembedding), at 1 and 8 rows, per weight
format: float32/bfloat16/float16 in-major (penzai's own layout; loaded
projections are out-major, as the unembedding), and int8,
q8_0 and q4_1 blocks (out-major). "xla" runs the same product with
``jnp.dot`` on the weights as they lie (quantized ones dequantized in the
program, as without the kernels). ``bf16-out`` and ``f32-out`` are
bfloat16 and float32 out-major (the loaders' layout). A format with the suffix ``-x8``
(``int8-x8``, ``q8_0-x8``, ``q4_0-x8``, ``q4_1-x8``) runs the kernels with
``int8_activations=True`` (the rows quantized to int8 blocks, integer dot
products: `penzai_lm/kernels/matvec_x8.cc`; from 17 rows, a prompt's, on
the AMX tiles where the CPU has them: `gemm_x8.cc`). ``q4_0-tiles`` is
Q4_0 with int8 activations on weights moved into tiles of 16 outputs
(`penzai_lm/kernels/tiles.py`, `matvec_tiles.cc`), as
``with_cpu_kernels(..., int8_activations=True)`` moves Q4_0 layers;
``q8_0-tiles`` and ``q4_1-tiles`` the same for Q8_0 and Q4_1;
``q4_0-ftiles`` and ``q4_1-ftiles`` take float activations on the tiles
(`matvec_q4_tiles.cc`), as the quantized models on an AVX-512 CPU hold
Q4_0 and Q4_1 (`penzai_lm.quantization.quantize`). Reports the
step time and weights per second: medians of --repeats (``--stat min``:
their minimum, which moved less between processes on a shared AVX2
machine where the medians moved by 15-40%).

  python benchmarks/cpu_kernels.py [--repeats 20] [--formats bf16,q8_0]
      [--rows 1,8] [--no-xla]
  python benchmarks/cpu_kernels.py --formats f32,q8_0-x8,q4_0-x8 --rows 128
  python benchmarks/cpu_kernels.py --chain --formats q4_0-x8 --rows 1 --no-xla

``--chain`` feeds each product's output into the next one's input, as a
decode step does: without it the products are independent, and XLA may
run two at once on its threads, which a decode step never does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm.kernels import ops
from penzai_lm.kernels import tiles
from penzai_lm.quantization import formats as qformats

SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536),
          (576, 1536), (1536, 576)]  # (K, N) of one layer
LAYERS = 30
VOCAB = 49152


def _weights(fmt: str, rng):
  """The arrays of one step's weights in format ``fmt``."""
  out = []
  shapes = SHAPES * LAYERS + [(576, VOCAB)]
  for k, n in shapes:
    w = (rng.standard_normal((n, k), np.float32) * 0.05)
    if fmt in ("f32", "bf16", "f16"):
      dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[fmt]
      out.append((jnp.asarray(w.T.copy()).astype(dtype),))
    elif fmt in ("bf16-out", "f32-out"):
      out.append((jnp.asarray(w).astype(
          jnp.bfloat16 if fmt == "bf16-out" else jnp.float32),))
    elif fmt in ("q4_0-ftiles", "q4_1-ftiles"):
      base = fmt.removesuffix("-ftiles")
      q = qformats.quantize(w, base)
      out.append(tiles.to_tiles(q.qs, q.scale,
                                *([q.mins] if base == "q4_1" else [])))
    elif fmt.endswith("-tiles"):
      base = fmt.removesuffix("-tiles")
      q = qformats.quantize(w, base)
      out.append(tiles.to_tiles(q.qs, q.scale,
                                *([q.mins] if base == "q4_1" else [])))
    else:
      q = qformats.quantize(w, fmt.removesuffix("-x8"))
      out.append(q)
  return out


def _k(fmt, arrays) -> int:
  if fmt.endswith("tiles"):
    return arrays[1].shape[1] * 2
  if fmt in ("bf16-out", "f32-out"):
    return arrays[0].shape[1]
  return arrays[0].shape[0] if isinstance(arrays, tuple) else arrays.shape[1]


def _product(fmt, x, arrays, kernels: bool):
  if fmt in ("bf16-out", "f32-out"):
    if kernels:
      return ops.dense(x, arrays[0], out_major=True)
    return jnp.dot(x, arrays[0].T, preferred_element_type=jnp.float32)
  if fmt in ("f32", "bf16", "f16"):
    if kernels:
      return ops.dense(x, arrays[0], out_major=False)
    return jnp.dot(x, arrays[0], preferred_element_type=jnp.float32)
  if fmt.endswith("-ftiles"):
    if kernels:
      return tiles.float_product(x, *arrays)
    qs, scale, *mins = tiles.from_tiles(*arrays)
    return x @ qformats.dequantize(qs, scale, (mins or [None])[0],
                                   fmt.removesuffix("-ftiles")).T
  if fmt.endswith("-tiles"):
    if kernels:
      return tiles.product(x, *arrays)
    qs, scale, *mins = tiles.from_tiles(*arrays)
    return x @ qformats.dequantize(qs, scale, (mins or [None])[0],
                                   fmt.removesuffix("-tiles")).T
  if not kernels:
    return x @ arrays.dequantize().T
  x8 = fmt.endswith("-x8")
  if fmt.removesuffix("-x8") in ("int8", "q8_0"):
    return ops.q8(x, arrays.qs, arrays.scale, int8_activations=x8)
  # Q4_0's offsets are -8 scales, derived by the kernel (as its layers do).
  mins = None if arrays.format == "q4_0" else arrays.mins
  return ops.q4(x, arrays.qs, arrays.scale, mins, int8_activations=x8)


def _step(fmt, kernels: bool, chain: bool):
  """One step's products; chained, each one's input depends on the last
  one's output, as in a decode step (unchained, XLA may run independent
  products at once on its threads)."""
  def step(x, weights):
    total = 0.0
    for arrays in weights:
      k = _k(fmt, arrays)
      y = _product(fmt, x[:, :k], arrays, kernels)
      if chain:
        n = min(y.shape[1], x.shape[1])
        x = x.at[:, :n].add(y[:, :n] * 1e-3)
      else:
        total = total + y[:, :4].sum()
    return x.sum() if chain else total
  return step


def _time(fn, *args, repeats, stat=statistics.median):
  fn(*args).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return stat(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--formats",
      default=("f32,bf16,bf16-out,f16,int8,int8-x8,q8_0,q8_0-x8,q4_1,"
               "q4_1-x8"))
  parser.add_argument("--rows", default="1,8")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--stat", choices=("median", "min"), default="median",
                      help="the figure quoted of the --repeats steps")
  parser.add_argument("--no-xla", action="store_true",
                      help="time the kernels only")
  parser.add_argument("--chain", action="store_true",
                      help="each product takes the last one's output, as"
                      " in a decode step (one product at a time)")
  args = parser.parse_args()
  if not ops.available():
    raise SystemExit("the CPU kernels are not available here")
  stat = {"median": statistics.median, "min": min}[args.stat]
  rng = np.random.default_rng(0)
  n_weights = sum(k * n for k, n in SHAPES) * LAYERS + 576 * VOCAB
  print(f"{n_weights / 1e6:.1f}M weights per step; {jax.devices()}")
  print(f"{'format':8} {'rows':>4} {'xla ms':>8} {'kernel ms':>9} "
        f"{'kernel Gw/s':>11} {'speedup':>7}")
  for fmt in args.formats.split(","):
    weights = _weights(fmt, rng)
    kernel = jax.jit(_step(fmt, True, args.chain))
    xla = jax.jit(_step(fmt, False, args.chain))
    for rows in map(int, args.rows.split(",")):
      x = jnp.asarray(rng.standard_normal((rows, 1536), np.float32))
      t_xla = (float("nan") if args.no_xla
               else _time(xla, x, weights, repeats=args.repeats, stat=stat))
      t_k = _time(kernel, x, weights, repeats=args.repeats, stat=stat)
      print(f"{fmt:8} {rows:4d} {t_xla * 1e3:8.2f} {t_k * 1e3:9.2f} "
            f"{n_weights / t_k / 1e9:11.1f} {t_xla / t_k:6.2f}x", flush=True)


if __name__ == "__main__":
  main()
