"""Layer stacks unstacked into per-layer blocks, for decoding.

A scanned LayerStack slices every stacked weight inside its loop body, and
XLA on CPU materializes each slice: every decode step copies all the weights
once more, and the per-layer caches are sliced and re-stacked too.
Decoding therefore runs on an equivalent model whose stacks are replaced by
a Sequential of per-layer blocks (per-layer state variables get one
variable per layer). On CPU those blocks' weights alias the stacked buffers
(`_take`), so decoding holds one copy of the weights.

A prompt's prefill, on the other hand, is one call over many tokens: there
the scan's slice copies cost little, and one compiled block instead of one
per layer saves most of a new program's compile and first-run time. So
where that costs no warm speed the engine prefills on the stacked model
and hands the decode loop the per-layer state
(`penzai_lm.generation.stacked_prefill`): `unstacked_state_order` says
where each state variable of the unstacked model comes from, `split_state`
computes them.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np
from penzai import pz

from penzai_lm.runtime.derived import Lineage


def host_view(data) -> np.ndarray | None:
  """A zero-copy numpy view of a concrete array held on one CPU device."""
  if isinstance(data, jax.core.Tracer) or not isinstance(data, jax.Array):
    return None
  devices = data.sharding.device_set
  if len(devices) != 1 or next(iter(devices)).platform != "cpu":
    return None
  view = np.asarray(data)
  return view if view.ctypes.data == data.unsafe_buffer_pointer() else None


def _take(x: pz.nx.NamedArrayBase, axis: str, index: int,
          lineage: Lineage | None = None):
  """``x[{axis: index}]``, without a copy where the layout allows.

  On CPU a block of a stacked weight whose ``blocks`` axis is the major
  one (as loaders lay it out) is a contiguous run of the stacked buffer, and
  ``jax.device_put`` of a numpy view of a JAX-owned CPU buffer aliases it
  (the view keeps the buffer alive). So the per-layer decode weights share
  memory with the user's stacked model instead of being a second copy of
  every weight. Recorded in ``lineage`` (`penzai_lm.runtime.derived`).
  """
  if lineage is not None:
    out = _take(x, axis, index)
    lineage.record_named(out, x, lambda y: _take(y, axis, index))
    return out
  if isinstance(x, pz.nx.NamedArray):
    view = host_view(x.data_array)
    if view is not None:
      # Where another axis is major (a NamedArray's data lists positional
      # axes first), the block is strided and device_put copies it: still
      # by numpy, as an eager slice compiles a program per shape.
      at = len(x.positional_shape) + list(x.named_axes).index(axis)
      rest = collections.OrderedDict(
          (a, n) for a, n in x.named_axes.items() if a != axis)
      return pz.nx.NamedArray(
          named_axes=rest,
          data_array=jax.device_put(view[(slice(None),) * at + (index,)]))
  return x[{axis: index}]


def _is_named(node) -> bool:
  return isinstance(node, pz.nx.NamedArrayBase)


def _slice_axis(tree, axis: str, index: int, lineage: Lineage | None):
  # tree_map rather than pz.select, which would rebuild each block's tree
  # twice over.
  return jax.tree_util.tree_map(
      lambda x: (_take(x, axis, index, lineage)
                 if _is_named(x) and axis in x.named_shape else x),
      tree, is_leaf=_is_named)


def _rename_slots(tree, renamed: dict[str, str]):
  return jax.tree_util.tree_map(
      lambda x: (pz.StateVariableSlot(label=renamed[x.label])
                 if isinstance(x, pz.StateVariableSlot)
                 and x.label in renamed else x),
      tree, is_leaf=lambda x: isinstance(x, pz.StateVariableSlot))


def _per_layer(var, axis: str) -> bool:
  return (var.metadata.get("layerstack_axes", {}).get(axis)
          == pz.nn.LayerStackVarBehavior.PER_LAYER)


def _unstack(stack: pz.nn.LayerStack,
             lineage: Lineage | None = None) -> pz.nn.Sequential:
  """An equivalent Sequential of the blocks of a LayerStack."""
  axis, n = stack.stack_axis, stack.stack_axis_size
  pure, variables = pz.unbind_state_vars(pz.freeze_params(
      stack.stacked_sublayers))
  per_layer = {}
  for var in variables:
    if _per_layer(var, axis):
      metadata = dict(var.metadata)
      axes = dict(metadata["layerstack_axes"])
      del axes[axis]
      if axes:
        metadata["layerstack_axes"] = axes
      else:
        del metadata["layerstack_axes"]
      per_layer[var.label] = [
          pz.StateVariable(
              value=_slice_axis(var.value, axis, i, lineage),
              label=f"{var.label}/{axis}_{i}", metadata=metadata)
          for i in range(n)
      ]
  blocks = []
  for i in range(n):
    block = _rename_slots(_slice_axis(pure, axis, i, lineage),
                          {label: f"{label}/{axis}_{i}" for label in per_layer})
    block_vars = [per_layer[v.label][i] if v.label in per_layer else v
                  for v in variables]
    blocks.append(pz.bind_variables(block, block_vars))
  return pz.nn.Sequential(blocks)


def unstack_layers(model, lineage: Lineage | None = None):
  """Replaces every `pz.nn.LayerStack` of a model by a Sequential of its
  blocks (the same computation; parameters are frozen). The slices are
  recorded in ``lineage``."""
  selection = pz.select(model).at_instances_of(pz.nn.LayerStack)
  if not selection.count():
    return model
  return selection.apply(lambda stack: _unstack(stack, lineage))


@dataclasses.dataclass(frozen=True)
class StateSlice:
  """Where one state variable of a model's unstacked form comes from.

  Attributes:
    label: The stacked model's state variable.
    axis: The stack axis it is sliced along (None: taken whole, as a
      variable outside the stacks or one the blocks share).
    index: The block (None with ``axis`` None).
  """

  label: str
  axis: str | None = None
  index: int | None = None


def _is_node(x) -> bool:
  return isinstance(x, (pz.StateVariable, pz.nn.LayerStack))


def unstacked_state_order(model) -> tuple[StateSlice, ...] | None:
  """For each state variable of ``unstack_layers(model)``, in the order
  ``pz.unbind_state_vars`` lists them, where it comes from in ``model``.

  The unstacked model holds each stack's variables block by block, in the
  stack's own order (`_unstack`); a variable the blocks share appears once,
  in the first. Returns None for a stack inside a stack (not followed).
  """
  out, seen = [], set()

  def add(label, axis=None, index=None):
    if (label, index) not in seen:
      seen.add((label, index))
      out.append(StateSlice(label, axis, index))

  for node in jax.tree_util.tree_leaves(model, is_leaf=_is_node):
    if isinstance(node, pz.StateVariable):
      add(node.label)
    elif isinstance(node, pz.nn.LayerStack):
      inner = jax.tree_util.tree_leaves(node.stacked_sublayers,
                                        is_leaf=_is_node)
      if any(isinstance(x, pz.nn.LayerStack) for x in inner):
        return None
      variables = [x for x in inner if isinstance(x, pz.StateVariable)]
      axis = node.stack_axis
      for i in range(node.stack_axis_size):
        for var in variables:
          if _per_layer(var, axis):
            add(var.label, axis, i)
          else:
            add(var.label)
  return tuple(out)


def split_state(state, order, split=None) -> list:
  """The values of the unstacked model's state variables, in ``order``
  (`unstacked_state_order`), from the stacked model's state (a list of
  ``pz.StateVariableValue``; inside a program, or eagerly).

  ``split(data)``: the blocks of an ``[n, ...]`` array as a list of ``n``
  arrays (default: ``n`` slices; `penzai_lm.kernels.ops.split` on CPU,
  where XLA compiles a kernel per slice).
  """
  values = {v.label: v.value for v in state}
  blocks = {}
  out = []
  for s in order:
    if s.axis is None:
      out.append(values[s.label])
      continue
    if (s.label, s.axis) not in blocks:
      blocks[s.label, s.axis] = _blocks_of(values[s.label], s.axis, split)
    out.append(blocks[s.label, s.axis][s.index])
  return out


def _blocks_of(value, axis: str, split) -> list:
  """A state value's blocks along a stack axis (each without the axis)."""
  leaves, treedef = jax.tree_util.tree_flatten(value, is_leaf=_is_named)
  n = None
  per_leaf = []
  for x in leaves:
    if _is_named(x) and axis in x.named_shape:
      n = x.named_shape[axis]
      moved = x.untag_prefix(axis).with_positional_prefix()
      data = (split or _slices)(moved.data_array)
      per_leaf.append([pz.nx.NamedArray(
          named_axes=collections.OrderedDict(moved.named_axes),
          data_array=d) for d in data])
    else:
      per_leaf.append(None)
  if n is None:
    raise ValueError(f"a per-layer state value has no {axis!r} axis.")
  return [jax.tree_util.tree_unflatten(
      treedef, [x if p is None else p[i] for x, p in zip(leaves, per_leaf)])
          for i in range(n)]


def _slices(data) -> list:
  return [data[i] for i in range(data.shape[0])]
