"""Quantized layers' weights moved into the kernels' tiles of 16 outputs
(`penzai_lm.kernels.tiles`), for the int8-activation decode products and
Q4_0's float products with AVX-512.

`QuantizedLinear.on_cpu_kernels` and `QuantizedEmbeddingLookup.on_cpu_kernels`
call `tiled_params`, as does `penzai_lm.quantization.quantize` for Q4_0. A tied embedding's lookup and unembedding hold one
array; ``memo`` (one per `penzai_lm.kernels.with_cpu_kernels` call) gives
both the same tiles, so the weight stays one copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.kernels import tiles

# Formats that move into tiles, and the axes of a weight there.
TILED_FORMATS = tiles.FORMATS
ROW_AXES = ("quant_out", "quant_in", "quant_groups")
TILE_AXES = ("quant_tiles", "quant_tile_bytes", "quant_tile_scales")


def on_host(array) -> bool:
  """Whether ``array`` holds its values in host memory (not traced)."""
  return isinstance(array, np.ndarray) or (
      isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer)
      and all(d.platform == "cpu" for d in array.devices()))


def tiled_params(qs, scale, mins, fmt: str, memo: dict, *,
                 donate: bool = False):
  """``(qs, scale, mins)`` parameters holding the weight of ``qs``,
  ``scale`` and ``mins`` (``[..., quant_out, quant_in]`` and
  ``[..., quant_groups]`` rows) in tiles, with the same labels (``mins``
  None but for Q4_1 and q8_16); None where the weight cannot tile. Q8_0
  rows whose values all lie in [-16, 15] (Q5_0 blocks, as the GGUF loader
  keeps them) move into Q5_0 tiles: 22 bytes a block against 34.

  Args:
    qs: The layer's ``qs`` parameter.
    scale: Its ``scale`` parameter (one per block of 32 values; q8_16's
      per group of 16).
    mins: Its ``mins`` parameter, or None. Q4_0's (-8 scales) are dropped:
      the tiles derive them; Q4_1's and q8_16's move too.
    fmt: The layer's format, one of `TILED_FORMATS`.
    memo: Tiles made so far in this pass, by the rows' ``qs`` array.
    donate: Delete the rows' arrays once the tiles are made.
  """
  parts = (qs, scale, mins)
  if any(p is not None and p.value.positional_shape for p in parts):
    return None
  qv, sv = qs.value, scale.value
  stack = [a for a in qv.named_axes if a not in ROW_AXES]
  n, k = qv.named_shape["quant_out"], qv.named_shape["quant_in"]
  k *= 2 if jnp.dtype(qv.dtype) == jnp.uint8 else 1  # 4-bit pairs
  if not tiles.tileable(n, k):
    return None
  rows_qs = key_array = qv.order_as(*stack, "quant_out",
                                     "quant_in").data_array
  moving = (scale, mins) if fmt in ("q4_1", "q8_16") else (scale,)
  key = id(rows_qs)
  if key not in memo:
    scales = [p.value.order_as(*stack, "quant_out", "quant_groups").data_array
              for p in moving]
    if on_host(rows_qs) and all(map(on_host, scales)):
      # In numpy: no XLA program compiled (and its memory kept) per shape.
      rows_qs, scales = np.asarray(rows_qs), [np.asarray(a) for a in scales]
    if len(moving) == 1 and not tiles.holds(scales[0]):
      return None  # scales edited off float16: keep rows
    if fmt == "q8_0" and tiles.five_bits(rows_qs):
      fmt = "q5_0"  # Q5_0 blocks the loader kept in Q8_0 rows: 5 bits do
    made = tiles.to_tiles(rows_qs, *scales, fmt=fmt)
    if isinstance(made[0], np.ndarray):
      made = tuple(map(jnp.asarray, made))
    memo[key] = (key_array, made)  # kept alive: its id stays its own
    if donate:
      jax.block_until_ready(made)
      for part in parts:
        array = None if part is None else part.value.data_array
        if isinstance(array, jax.Array) and not isinstance(
            array, jax.core.Tracer) and not array.is_deleted():
          array.delete()
  made = memo[key][1]

  def param(old, data, second):
    wrap = type(old) if isinstance(old, pz.Parameter) else pz.ParameterValue
    return wrap(value=pz.nx.wrap(data).tag(*stack, "quant_tiles", second),
                label=old.label)

  return (param(qs, made[0], TILE_AXES[1]),
          param(scale, made[1], TILE_AXES[2]),
          param(mins, made[2], TILE_AXES[2]) if len(made) > 2 else None)


def into_tiles(layer, memo: dict | None, donate: bool):
  """A quantized layer (`QuantizedLinear`, `QuantizedEmbeddingLookup`) with
  its weight in tiles (``tiled``), or as it is where it cannot move."""
  if layer.tiled or layer.format not in TILED_FORMATS:
    return layer
  params = tiled_params(layer.qs, layer.scale, layer.mins, layer.format,
                        {} if memo is None else memo, donate=donate)
  if params is None:
    return layer
  return dataclasses.replace(layer, qs=params[0], scale=params[1],
                             mins=params[2], tiled=True)


def rows_params(qs, scale, mins, fmt: str):
  """`tiled_params`' inverse: a tiled weight's parameters as ``(qs, scale,
  mins)`` parameters in rows (``[..., quant_out, quant_in]`` and ``[...,
  quant_out, quant_groups]``, any stacking axis first), new arrays with the
  same labels; Q4_0's ``mins`` (-8 scales, never read) labelled as ``qs``'s
  with ``.mins``, None for Q8_0."""
  stack = [a for a in qs.value.named_axes if a not in TILE_AXES]
  parts = [(qs, TILE_AXES[1]), (scale, TILE_AXES[2])]
  if mins is not None:
    parts.append((mins, TILE_AXES[2]))
  rows = list(tiles.from_tiles(*(
      p.value.order_as(*stack, TILE_AXES[0], second).data_array
      for p, second in parts)))
  labels = [qs.label, scale.label, None if mins is None else mins.label]
  if fmt == "q4_0":
    rows.append(rows[1] * -8)
    labels[2] = qs.label.removesuffix(".qs") + ".mins"
  wrap = type(qs) if isinstance(qs, pz.Parameter) else pz.ParameterValue

  def param(data, label, second):
    if data is None or label is None:
      return None
    return wrap(value=pz.nx.wrap(data).tag(*stack, ROW_AXES[0], second),
                label=label)

  return (param(rows[0], labels[0], ROW_AXES[1]),
          param(rows[1], labels[1], ROW_AXES[2]),
          param(rows[2] if len(rows) > 2 else None, labels[2], ROW_AXES[2]))


def flat_arrays(parts, axes: tuple[str, ...]):
  """``(parameter or None, second axis)`` pairs as ``[axes[0], second]``
  jax arrays (None for None), any stacking axis sliced away first."""
  out = []
  for part, second in parts:
    if part is None:
      out.append(None)
      continue
    value = part.value
    extra = set(value.named_shape) - set(axes)
    if extra or value.positional_shape:
      raise ValueError(
          f"a quantized layer ({part.label}) got a weight with axes"
          f" {dict(value.named_shape)}; axes {sorted(extra)} must be"
          " sliced away first (run the model through its LayerStack).")
    out.append(value.order_as(axes[0], second).data_array)
  return out


def tile_arrays(qs, scale, mins):
  """A tiled weight's ``qs``, ``scale`` and ``mins`` parameters (``mins``
  None but for Q4_1 and q8_16) as ``[T, ...]`` jax arrays: two, or three
  with ``mins``."""
  parts = ((qs, TILE_AXES[1]), (scale, TILE_AXES[2]))
  if mins is not None:
    parts += ((mins, TILE_AXES[2]),)
  return flat_arrays(parts, TILE_AXES)
