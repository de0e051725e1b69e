"""Q4_0, Q8_0 and Q4_1 weights in tiles of 16 outputs, for the
int8-activation decode products (`matvec_tiles.cc`).

A weight in rows is ``qs: [N, K // 32 * P]`` (P bytes a block of 32
values: Q4_0's and Q4_1's ``uint8`` nibble pairs in ggml's order, P = 16;
Q8_0's ``int8`` values, P = 32), ``scale: f32[N, K // 32]`` and, for Q4_1,
``mins: f32[N, K // 32]`` (`penzai_lm.quantization.formats`). In tiles,
output ``16 t + j`` is lane ``j`` of tile ``t``, and each block of 32
values of a tile's 16 outputs lies in ``16 P`` consecutive bytes, so that
the product dots a tile's outputs at once and reads each thread's tiles as
one stream (as llama.cpp repacks Q4_0 and Q8_0 for its CPU products):

* ``qs: [T, K // 32 * 16 P]``, T = N // 16: byte ``16 P b + 64 d + 4 j + i``
  of tile ``t`` is byte ``4 d + i`` of block ``b`` of output ``16 t + j``;
* ``scale: [T, K // 32 * 16]``: ``16 b + j`` is the scale of block ``b``
  of output ``16 t + j``: a float16 for Q4_0 and Q8_0 (their scales are
  float16s: 18 bytes a block of Q4_0 and 34 of Q8_0, as in llama.cpp's
  files), a float32 for Q4_1 (whose rows from Q4_K blocks hold products of
  two scales);
* ``mins`` (Q4_1): as ``scale``, float32.

The format follows from the arrays: ``int8`` qs are Q8_0, ``uint8`` qs
Q4_1 with ``mins`` and Q4_0 without. The same bytes, scales and offsets as
the rows, moved: `to_tiles` and `from_tiles` are each other's inverse,
exactly; `to_tiles` refuses Q4_0 or Q8_0 scales that a float16 does not
hold exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from penzai_lm.kernels import ops

OUTPUTS = 16  # outputs per tile
FORMATS = ("q4_0", "q8_0", "q4_1")
# format -> (bytes a block of 32 values, scales' dtype, product,
# dequantization)
_FORMATS = {
    "q4_0": (16, jnp.float16, "pzlm_matvec_q4_0_x8_tiles",
             "pzlm_dequantize_q4_0_tiles"),
    "q8_0": (32, jnp.float16, "pzlm_matvec_q8_0_x8_tiles",
             "pzlm_dequantize_q8_0_tiles"),
    "q4_1": (16, jnp.float32, "pzlm_matvec_q4_1_x8_tiles",
             "pzlm_dequantize_q4_1_tiles"),
}


def tileable(n: int, k: int) -> bool:
  """Whether an ``[n, k]`` weight can lie in tiles."""
  return n > 0 and n % OUTPUTS == 0 and k > 0 and k % 32 == 0


def format_of(qs, mins=None) -> str:
  """The format of a weight whose values are ``qs`` (see the module
  docstring), or a ValueError."""
  dtype = jnp.dtype(qs.dtype)
  if dtype == jnp.uint8:
    return "q4_0" if mins is None else "q4_1"
  if dtype == jnp.int8 and mins is None:
    return "q8_0"
  raise ValueError(
      f"tiles hold Q4_0 (uint8 qs), Q4_1 (uint8 qs and mins) or Q8_0 (int8"
      f" qs, no mins), not {dtype} qs{' with' if mins is not None else ''}"
      f"{' mins' if mins is not None else ''}.")


def holds(scale) -> bool:
  """Whether tiles hold ``scale`` exactly (every value a float16)."""
  return bool((scale.astype(jnp.float16).astype(scale.dtype) == scale).all())


def to_tiles(qs, scale, mins=None):
  """Rows ``qs: [..., N, K // 32 * P]``, ``scale: f32[..., N, K // 32]``
  and Q4_1's ``mins`` (as ``scale``) -> the same arrays in tiles (leading
  axes, such as a layer stack's, kept): ``(qs, scale)``, or ``(qs, scale,
  mins)`` for Q4_1; numpy arrays for numpy arrays (no XLA program to
  compile), else jax arrays."""
  fmt = format_of(qs, mins)
  p, scale_dtype = _FORMATS[fmt][:2]
  *lead, n, size = qs.shape
  k = 32 * size // p
  if (not tileable(n, k) or size % p
      or tuple(scale.shape) != (*lead, n, k // 32)
      or (mins is not None and tuple(mins.shape) != tuple(scale.shape))):
    raise ValueError(
        f"to_tiles: qs {qs.shape}, scale {scale.shape}"
        f"{'' if mins is None else f' and mins {mins.shape}'} are not a"
        f" weight of N % {OUTPUTS} == 0 outputs and K % 32 == 0 values (qs"
        f" [..., N, K // 32 * {p}], scale{'' if mins is None else ' and mins'}"
        " [..., N, K // 32]).")
  if scale_dtype == jnp.float16 and not holds(scale):
    raise ValueError(
        f"to_tiles: the scales are not all float16s ({fmt}'s are); tiles"
        " keep them as float16, which would round them.")
  t, b, m = n // OUTPUTS, k // 32, len(lead)
  qs = qs.reshape(*lead, t, OUTPUTS, b, p // 4, 4)
  qs = qs.transpose(*range(m), m, m + 2, m + 3, m + 1, m + 4)

  def per_block(a):
    a = a.astype(scale_dtype).reshape(*lead, t, OUTPUTS, b)
    return a.transpose(*range(m), m, m + 2, m + 1).reshape(
        *lead, t, b * OUTPUTS)

  return (qs.reshape(*lead, t, b * p * OUTPUTS),
          *map(per_block, (scale,) if mins is None else (scale, mins)))


def from_tiles(qs, scale, mins=None):
  """Tiles -> rows (`to_tiles`' inverse, as many arrays as given), numpy
  or jax as `to_tiles`."""
  p = _FORMATS[format_of(qs, mins)][0]
  *lead, t, size = qs.shape
  b, m = size // (p * OUTPUTS), len(lead)
  qs = qs.reshape(*lead, t, b, p // 4, OUTPUTS, 4)
  qs = qs.transpose(*range(m), m, m + 3, m + 1, m + 2, m + 4)

  def per_block(a):
    a = a.reshape(*lead, t, b, OUTPUTS).astype(jnp.float32)
    return a.transpose(*range(m), m, m + 2, m + 1).reshape(
        *lead, t * OUTPUTS, b)

  return (qs.reshape(*lead, t * OUTPUTS, b * p),
          *map(per_block, (scale,) if mins is None else (scale, mins)))


def rows(ids, qs, scale, mins=None):
  """Rows ``ids`` (``int32[n]``) of a weight in tiles, in rows: ``qs
  [n, K // 32 * P]``, ``scale [n, K // 32]`` and Q4_1's ``mins`` (as many
  arrays as given: a tied table's lookup)."""
  p = _FORMATS[format_of(qs, mins)][0]
  t, size = qs.shape
  b = size // (p * OUTPUTS)
  tile, lane = ids // OUTPUTS, ids % OUTPUTS
  q = qs.reshape(t, b, p // 4, OUTPUTS, 4)[tile, :, :, lane, :]
  return (q.reshape(-1, b * p),
          *(a.reshape(t, b, OUTPUTS)[tile, :, lane].astype(jnp.float32)
            for a in ((scale,) if mins is None else (scale, mins))))


def _checked(qs, scale, mins, what: str) -> tuple[str, int, int]:
  """``(format, T, K)`` of tiles, or a ValueError naming ``what``."""
  if not ops.available():
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  fmt = format_of(qs, mins)
  p, scale_dtype = _FORMATS[fmt][:2]
  scales = (scale,) if mins is None else (scale, mins)
  if len(qs.shape) != 2 or any(len(a.shape) != 2 for a in scales):
    raise ValueError(f"{what}: qs {qs.shape} and scale {scale.shape} must"
                     " be 2-D tiles ([T, ...]).")
  t, size = qs.shape
  k = size // (p // 2)
  if size % (p * OUTPUTS) or any(
      tuple(a.shape) != (t, k // 2) or jnp.dtype(a.dtype) != scale_dtype
      for a in scales):
    want = jnp.dtype(scale_dtype).name
    raise ValueError(
        f"{what}: qs {qs.shape} {qs.dtype} and scale {scale.shape}"
        f" {scale.dtype}{'' if mins is None else f', mins {mins.shape} {mins.dtype}'}"
        f" are not a {fmt} weight in tiles of {OUTPUTS} outputs (qs"
        f" [T, {p // 2} K], {want} scale{'' if mins is None else ' and mins'}"
        " [T, K // 2]; `to_tiles` makes them).")
  return fmt, t, k


def product(x: jax.Array, qs: jax.Array, scale: jax.Array,
            mins: jax.Array | None = None) -> jax.Array:
  """``x @ w.T`` for ``x: f32[R, K]`` and a Q4_0, Q8_0 or Q4_1 weight in
  tiles, with x quantized to int8 blocks as `ops.q8` quantizes it:
  ``f32[R, N]``, the float product of the rounded activations with ``w``."""
  fmt, t, k = _checked(qs, scale, mins, "tiles.product")
  if len(x.shape) != 2 or x.shape[1] != k:
    raise ValueError(f"tiles.product: x {x.shape} must be [R, {k}] for a"
                     f" {fmt} weight of K = {k} in tiles.")
  out = jax.ShapeDtypeStruct((x.shape[0], t * OUTPUTS), jnp.float32)
  scales = (scale,) if mins is None else (scale, mins)
  return jax.ffi.ffi_call(_FORMATS[fmt][2], out)(
      x.astype(jnp.float32), qs, *scales)


def dequantize(qs: jax.Array, scale: jax.Array,
               mins: jax.Array | None = None) -> jax.Array:
  """A weight in tiles as ``f32[N, K]`` (`dequantize.cc`): the values
  `penzai_lm.quantization.formats.dequantize` gives for its rows."""
  fmt, t, k = _checked(qs, scale, mins, "tiles.dequantize")
  out = jax.ShapeDtypeStruct((t * OUTPUTS, k), jnp.float32)
  scales = (scale,) if mins is None else (scale, mins)
  return jax.ffi.ffi_call(_FORMATS[fmt][3], out)(qs, *scales)
