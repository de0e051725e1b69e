"""`stateless_call`: penzai's ``Layer.stateless_call`` without a selection.

penzai's method first freezes every variable left in the layer with
``pz.select(...).at_instances_of(AbstractVariable)``, which rebuilds the
whole tree through penzai's selection machinery even when there is nothing
to freeze. The engine's programs call it on models whose parameters are
already frozen, once per program and once per shared block trace. Here
one flatten finds the mutable variables, and the tree is only rebuilt when
there are some.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
from penzai import pz
from penzai.core import variables as penzai_variables


def freeze_mutable(tree: Any) -> Any:
  """``tree`` with every mutable variable replaced by its frozen value
  (``pz.freeze_variables``), or ``tree`` itself if it holds none."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if not any(isinstance(leaf, penzai_variables.AbstractVariable)
             for leaf in leaves):
    return tree
  return treedef.unflatten([
      leaf.freeze() if isinstance(leaf, penzai_variables.AbstractVariable)
      else leaf for leaf in leaves])


def stateless_call(
    layer: pz.nn.Layer,
    variable_values: Iterable[penzai_variables.AbstractVariableValue],
    argument: Any,
    /,
    **side_inputs: Any,
) -> tuple[Any, tuple[penzai_variables.AbstractVariableValue, ...]]:
  """``layer.stateless_call(variable_values, argument, **side_inputs)``.

  Same result: the layer runs with mutable copies of ``variable_values``
  bound to its slots (and to those of the argument and side inputs), any
  variable still in the layer frozen, and returns ``(result, updated
  frozen values)``.
  """
  mutable = [value.unfreeze_as_copy() for value in variable_values]
  bound_layer, bound_argument, bound_sides = pz.bind_variables(
      (freeze_mutable(layer), argument, side_inputs), mutable)
  result = bound_layer(bound_argument, **bound_sides)
  return result, tuple(var.freeze() for var in mutable)
