"""Transformer blocks traced once per program, however many the model has.

The engine's programs run the model's blocks one after the other (layer
stacks are unstacked for decoding, see `penzai_lm.generation.prepare`), and
JAX traces each block anew: every named-axis op of penzai (``nmap``, nested
``vmap``s) is traced once per block.

`share_block_traces` wraps every `TransformerBlock` outside a layer stack in
a `SharedTrace`, which calls its block through one ``jax.jit`` whose static
key is the block's structure, with the labels of its parameters and state
replaced by their positions. Blocks of the same structure (all of
SmolLM2's; the sliding and the global ones of Gemma 3) then share one trace,
and the program calls the one traced function once per block. XLA inlines
those calls, so the compiled program computes the same values and runs as
fast as with a trace per block; only tracing is shorter.

Per-block values -- weights, KV caches, capture buffers, a hook point's
layer index, a patch's per-block strength -- are arrays, hence arguments of
the shared function, not part of its key. A block that differs in structure
(a patch in one block only) is traced on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import numpy as np
from penzai import pz

from penzai_lm.model.stateless import stateless_call
from penzai_lm.model.transformer import TransformerBlock


@dataclasses.dataclass(frozen=True)
class _Key:
  """What a shared trace is keyed on: the structure of (block, argument,
  side inputs) and the positions' labels of the block's state."""

  treedef: Any
  state_labels: tuple[str, ...]


@functools.partial(jax.jit, static_argnums=0)
def shared_block(key: _Key, leaves, state_values):
  """Runs a block (rebuilt from ``key`` and ``leaves``) on its state.

  Returns:
    ``(output, new state values in the order of key.state_labels)``.
  """
  block, argument, side_inputs = jax.tree_util.tree_unflatten(
      key.treedef, leaves)
  state = [pz.StateVariableValue(value=value, label=label)
           for value, label in zip(state_values, key.state_labels)]
  out, new = stateless_call(block, state, argument, **side_inputs)
  by_label = {s.label: s.value for s in new}
  return out, [by_label[label] for label in key.state_labels]


def _positional_labels(block, state_labels: dict[str, str]):
  """``block`` with its state slots and parameters labelled by position, so
  that blocks that differ only in labels have one structure.

  One ``tree_map`` (parameters numbered in flattening order), not
  ``pz.select`` passes, which would rebuild the tree twice.
  """
  params = itertools.count()

  def relabel(node):
    if isinstance(node, pz.StateVariableSlot):
      return pz.StateVariableSlot(label=state_labels[node.label])
    if isinstance(node, pz.ParameterValue):
      return dataclasses.replace(node, label=f"param_{next(params)}")
    return node

  return jax.tree_util.tree_map(
      relabel, block, is_leaf=lambda node: isinstance(
          node, (pz.StateVariableSlot, pz.ParameterValue)))


def _embedding_minor(argument):
  """The residual stream laid out as blocks return it, ``embedding`` last.

  penzai's embedding lookup returns it ``embedding``-major; without this the
  first block would have a structure (and a trace) of its own.
  """
  if (not isinstance(argument, pz.nx.NamedArrayBase)
      or argument.positional_shape
      or "embedding" not in argument.named_shape
      or (isinstance(argument, pz.nx.NamedArray)
          and next(reversed(argument.named_axes)) == "embedding")):
    return argument
  others = [name for name in argument.named_shape if name != "embedding"]
  return argument.order_as(*others, "embedding")


@pz.pytree_dataclass
class SharedTrace(pz.nn.Layer):
  """Runs ``block`` through `shared_block`: one trace per block structure.

  Attributes:
    block: The wrapped block (its state variables bound as usual).
  """

  block: pz.nn.Layer

  def __call__(self, argument, /, **side_inputs):
    pure, variables = pz.unbind_state_vars(self.block)
    state_labels = {v.label: f"state_{i}" for i, v in enumerate(variables)}
    pure = _positional_labels(pure, state_labels)
    leaves, treedef = jax.tree_util.tree_flatten(
        (pure, _embedding_minor(argument), side_inputs))
    if not all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves):
      # A Python value in the tree would become a traced argument (or an
      # unhashable key): run the block as it is.
      return self.block(argument, **side_inputs)
    out, new = shared_block(
        _Key(treedef, tuple(state_labels.values())), leaves,
        [v.value for v in variables])
    for var, value in zip(variables, new):
      var.value = value
    return out


def share_block_traces(model):
  """``model`` with every `TransformerBlock` outside a layer stack wrapped in
  a `SharedTrace` (blocks in a stack are traced once by its scan already)."""
  return (pz.select(model)
          .at_instances_of((pz.nn.LayerStack, TransformerBlock))
          .apply(lambda layer: layer if isinstance(layer, pz.nn.LayerStack)
                 else SharedTrace(layer)))
