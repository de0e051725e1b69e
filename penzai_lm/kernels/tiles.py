"""Q4_0, Q8_0, Q4_1, Q5_0 and q8_16 weights in tiles of 16 outputs, for the
int8-activation products (`matvec_tiles.cc`).

A weight in rows is ``qs: [N, K // 32 * P]`` (P bytes a block of 32
values: Q4_0's and Q4_1's ``uint8`` nibble pairs in ggml's order, P = 16;
Q8_0's ``int8`` values, P = 32), ``scale: f32[N, K // 32]`` and, for Q4_1,
``mins: f32[N, K // 32]`` (`penzai_lm.quantization.formats`); q8_16 (the
K-quants kept) is ``int8`` values with a float32 scale and offset per
group of 16: ``[N, K // 16]``. Q5_0's rows are Q8_0 rows whose values all
lie in [-16, 15], as the GGUF loader keeps Q5_0 blocks. In tiles, output
``16 t + j`` is lane ``j`` of tile ``t``, and each block of 32 values of a
tile's 16 outputs lies in ``16 P`` consecutive bytes, so that the product
dots a tile's outputs at once and reads each
thread's tiles as one stream (as llama.cpp repacks Q4_0 and Q8_0 for its
CPU products):

* ``qs: [T, K // 32 * 16 P]``, T = N // 16: byte ``16 P b + 64 d + 4 j + i``
  of tile ``t`` is byte ``4 d + i`` of block ``b`` of output ``16 t + j``.
  Q5_0 (P = 20) holds each value plus 16 (0 .. 31): its low 4 bits as
  Q4_0's nibbles (d < 4), its 5th bits in 4 bytes more (d = 4: bit ``e``
  of byte ``i`` is the 5th bit of value ``4 e + i``), 22 bytes a block with
  its scale, as in llama.cpp's files;
* ``scale: [T, K // 32 * 16]``: ``16 b + j`` is the scale of block ``b``
  of output ``16 t + j``: a float16 for Q4_0, Q8_0 and Q5_0 (their scales
  are float16s in the files), a float32 for Q4_1 (whose rows from Q4_K
  blocks hold products of two scales); q8_16's ``[T, K // 16 * 16]``
  float32s, ``16 g + j`` group ``g``'s;
* ``mins`` (Q4_1, q8_16): as ``scale``, float32.

The same values, scales and offsets as the rows, moved: `to_tiles` and
`from_tiles` are each other's inverse, exactly; `to_tiles` refuses scales
of Q4_0, Q8_0 or Q5_0 that a float16 does not hold exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm.kernels import ops

OUTPUTS = 16  # outputs per tile
FORMATS = ("q4_0", "q8_0", "q4_1", "q5_0", "q8_16")
# format -> (tile bytes a block of 32 values of one output, scales' dtype,
# values a scale, product, dequantization)
_FORMATS = {
    "q4_0": (16, jnp.float16, 32, "pzlm_matvec_q4_0_x8_tiles",
             "pzlm_dequantize_q4_0_tiles"),
    "q8_0": (32, jnp.float16, 32, "pzlm_matvec_q8_0_x8_tiles",
             "pzlm_dequantize_q8_0_tiles"),
    "q4_1": (16, jnp.float32, 32, "pzlm_matvec_q4_1_x8_tiles",
             "pzlm_dequantize_q4_1_tiles"),
    "q5_0": (20, jnp.float16, 32, "pzlm_matvec_q5_0_x8_tiles",
             "pzlm_dequantize_q5_0_tiles"),
    "q8_16": (32, jnp.float32, 16, "pzlm_matvec_q8_16_x8_tiles",
              "pzlm_dequantize_q8_16_tiles"),
}


def tileable(n: int, k: int) -> bool:
  """Whether an ``[n, k]`` weight can lie in tiles."""
  return n > 0 and n % OUTPUTS == 0 and k > 0 and k % 32 == 0


def tile_format(qs, scale, mins=None) -> str:
  """The format of a weight in tiles (see the module docstring), or a
  ValueError: Q8_0 for ``int8`` qs, q8_16 with ``mins``; Q4_1 for
  ``uint8`` qs with ``mins``, Q5_0 for ``uint8`` qs of 20 bytes a scale,
  Q4_0 for other ``uint8``."""
  dtype = jnp.dtype(qs.dtype)
  if dtype == jnp.int8:
    return "q8_0" if mins is None else "q8_16"
  if dtype == jnp.uint8 and mins is not None:
    return "q4_1"
  if dtype == jnp.uint8:
    five = qs.shape and scale.shape and qs.shape[-1] == 20 * scale.shape[-1]
    return "q5_0" if five else "q4_0"
  raise ValueError(
      f"tiles hold Q4_0 or Q5_0 (uint8 qs), Q4_1 (uint8 qs and mins), Q8_0"
      f" (int8 qs) or q8_16 (int8 qs and mins), not {dtype} qs.")


def five_bits(qs) -> bool:
  """Whether Q8_0 rows ``qs`` are Q5_0's: ``int8`` values in [-16, 15]."""
  return jnp.dtype(qs.dtype) == jnp.int8 and bool(
      ((qs >= -16) & (qs <= 15)).all())


def holds(scale) -> bool:
  """Whether tiles hold ``scale`` exactly (every value a float16)."""
  return bool((scale.astype(jnp.float16).astype(scale.dtype) == scale).all())


def _xp(a):
  return np if isinstance(a, np.ndarray) else jnp


def _tile(q, p: int):
  """Bytes ``[..., N, B * p]`` (B blocks of p bytes an output) -> ``[...,
  T, B, 16 p]``: byte ``64 d + 4 j + i`` of a tile's block is byte
  ``4 d + i`` of output ``16 t + j``'s."""
  *lead, n, size = q.shape
  t, b, m = n // OUTPUTS, size // p, len(lead)
  q = q.reshape(*lead, t, OUTPUTS, b, p // 4, 4)
  return q.transpose(*range(m), m, m + 2, m + 3, m + 1, m + 4).reshape(
      *lead, t, b, OUTPUTS * p)


def _untile(q, p: int):
  """`_tile`'s inverse: ``[..., T, B, 16 p]`` -> ``[..., N, B * p]``."""
  *lead, t, b, _ = q.shape
  m = len(lead)
  q = q.reshape(*lead, t, b, p // 4, OUTPUTS, 4)
  return q.transpose(*range(m), m, m + 3, m + 1, m + 2, m + 4).reshape(
      *lead, t * OUTPUTS, b * p)


def _five_bit_parts(qs):
  """Q5_0 rows ``int8[..., N, K]`` -> nibble pairs ``[..., N, K // 32,
  16]`` (ggml's order) and 5th bits ``[..., N, K // 32, 4]`` (bit ``e`` of
  byte ``i``: value ``4 e + i``), ``uint8``."""
  xp = _xp(qs)
  *lead, n, k = qs.shape
  u = (qs.astype(xp.int16) + 16).astype(xp.uint8).reshape(*lead, n, k // 32,
                                                          32)
  nibbles = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)
  bits = ((u >> 4) & 1).reshape(*lead, n, k // 32, 8, 4)
  shifts = xp.arange(8, dtype=xp.uint8).reshape(8, 1)
  high = (bits << shifts).sum(axis=-2, dtype=xp.uint8)
  return nibbles, high


def _five_bit_values(nibbles, high):
  """`_five_bit_parts`' inverse, blockwise: ``[..., 16]`` and ``[..., 4]``
  bytes -> ``int8[..., 32]`` values."""
  xp = _xp(nibbles)
  low = xp.concatenate([nibbles & 15, nibbles >> 4], axis=-1)
  v = xp.arange(32)
  bit = (high[..., v % 4] >> (v // 4).astype(xp.uint8)) & 1
  return ((low | (bit << 4)).astype(xp.int16) - 16).astype(xp.int8)


def to_tiles(qs, scale, mins=None, fmt: str | None = None):
  """Rows ``qs: [..., N, K // 32 * P]``, ``scale: f32[..., N, K // 32]``
  and Q4_1's ``mins`` (as ``scale``) -> the same arrays in tiles (leading
  axes, such as a layer stack's, kept): ``(qs, scale)``, or ``(qs, scale,
  mins)`` for Q4_1; numpy arrays for numpy arrays (no XLA program to
  compile), else jax arrays. ``fmt`` is Q8_0 for ``int8`` qs, Q4_1 for
  ``uint8`` qs with ``mins``, Q4_0 without, q8_16 for ``int8`` qs with
  ``mins``, unless given: ``"q5_0"`` for Q8_0 rows of 5-bit values
  (`five_bits`)."""
  if fmt is None:
    if jnp.dtype(qs.dtype) == jnp.int8:
      fmt = "q8_0" if mins is None else "q8_16"
    else:
      fmt = "q4_0" if mins is None else "q4_1"
  if fmt not in _FORMATS:
    raise ValueError(f"to_tiles: fmt {fmt!r} is none of {FORMATS}.")
  p, scale_dtype, group = _FORMATS[fmt][:3]
  row_bytes = 32 if fmt == "q5_0" else p
  with_mins = fmt in ("q4_1", "q8_16")
  *lead, n, size = qs.shape
  k = 32 * size // row_bytes
  wrong = (jnp.dtype(qs.dtype) != (jnp.int8 if row_bytes == 32
                                   else jnp.uint8)
           or (mins is None) == with_mins)
  if wrong or (fmt == "q5_0" and not five_bits(qs)):
    raise ValueError(
        f"to_tiles: {fmt} takes {'int8' if row_bytes == 32 else 'uint8'} qs"
        f"{' in [-16, 15]' if fmt == 'q5_0' else ''}"
        f"{' and mins' if with_mins else ', no mins'}; got {qs.dtype} qs"
        f"{'' if mins is None else ' and mins'}.")
  if (not tileable(n, k) or size % row_bytes
      or tuple(scale.shape) != (*lead, n, k // group)
      or (mins is not None and tuple(mins.shape) != tuple(scale.shape))):
    raise ValueError(
        f"to_tiles: qs {qs.shape}, scale {scale.shape}"
        f"{'' if mins is None else f' and mins {mins.shape}'} are not a"
        f" weight of N % {OUTPUTS} == 0 outputs and K % 32 == 0 values (qs"
        f" [..., N, K // 32 * {row_bytes}], scale"
        f"{'' if mins is None else ' and mins'} [..., N, K // {group}]).")
  if scale_dtype == jnp.float16 and not holds(scale):
    raise ValueError(
        f"to_tiles: the scales are not all float16s ({fmt}'s are); tiles"
        " keep them as float16, which would round them.")
  t, b, m = n // OUTPUTS, k // 32, len(lead)
  groups = k // group
  if fmt == "q5_0":
    nibbles, high = _five_bit_parts(qs)
    tiled = _xp(qs).concatenate(
        [_tile(nibbles.reshape(*lead, n, b * 16), 16),
         _tile(high.reshape(*lead, n, b * 4), 4)], axis=-1)
  else:
    tiled = _tile(qs, p)

  def per_block(a):
    a = a.astype(scale_dtype).reshape(*lead, t, OUTPUTS, groups)
    return a.transpose(*range(m), m, m + 2, m + 1).reshape(
        *lead, t, groups * OUTPUTS)

  return (tiled.reshape(*lead, t, b * p * OUTPUTS),
          *map(per_block, (scale,) if mins is None else (scale, mins)))


def from_tiles(qs, scale, mins=None):
  """Tiles -> rows (`to_tiles`' inverse, as many arrays as given; Q5_0's
  rows are Q8_0's), numpy or jax as `to_tiles`."""
  fmt = tile_format(qs, scale, mins)
  p, _, group = _FORMATS[fmt][:3]
  *lead, t, size = qs.shape
  b, m = size // (p * OUTPUTS), len(lead)
  groups = b * 32 // group
  blocks = qs.reshape(*lead, t, b, p * OUTPUTS)
  if fmt == "q5_0":
    nibbles = _untile(blocks[..., :256], 16).reshape(*lead, t * OUTPUTS, b,
                                                     16)
    high = _untile(blocks[..., 256:], 4).reshape(*lead, t * OUTPUTS, b, 4)
    rows = _five_bit_values(nibbles, high).reshape(*lead, t * OUTPUTS, b * 32)
  else:
    rows = _untile(blocks, p)

  def per_block(a):
    a = a.reshape(*lead, t, groups, OUTPUTS).astype(jnp.float32)
    return a.transpose(*range(m), m, m + 2, m + 1).reshape(
        *lead, t * OUTPUTS, groups)

  return (rows, *map(per_block, (scale,) if mins is None else (scale, mins)))


def rows(ids, qs, scale, mins=None):
  """Rows ``ids`` (``int32[n]``) of a weight in tiles, in rows: ``qs
  [n, K // 32 * P]`` (Q5_0's as Q8_0's), ``scale [n, K // 32]`` and Q4_1's
  ``mins`` (as many arrays as given: a tied table's lookup)."""
  fmt = tile_format(qs, scale, mins)
  p, _, group = _FORMATS[fmt][:3]
  t, size = qs.shape
  b = size // (p * OUTPUTS)
  tile, lane = ids // OUTPUTS, ids % OUTPUTS
  q = qs.reshape(t, b, p // 4, OUTPUTS, 4)[tile, :, :, lane, :]
  if fmt == "q5_0":
    q = _five_bit_values(q[:, :, :4].reshape(-1, b, 16), q[:, :, 4])
  return (q.reshape(q.shape[0], -1),
          *(a.reshape(t, b * 32 // group, OUTPUTS)[tile, :, lane].astype(
              jnp.float32)
            for a in ((scale,) if mins is None else (scale, mins))))


def _checked(qs, scale, mins, what: str) -> tuple[str, int, int]:
  """``(format, T, K)`` of tiles, or a ValueError naming ``what``."""
  if not ops.available():
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  fmt = tile_format(qs, scale, mins)
  p, scale_dtype, group = _FORMATS[fmt][:3]
  scales = (scale,) if mins is None else (scale, mins)
  if len(qs.shape) != 2 or any(len(a.shape) != 2 for a in scales):
    raise ValueError(f"{what}: qs {qs.shape} and scale {scale.shape} must"
                     " be 2-D tiles ([T, ...]).")
  t, size = qs.shape
  k = size // (p // 2)
  if size % (p * OUTPUTS) or any(
      tuple(a.shape) != (t, OUTPUTS * k // group)
      or jnp.dtype(a.dtype) != scale_dtype for a in scales):
    want = jnp.dtype(scale_dtype).name
    got_mins = "" if mins is None else f", mins {mins.shape} {mins.dtype}"
    raise ValueError(
        f"{what}: qs {qs.shape} {qs.dtype} and scale {scale.shape}"
        f" {scale.dtype}{got_mins}"
        f" are not a {fmt} weight in tiles of {OUTPUTS} outputs (qs"
        f" [T, {p // 2} K], {want} scale{'' if mins is None else ' and mins'}"
        f" [T, {'K // 2' if group == 32 else 'K'}]; `to_tiles` makes them).")
  return fmt, t, k


def product(x: jax.Array, qs: jax.Array, scale: jax.Array,
            mins: jax.Array | None = None) -> jax.Array:
  """``x @ w.T`` for ``x: f32[R, K]`` and a weight in tiles (any of
  `FORMATS`), with x quantized to int8 blocks as `ops.q8` quantizes it:
  ``f32[R, N]``, the float product of the rounded activations with ``w``."""
  fmt, t, k = _checked(qs, scale, mins, "tiles.product")
  if len(x.shape) != 2 or x.shape[1] != k:
    raise ValueError(f"tiles.product: x {x.shape} must be [R, {k}] for a"
                     f" {fmt} weight of K = {k} in tiles.")
  out = jax.ShapeDtypeStruct((x.shape[0], t * OUTPUTS), jnp.float32)
  scales = (scale,) if mins is None else (scale, mins)
  return jax.ffi.ffi_call(_FORMATS[fmt][3], out)(
      x.astype(jnp.float32), qs, *scales)


# Formats whose products take float activations on tiles (`float_product`).
FLOAT_FORMATS = ("q4_0", "q4_1")


def float_product(x: jax.Array, qs: jax.Array, scale: jax.Array,
                  mins: jax.Array | None = None) -> jax.Array:
  """``x @ w.T`` for ``x: f32[R, K]`` and a Q4_0 or Q4_1 weight in tiles,
  with the activations as they are (`matvec_q4_tiles.cc`): ``f32[R, N]``,
  each block's sum ``Σ x (n - 8)`` (Q4_1: ``Σ x n``, and its min times
  ``Σ x``) scaled once. Fast where `ops.q4_float_tiles` says so (AVX-512);
  elsewhere correct and slow."""
  return _float_call(x, qs, scale, mins, "float_product", "matvec")


def float_gemm(x: jax.Array, qs: jax.Array, scale: jax.Array,
               mins: jax.Array | None = None) -> jax.Array:
  """``x @ w.T`` for a prompt's ``x: f32[R, K]`` and a Q4_0 or Q4_1 weight
  in tiles (`gemm_float.cc`): the product with the dequantized weight (the
  values `dequantize` gives), each output one chain of multiply-adds in the
  order of K, without writing the weight out in float32. Fast where
  `ops.float_gemm` says so (AVX-512); elsewhere correct and slow."""
  return _float_call(x, qs, scale, mins, "float_gemm", "gemm")


def _float_call(x, qs, scale, mins, name: str, kernel: str) -> jax.Array:
  fmt, t, k = _checked(qs, scale, mins, f"tiles.{name}")
  if fmt not in FLOAT_FORMATS:
    raise ValueError(f"tiles.{name} takes {FLOAT_FORMATS} tiles; got"
                     f" {fmt} (`product` takes every format, with int8"
                     " activations).")
  if len(x.shape) != 2 or x.shape[1] != k:
    raise ValueError(f"tiles.{name}: x {x.shape} must be [R, {k}]"
                     f" for a {fmt} weight of K = {k} in tiles.")
  out = jax.ShapeDtypeStruct((x.shape[0], t * OUTPUTS), jnp.float32)
  scales = (scale,) if mins is None else (scale, mins)
  return jax.ffi.ffi_call(f"pzlm_{kernel}_{fmt}_tiles", out)(
      x.astype(jnp.float32), qs, *scales)


def dequantize(qs: jax.Array, scale: jax.Array,
               mins: jax.Array | None = None) -> jax.Array:
  """A weight in tiles as ``f32[N, K]`` (`dequantize.cc`): the values
  `penzai_lm.quantization.formats.dequantize` gives for its rows."""
  fmt, t, k = _checked(qs, scale, mins, "tiles.dequantize")
  out = jax.ShapeDtypeStruct((t * OUTPUTS, k), jnp.float32)
  scales = (scale,) if mins is None else (scale, mins)
  return jax.ffi.ffi_call(_FORMATS[fmt][4], out)(qs, *scales)
