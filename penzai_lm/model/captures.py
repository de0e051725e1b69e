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
from penzai_lm.model.hooks import HookPoint
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

  The model is walked once whatever the number of names: every capture is
  inserted in one pass over its hook points.

  Returns:
    ``(patched model, {name: (StateVariable, CaptureSpec)})``.
  """
  config = model.config
  parsed = [n if isinstance(n, points_lib.Point)
            else points_lib.parse_point(model, n) for n in names]
  hooks = {}  # (point, layer or None) -> the first hook point with that key.
  for h in pz.select(model).at_instances_of(HookPoint).get_sequence():
    hooks.setdefault(_key(h), h)
  captures, out = {}, {}  # captures: hook key -> Capture layer.
  for p in parsed:
    if p.name in out:
      continue
    stacked = (p.point, None) in hooks and points_lib.is_stacked(
        hooks[(p.point, None)])
    key = (p.point, None if stacked else p.layer)
    if key not in captures:
      hook_point = hooks[key]
      blocks = hook_point.layer.named_shape["blocks"] if stacked else 0
      # A stack's buffer holds every block's value, one slice per block.
      metadata = ({"layerstack_axes": {
          "blocks": pz.nn.LayerStackVarBehavior.PER_LAYER}} if stacked else {})
      label = f"{label_prefix}/{p.point if stacked else p.name}"
      captures[key] = Capture(pz.StateVariable(
          _buffer(config, p.point, token_shape, blocks, hook_point),
          label=label, metadata=metadata))
    var = captures[key].saved
    out[p.name] = (var, CaptureSpec(p.name, var.label,
                                    p.layer if stacked else None))
  patched = (pz.select(model).at_instances_of(HookPoint)
             .where(lambda h: _key(h) in captures)
             .apply_and_inline(lambda h: (h, captures[_key(h)])))
  return patched, out


def _key(hook_point: HookPoint) -> tuple[str, int | None]:
  """A hook point's (point, block) key; block None for a layer stack's
  hook points (one for all blocks) and the model-level ones."""
  layer = hook_point.layer
  if layer is None or points_lib.is_stacked(hook_point):
    return (hook_point.point, None)
  return (hook_point.point, int(layer.data_array))


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
