"""Capture layers: record the value at named points into state variables.

`insert_captures(model, names, token_shape)` inserts a `Capture` right after
each named point's hook point (so it records the value with every
intervention applied) with a buffer allocated up front from the model's
config, ``(blocks?, batch axes, seq, value axes)``. The same code runs on
per-layer blocks and inside a layer stack's scan: there the buffer has a
``blocks`` axis and each block writes its slice (a `CaptureSpec` says
which block to read back).

A buffer as long as the call's ``seq`` is overwritten by each call; a
longer one is a per-slot record like a KV cache (captures during
generation): each call's tokens are written at its ``cache_end_index``.
`penzai_lm.interp.run_with_cache` and ``generate(..., capture=...)`` use
them.
"""

from __future__ import annotations

import dataclasses

from penzai import pz

from penzai_lm.model import points as points_lib
from penzai_lm.model.cache_layout import write_at


@pz.pytree_dataclass
class Capture(pz.nn.Layer):
  """Saves the value passing through into a preallocated buffer.

  A buffer as long as the call's ``seq`` is overwritten; a longer one is a
  per-slot record like a KV cache (generation captures): the call's tokens
  are written at its ``cache_end_index`` side input.
  """

  saved: pz.StateVariable

  def __call__(self, x, /, **side_inputs):
    buffer = self.saved.value
    x = x.astype(buffer.dtype)
    if x.named_shape["seq"] == buffer.named_shape["seq"]:
      self.saved.value = pz.nx.order_like(x, buffer)
    else:
      self.saved.value = write_at(buffer, x, "seq",
                                  side_inputs["cache_end_index"])
    return x


@dataclasses.dataclass(frozen=True)
class CaptureSpec:
  """Where one captured point's values end up.

  Attributes:
    name: The point's name.
    label: The label of the state variable holding them.
    layer: The block to take from a layer stack's per-layer buffer (which
      has a ``blocks`` axis), or None.
  """

  name: str
  label: str
  layer: int | None = None

  def take(self, value: pz.nx.NamedArray) -> pz.nx.NamedArray:
    return value if self.layer is None else value[{"blocks": self.layer}]


def insert_captures(model, names, token_shape: dict[str, int],
                    label_prefix: str = "capture"):
  """Inserts `Capture` layers with buffers of ``token_shape`` (the batch
  axes and ``seq``) right after the named points (names, or `Point`s
  already parsed against this model).

  Returns:
    ``(patched model, {name: (StateVariable, CaptureSpec)})``.
  """
  config = model.config
  parsed = [n if isinstance(n, points_lib.Point)
            else points_lib.parse_point(model, n) for n in names]
  patched, out = model, {}
  for point in dict.fromkeys(p.point for p in parsed):
    hook_point = points_lib.hook_points(model, point).get_sequence()[0]
    blocks = (hook_point.layer.named_shape["blocks"]
              if points_lib.is_stacked(hook_point) else 0)
    wanted = [p for p in parsed if p.point == point]
    if blocks or [p.name for p in wanted] == [point]:
      # One capture for all blocks (a stack) or a model-level point.
      metadata = {}
      if blocks:
        metadata = {"layerstack_axes": {
            "blocks": pz.nn.LayerStackVarBehavior.PER_LAYER}}
      var = pz.StateVariable(_buffer(config, point, token_shape, blocks,
                                     hook_point),
                             label=f"{label_prefix}/{point}",
                             metadata=metadata)
      patched = points_lib.hook_points(patched, point).insert_after(
          Capture(var))  # Every block of a stack (or the one point).
      for p in wanted:
        out[p.name] = (var, CaptureSpec(p.name, var.label,
                                        p.layer if blocks else None))
      continue
    for p in wanted:
      var = pz.StateVariable(_buffer(config, point, token_shape, 0,
                                     _hook_of(model, p)),
                             label=f"{label_prefix}/{p.name}")
      patched = points_lib.insert_at(patched, p.name, Capture(var),
                                     after_hook=True)
      out[p.name] = (var, CaptureSpec(p.name, var.label))
  return patched, out


def _hook_of(model, point: points_lib.Point):
  """The hook point of one block (or of the model) for a parsed point."""
  for h in points_lib.hook_points(model, point.point).get_sequence():
    if point.layer is None or h.layer is None or (
        not h.layer.named_shape and int(h.layer.data_array) == point.layer):
      return h
  return None


def _buffer(config, point, token_shape, stacked_blocks, hook_point=None):
  # Points added by a splice (penzai_lm.sae) say their own axes and dtype.
  own = getattr(hook_point, "value_axes", None)
  value_axes = (dict(own) if own else
                points_lib.point_value_axes(config, point, token_shape["seq"]))
  dtype = (getattr(hook_point, "value_dtype", None) if own
           else None) or config.activation_dtype
  axes = {**token_shape, **value_axes}
  if stacked_blocks:
    axes = {"blocks": stacked_blocks, **axes}
  return pz.nx.zeros(axes, dtype)
