"""Stacks structurally identical blocks into a `pz.nn.LayerStack`.

Blocks may differ in their array data (weights, RoPE frequency tables,
attention windows) but not in structure. Differing arrays get a new leading
named axis; parameters with the same label are stacked into one parameter.
This is how Gemma 3's pattern of local and global layers runs as one scan:
the pattern is carried as data.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
from penzai import pz

from penzai_lm.model.scanned_stack import ScannedLayerStack


def _stack(arrays, axis: str) -> pz.nx.NamedArrayBase:
  """Stacks named arrays along a new named axis; host arrays via numpy."""
  if any(isinstance(a.data_array, jax.core.Tracer) for a in arrays):
    return pz.nx.stack(arrays, axis)
  arrays = [a.with_positional_prefix() for a in arrays]
  named = arrays[0].named_axes
  if any(a.named_axes != named for a in arrays):
    raise ValueError(f"Cannot stack arrays with different axes along {axis!r}.")
  data = np.stack(
      [np.asarray(a.data_array) for a in arrays],
      axis=len(arrays[0].positional_shape),
  )
  return pz.nx.NamedArray(
      named_axes=collections.OrderedDict({axis: len(arrays), **named}),
      data_array=jax.device_put(data),
  )


def _same(values) -> bool:
  """Whether host arrays are equal; traced ones (jitted init) count as equal.

  Under the jitted parameter initialisation only the parameters are used, so
  structural leaves need not be compared there.
  """
  if any(isinstance(v, jax.core.Tracer) for v in values):
    return True
  first = np.asarray(values[0])
  return all(np.array_equal(first, np.asarray(v)) for v in values[1:])


def stack_blocks(
    blocks: list[pz.nn.Layer], stack_axis: str = "blocks"
) -> ScannedLayerStack:
  """Stacks blocks built with identical parameter labels into a layer stack.

  Args:
    blocks: Layers with the same structure and the same parameter labels
      (built under one name, e.g. ``transformer/blocks``). Parameters may be
      slots, in which case the stacked layer keeps the slots.
    stack_axis: Name of the new layer axis.

  Returns:
    A `ScannedLayerStack` running the blocks in order in a compiled loop.
  """
  unbound, values = zip(*(pz.unbind_variables(b, freeze=True) for b in blocks))
  structures = [jax.tree_util.tree_structure(u) for u in unbound]
  if any(s != structures[0] for s in structures[1:]):
    raise ValueError(
        "Blocks differ in structure and cannot share a layer stack; build"
        " them with use_layer_stack=False instead."
    )

  def stack_leaf(*leaves):
    if isinstance(leaves[0], pz.nx.NamedArrayBase):
      if all(leaf is leaves[0] for leaf in leaves) or _same(
          [leaf.data_array for leaf in leaves]
      ):
        return leaves[0]
      return _stack(leaves, stack_axis)
    if not _same(leaves):
      raise ValueError(
          f"Blocks differ in a plain array leaf ({leaves[0]!r}); make it a"
          " NamedArray so it can be stacked."
      )
    return leaves[0]

  stacked = jax.tree_util.tree_map(
      stack_leaf, *unbound, is_leaf=pz.nx.is_namedarray
  )
  parameters = []
  for per_layer in zip(*values):
    label = per_layer[0].label
    if any(v.label != label for v in per_layer):
      raise ValueError(f"Blocks disagree on parameter labels near {label!r}.")
    parameters.append(
        pz.Parameter(
            value=_stack([v.value for v in per_layer], stack_axis),
            label=label,
        )
    )
  return ScannedLayerStack(
      stacked_sublayers=pz.bind_variables(stacked, parameters),
      stack_axis=stack_axis,
      stack_axis_size=len(blocks),
  )
