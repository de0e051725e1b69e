"""Q4_0 weights in tiles of 16 outputs, for the int8-activation decode
products (`matvec_tiles.cc`).

A Q4_0 weight in rows is ``qs: uint8[N, K // 2]`` (ggml's nibble order) and
``scale: f32[N, K // 32]`` (`penzai_lm.quantization.formats`). In tiles,
output ``16 t + j`` is lane ``j`` of tile ``t``, and each block of 32 values
of a tile's 16 outputs lies in 256 consecutive bytes, so that the product
dots a tile's outputs at once and reads each thread's tiles as one stream
(as llama.cpp repacks Q4_0 for its CPU products):

* ``qs: uint8[T, K // 32 * 256]``, T = N // 16: byte ``256 b + 64 d + 4 j
  + i`` of tile ``t`` is byte ``4 d + i`` of block ``b`` of output
  ``16 t + j``;
* ``scale: f32[T, K // 32 * 16]``: ``16 b + j`` is the scale of block ``b``
  of output ``16 t + j``.

The same bytes and scales as the rows, moved: `to_tiles` and `from_tiles`
are each other's inverse, exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from penzai_lm.kernels import ops

OUTPUTS = 16  # outputs per tile


def tileable(n: int, k: int) -> bool:
  """Whether an ``[n, k]`` Q4_0 weight can lie in tiles."""
  return n > 0 and n % OUTPUTS == 0 and k > 0 and k % 32 == 0


def to_tiles(qs, scale):
  """Rows ``qs: uint8[..., N, K // 2]``, ``scale: f32[..., N, K // 32]``
  -> tiles (leading axes, such as a layer stack's, kept): numpy arrays for
  numpy arrays (no XLA program to compile), else jax arrays."""
  *lead, n, packed = qs.shape
  k = 2 * packed
  if not tileable(n, k) or tuple(scale.shape) != (*lead, n, k // 32):
    raise ValueError(
        f"to_tiles: qs {qs.shape} and scale {scale.shape} are not a Q4_0"
        f" weight of N % {OUTPUTS} == 0 outputs and K % 32 == 0 values"
        " (qs [..., N, K // 2], scale [..., N, K // 32]).")
  t, b, m = n // OUTPUTS, k // 32, len(lead)
  qs = qs.reshape(*lead, t, OUTPUTS, b, 4, 4)
  qs = qs.transpose(*range(m), m, m + 2, m + 3, m + 1, m + 4)
  scale = scale.reshape(*lead, t, OUTPUTS, b)
  scale = scale.transpose(*range(m), m, m + 2, m + 1)
  return qs.reshape(*lead, t, b * 256), scale.reshape(*lead, t, b * OUTPUTS)


def from_tiles(qs, scale):
  """Tiles -> rows (`to_tiles`' inverse), numpy or jax as `to_tiles`."""
  *lead, t, size = qs.shape
  b, m = size // 256, len(lead)
  qs = qs.reshape(*lead, t, b, 4, OUTPUTS, 4)
  qs = qs.transpose(*range(m), m, m + 3, m + 1, m + 2, m + 4)
  scale = scale.reshape(*lead, t, b, OUTPUTS)
  scale = scale.transpose(*range(m), m, m + 2, m + 1)
  return (qs.reshape(*lead, t * OUTPUTS, b * 16),
          scale.reshape(*lead, t * OUTPUTS, b))


def q4_0_product(x: jax.Array, qs: jax.Array, scale: jax.Array) -> jax.Array:
  """``x @ w.T`` for ``x: f32[R, K]`` and a Q4_0 weight in tiles, with x
  quantized to int8 blocks as `ops.q8` quantizes it: ``f32[R, N]``."""
  if not ops.available():
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  (rows, k), (t, size) = x.shape, qs.shape
  if (k % 32 or size != 8 * k or tuple(scale.shape) != (t, k // 2)
      or jnp.dtype(qs.dtype) != jnp.uint8):
    raise ValueError(
        f"q4_0_product: x {x.shape}, qs {qs.shape} {qs.dtype} and scale"
        f" {scale.shape} are not x [R, K] with K % 32 == 0 and a Q4_0"
        " weight in tiles of 16 outputs (qs uint8 [T, 8 K], scale"
        " [T, K // 2]; `to_tiles` makes them).")
  out = jax.ShapeDtypeStruct((x.shape[0], qs.shape[0] * OUTPUTS),
                             jnp.float32)
  return jax.ffi.ffi_call("pzlm_matvec_q4_0_x8_tiles", out)(
      x.astype(jnp.float32), qs, scale)


def dequantize(qs: jax.Array, scale: jax.Array) -> jax.Array:
  """A Q4_0 weight in tiles as ``f32[N, K]`` (`dequantize.cc`): the values
  `ops.dequantize` gives for the same weight in rows."""
  if not ops.available():
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  t, size = qs.shape
  if size % 256 or tuple(scale.shape) != (t, size // 16):
    raise ValueError(
        f"tiles.dequantize: qs {qs.shape} and scale {scale.shape} are not a"
        " Q4_0 weight in tiles of 16 outputs (qs uint8 [T, 8 K], scale"
        " [T, K // 2]; `to_tiles` makes them).")
  out = jax.ShapeDtypeStruct((t * OUTPUTS, size // 8), jnp.float32)
  return jax.ffi.ffi_call("pzlm_dequantize_q4_0_tiles", out)(qs, scale)
