"""A `pz.nn.LayerStack` that really scans.

Why it exists: Penzai 0.2.5's ``LayerStack.__call__`` calls
``jax.lax.scan(..., unroll=True)``, which unrolls every block into the
compiled program, so its compile time grows with the depth.
`ScannedLayerStack` implements the same call with a configurable ``unroll``
(default 1, a real loop).

Its ``__call__`` follows penzai's step for step (same checks, same treatment
of variables), using penzai's variable and selector helpers:

* parameters are frozen (read-only inside the loop);
* state variables of the side inputs are shared across layers; those of the
  sublayers are shared or per-layer according to their ``layerstack_axes``
  metadata for ``stack_axis``; shared ones are carried through the loop,
  per-layer ones are scanned over (sliced in, restacked out);
* arrays with the stack axis are scanned over, as the first positional axis.

It is a LayerStack subclass, so ``pz.select(...).at_instances_of(
pz.nn.LayerStack)``, ``layerstack_axes_from_keypath`` and cached-mode
conversion treat it exactly like one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.core import named_axes
from penzai.core import selectors
from penzai.core import tree_util as pz_tree_util
from penzai.core import variables

from penzai_lm.model.stateless import stateless_call

_Behavior = pz.nn.LayerStackVarBehavior


# 16-bit floats scanned over travel as their bits: XLA:CPU otherwise
# widens the whole stacked array to float32 before the loop (its dots take
# float32), a second copy of the weights (SmolLM2 bfloat16: +405 MB).
_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16):
         jnp.uint16}


def _as_bits(x):
  bits = _BITS.get(jnp.dtype(x.dtype))
  if bits is None:
    return x
  return dataclasses.replace(
      x, data_array=jax.lax.bitcast_convert_type(x.data_array, bits))


def _from_bits(x, dtype):
  if jnp.dtype(x.dtype) == jnp.dtype(dtype):
    return x
  return dataclasses.replace(
      x, data_array=jax.lax.bitcast_convert_type(x.data_array, dtype))


def _has_axis(axis):
  return lambda x: axis in x.named_shape


def _named_arrays_with(tree, axis) -> selectors.Selection:
  return (selectors.select(tree)
          .at_instances_of(named_axes.NamedArrayBase)
          .where(_has_axis(axis)))


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pytype: disable=wrong-keyword-args
class ScannedLayerStack(pz.nn.LayerStack):
  """A LayerStack compiled as a loop over its blocks.

  Attributes:
    unroll: How many blocks each loop iteration runs (1: a plain loop, the
      fastest to compile; ``stack_axis_size``: fully unrolled, like penzai).
  """

  unroll: int = dataclasses.field(default=1, metadata={"pytree_node": False})

  def __call__(self, argument, /, **side_inputs) -> Any:
    """Calls the stacked sublayers under ``jax.lax.scan(unroll=unroll)``."""
    axis = self.stack_axis
    sublayer, sublayer_vars = variables.unbind_state_vars(
        variables.freeze_params(self.stacked_sublayers))
    side_inputs, side_input_vars = variables.unbind_state_vars(side_inputs)
    _, bad_vars = variables.unbind_variables(sublayer, side_inputs)
    if bad_vars:
      raise ValueError(
          "Unsupported variable types found in layer stack:"
          f" {set(type(var) for var in bad_vars)}")
    shared, per_layer = self._split_state_vars(side_input_vars, sublayer_vars)

    # Scanned over: the arrays with the stack axis and the per-layer states,
    # the stack axis moved to the front as a positional axis.
    to_scanned = lambda x: x.untag_prefix(axis).with_positional_prefix()
    stacked = _named_arrays_with(sublayer, axis)
    array_slices = [_as_bits(to_scanned(x)) for x in stacked.get_sequence()]
    dtypes = [x.dtype for x in stacked.get_sequence()]
    sliced_states = [
        variables.StateVariableValue(
            value=jax.tree_util.tree_map(
                to_scanned, var.value, is_leaf=named_axes.is_namedarray),
            label=var.label, metadata=var.metadata)
        for var in per_layer
    ]

    def body(carry, slices):
      arg, shared_states = carry
      array_slices, sliced_states = slices
      block = stacked.set_sequence(
          [_from_bits(x, d) for x, d in zip(array_slices, dtypes)])
      out, new_states = stateless_call(
          block, shared_states + sliced_states, arg, **side_inputs)
      by_label = {state.label: state for state in new_states}
      new_shared = [by_label[s.label] for s in shared_states]
      new_sliced = (
          selectors.select([by_label[s.label] for s in sliced_states])
          .at_instances_of(named_axes.NamedArrayBase)
          .apply(lambda x: x.with_positional_prefix()))
      return named_axes.order_like((out, new_shared), carry), new_sliced

    (out, new_shared), new_sliced = jax.lax.scan(
        body,
        init=(argument, [var.freeze() for var in shared]),
        xs=(array_slices, sliced_states),
        length=self.stack_axis_size,
        unroll=self.unroll,
    )
    for var, state in zip(shared, new_shared):
      var.value = state.value
    for var, state in zip(per_layer, new_sliced):
      var.value = jax.tree_util.tree_map(
          lambda x: x.tag_prefix(axis), state.value,
          is_leaf=named_axes.is_namedarray)
    return out

  def _split_state_vars(self, side_input_vars, sublayer_vars):
    """Shared and per-layer state variables, checked as penzai checks them.

    Side input variables are always shared; sublayer variables follow their
    ``layerstack_axes`` metadata.
    """
    axis = self.stack_axis
    shared = {var.label: var for var in side_input_vars}
    per_layer = {}
    for var in sublayer_vars:
      behavior = var.metadata.get("layerstack_axes", {}).get(axis)
      if behavior is None:
        raise ValueError(
            "All variables in a layer stack must have a `layerstack_axes` "
            "metadata field indicating which axes they are shared over.")
      if behavior == _Behavior.SHARED:
        bad = _named_arrays_with(var.value, axis)
        if bad.count():
          paths = [pz_tree_util.pretty_keystr(path, var.value)
                   for path in bad.selected_by_path]
          raise ValueError(
              f"Variable {var.label} has shared behavior for layer stack axis"
              f" {axis} but the stack axis appears in NamedArrays at"
              f" keypaths: {paths}")
        # A shared variable may also be a side input (the same variable).
        if shared.setdefault(var.label, var) is not var:
          raise ValueError(
              f"Different variables with same label {var.label} found in side"
              " inputs and sublayers.")
      elif behavior == _Behavior.PER_LAYER:
        if var.label in shared:
          raise ValueError(
              f"Per-layer variable {var.label} cannot also be provided as a"
              " side input.")
        leaves = jax.tree_util.tree_leaves(
            var.value, is_leaf=named_axes.is_namedarray)
        if not all(isinstance(leaf, named_axes.NamedArrayBase)
                   and axis in leaf.named_shape for leaf in leaves):
          raise ValueError(
              f"Variable {var.label} has per-layer behavior for layer stack"
              f" axis {axis} but the stack axis does not appear in all leaves"
              " of the variable value.")
        per_layer[var.label] = var
      else:
        raise ValueError(
            f"Unknown layer stack variable behavior: {behavior} for variable"
            f" with label {var.label}")
    return list(shared.values()), list(per_layer.values())
