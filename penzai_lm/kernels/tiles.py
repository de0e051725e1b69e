"""Q4_0 and Q8_0 weights in tiles of 16 outputs, for the int8-activation
decode products (`matvec_tiles.cc`).

A weight in rows is ``qs: [N, K // 32 * P]`` (P bytes a block of 32
values: Q4_0's ``uint8`` nibble pairs in ggml's order, P = 16; Q8_0's
``int8`` values, P = 32) and ``scale: f32[N, K // 32]``
(`penzai_lm.quantization.formats`). In tiles, output ``16 t + j`` is lane
``j`` of tile ``t``, and each block of 32 values of a tile's 16 outputs lies
in ``16 P`` consecutive bytes, so that the product dots a tile's outputs at
once and reads each thread's tiles as one stream (as llama.cpp repacks
Q4_0 and Q8_0 for its CPU products):

* ``qs: [T, K // 32 * 16 P]``, T = N // 16: byte ``16 P b + 64 d + 4 j + i``
  of tile ``t`` is byte ``4 d + i`` of block ``b`` of output ``16 t + j``;
* ``scale: f16[T, K // 32 * 16]``: ``16 b + j`` is the scale of block ``b``
  of output ``16 t + j``, as a float16 (the formats' scales are float16s:
  18 bytes a block of Q4_0 and 34 of Q8_0, as in llama.cpp's files).

The same bytes and scales as the rows, moved: `to_tiles` and `from_tiles`
are each other's inverse, exactly; `to_tiles` refuses scales that a
float16 does not hold exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from penzai_lm.kernels import ops

OUTPUTS = 16  # outputs per tile
# qs dtype -> (format, bytes a block of 32 values, product, dequantization)
_FORMATS = {
    jnp.dtype(jnp.uint8): ("q4_0", 16, "pzlm_matvec_q4_0_x8_tiles",
                           "pzlm_dequantize_q4_0_tiles"),
    jnp.dtype(jnp.int8): ("q8_0", 32, "pzlm_matvec_q8_0_x8_tiles",
                          "pzlm_dequantize_q8_0_tiles"),
}


def tileable(n: int, k: int) -> bool:
  """Whether an ``[n, k]`` weight can lie in tiles."""
  return n > 0 and n % OUTPUTS == 0 and k > 0 and k % 32 == 0


def _block_bytes(qs) -> int:
  fmt = _FORMATS.get(jnp.dtype(qs.dtype))
  if fmt is None:
    raise ValueError(f"tiles hold Q4_0 (uint8 qs) or Q8_0 (int8 qs), not"
                     f" {qs.dtype} qs.")
  return fmt[1]


def holds(scale) -> bool:
  """Whether tiles hold ``scale`` exactly (every value a float16)."""
  return bool((scale.astype(jnp.float16).astype(scale.dtype) == scale).all())


def to_tiles(qs, scale):
  """Rows ``qs: [..., N, K // 32 * P]``, ``scale: f32[..., N, K // 32]`` ->
  tiles (leading axes, such as a layer stack's, kept): numpy arrays for
  numpy arrays (no XLA program to compile), else jax arrays."""
  p = _block_bytes(qs)
  *lead, n, size = qs.shape
  k = 32 * size // p
  if (not tileable(n, k) or size % p
      or tuple(scale.shape) != (*lead, n, k // 32)):
    raise ValueError(
        f"to_tiles: qs {qs.shape} and scale {scale.shape} are not a weight"
        f" of N % {OUTPUTS} == 0 outputs and K % 32 == 0 values (qs"
        f" [..., N, K // 32 * {p}], scale [..., N, K // 32]).")
  if not holds(scale):
    raise ValueError(
        "to_tiles: the scales are not all float16s (Q4_0's and Q8_0's"
        " are); tiles keep them as float16, which would round them.")
  t, b, m = n // OUTPUTS, k // 32, len(lead)
  qs = qs.reshape(*lead, t, OUTPUTS, b, p // 4, 4)
  qs = qs.transpose(*range(m), m, m + 2, m + 3, m + 1, m + 4)
  scale = scale.astype(jnp.float16).reshape(*lead, t, OUTPUTS, b)
  scale = scale.transpose(*range(m), m, m + 2, m + 1)
  return (qs.reshape(*lead, t, b * p * OUTPUTS),
          scale.reshape(*lead, t, b * OUTPUTS))


def from_tiles(qs, scale):
  """Tiles -> rows (`to_tiles`' inverse), numpy or jax as `to_tiles`."""
  p = _block_bytes(qs)
  *lead, t, size = qs.shape
  b, m = size // (p * OUTPUTS), len(lead)
  qs = qs.reshape(*lead, t, b, p // 4, OUTPUTS, 4)
  qs = qs.transpose(*range(m), m, m + 3, m + 1, m + 2, m + 4)
  scale = scale.reshape(*lead, t, b, OUTPUTS).astype(jnp.float32)
  scale = scale.transpose(*range(m), m, m + 2, m + 1)
  return (qs.reshape(*lead, t * OUTPUTS, b * p),
          scale.reshape(*lead, t * OUTPUTS, b))


def rows(qs, scale, ids):
  """Rows ``ids`` (``int32[n]``) of a weight in tiles, in rows: ``qs
  [n, K // 32 * P]`` and ``scale [n, K // 32]`` (a tied table's lookup)."""
  p = _block_bytes(qs)
  t, size = qs.shape
  b = size // (p * OUTPUTS)
  tile, lane = ids // OUTPUTS, ids % OUTPUTS
  q = qs.reshape(t, b, p // 4, OUTPUTS, 4)[tile, :, :, lane, :]
  return (q.reshape(-1, b * p),
          scale.reshape(t, b, OUTPUTS)[tile, :, lane].astype(jnp.float32))


def _checked(qs, scale, what: str) -> tuple[str, int, int]:
  """``(format, T, K)`` of tiles, or a ValueError naming ``what``."""
  if not ops.available():
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  p = _block_bytes(qs)
  if len(qs.shape) != 2 or len(scale.shape) != 2:
    raise ValueError(f"{what}: qs {qs.shape} and scale {scale.shape} must"
                     " be 2-D tiles ([T, ...]).")
  t, size = qs.shape
  k = size // (p // 2)
  if (size % (p * OUTPUTS) or tuple(scale.shape) != (t, k // 2)
      or jnp.dtype(scale.dtype) != jnp.float16):
    raise ValueError(
        f"{what}: qs {qs.shape} {qs.dtype} and scale {scale.shape}"
        f" {scale.dtype} are not a weight in tiles of {OUTPUTS} outputs (qs"
        f" [T, {p // 2} K], scale f16 [T, K // 2]; `to_tiles` makes them).")
  return _FORMATS[jnp.dtype(qs.dtype)][0], t, k


def product(x: jax.Array, qs: jax.Array, scale: jax.Array) -> jax.Array:
  """``x @ w.T`` for ``x: f32[R, K]`` and a Q4_0 or Q8_0 weight in tiles,
  with x quantized to int8 blocks as `ops.q8` quantizes it: ``f32[R, N]``,
  the float product of the rounded activations with ``w``."""
  fmt, t, k = _checked(qs, scale, "tiles.product")
  if len(x.shape) != 2 or x.shape[1] != k:
    raise ValueError(f"tiles.product: x {x.shape} must be [R, {k}] for a"
                     f" {fmt} weight of K = {k} in tiles.")
  out = jax.ShapeDtypeStruct((x.shape[0], t * OUTPUTS), jnp.float32)
  return jax.ffi.ffi_call(_FORMATS[jnp.dtype(qs.dtype)][2], out)(
      x.astype(jnp.float32), qs, scale)


def dequantize(qs: jax.Array, scale: jax.Array) -> jax.Array:
  """A weight in tiles as ``f32[N, K]`` (`dequantize.cc`): the values
  `penzai_lm.quantization.formats.dequantize` gives for its rows."""
  _, t, k = _checked(qs, scale, "tiles.dequantize")
  out = jax.ShapeDtypeStruct((t * OUTPUTS, k), jnp.float32)
  return jax.ffi.ffi_call(_FORMATS[jnp.dtype(qs.dtype)][3], out)(qs, scale)
