"""Quantized layers' weights moved into the kernels' tiles of 16 outputs
(`penzai_lm.kernels.tiles`), for the int8-activation decode products.

`QuantizedLinear.on_cpu_kernels` and `QuantizedEmbeddingLookup.on_cpu_kernels`
call `tiled_params`. A tied embedding's lookup and unembedding hold one
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
TILED_FORMATS = ("q4_0", "q8_0")
ROW_AXES = ("quant_out", "quant_in", "quant_groups")
TILE_AXES = ("quant_tiles", "quant_tile_bytes", "quant_tile_scales")


def _on_host(array) -> bool:
  """Whether ``array`` holds its values in host memory (not traced)."""
  return isinstance(array, np.ndarray) or (
      isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer)
      and all(d.platform == "cpu" for d in array.devices()))


def tiled_params(qs, scale, memo: dict, *, donate: bool = False,
                 unused=None):
  """``(qs, scale)`` parameters holding the weight of ``qs`` and ``scale``
  (``[..., quant_out, quant_in]`` and ``[..., quant_groups]`` rows) in
  tiles, with the same labels; None where the weight cannot tile.

  Args:
    qs: The layer's ``qs`` parameter.
    scale: Its ``scale`` parameter (one per block of 32 values).
    memo: Tiles made so far in this pass, by the rows' ``qs`` array.
    donate: Delete the rows' arrays (and ``unused``'s: Q4_0's ``mins``
      parameter, which tiles drop) once the tiles are made.
    unused: A parameter the tiled layer no longer holds, or None.
  """
  qv, sv = qs.value, scale.value
  if qv.positional_shape or sv.positional_shape:
    return None
  stack = [a for a in qv.named_axes if a not in ROW_AXES]
  n, k = qv.named_shape["quant_out"], 32 * sv.named_shape["quant_groups"]
  if not tiles.tileable(n, k):
    return None
  rows_qs = key_array = qv.order_as(*stack, "quant_out",
                                     "quant_in").data_array
  key = id(rows_qs)
  if key not in memo:
    rows_scale = sv.order_as(*stack, "quant_out", "quant_groups").data_array
    if _on_host(rows_qs) and _on_host(rows_scale):
      # In numpy: no XLA program compiled (and its memory kept) per shape.
      rows_qs, rows_scale = np.asarray(rows_qs), np.asarray(rows_scale)
    if not tiles.holds(rows_scale):  # scales edited off float16: keep rows
      return None
    made = tiles.to_tiles(rows_qs, rows_scale)
    if isinstance(made[0], np.ndarray):
      made = tuple(map(jnp.asarray, made))
    memo[key] = (key_array, *made)  # kept alive: its id stays its own
    if donate:
      jax.block_until_ready(memo[key][1:])
      for part in (qs, scale, unused):
        array = None if part is None else part.value.data_array
        if isinstance(array, jax.Array) and not isinstance(
            array, jax.core.Tracer) and not array.is_deleted():
          array.delete()
  _, qs_t, scale_t = memo[key]

  def param(old, data, second):
    wrap = type(old) if isinstance(old, pz.Parameter) else pz.ParameterValue
    return wrap(value=pz.nx.wrap(data).tag(*stack, "quant_tiles", second),
                label=old.label)

  return (param(qs, qs_t, "quant_tile_bytes"),
          param(scale, scale_t, "quant_tile_scales"))


def into_tiles(layer, memo: dict | None, donate: bool):
  """A quantized layer (`QuantizedLinear`, `QuantizedEmbeddingLookup`) with
  its weight in tiles (``tiled``), or as it is where it cannot move."""
  if layer.tiled or layer.format not in TILED_FORMATS:
    return layer
  params = tiled_params(layer.qs, layer.scale, {} if memo is None else memo,
                        donate=donate, unused=layer.mins)
  if params is None:
    return layer
  return dataclasses.replace(layer, qs=params[0], scale=params[1], mins=None,
                             tiled=True)


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


def tile_arrays(qs, scale):
  """A tiled weight's ``qs`` and ``scale`` parameters as ``[T, ...]`` jax
  arrays."""
  return flat_arrays(((qs, TILE_AXES[1]), (scale, TILE_AXES[2])), TILE_AXES)
