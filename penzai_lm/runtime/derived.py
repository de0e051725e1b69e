"""Patched variants of one model share its prepared form.

``cv.apply(model, 4.0)``, ``insert_at(model, point, AddVector(...))`` or a
new `Ablate` build a new model object whose weights are the base model's
own arrays; only the patch's few arrays are new. Preparing each such
object from scratch (unstacking, cached mode, kernels, flattening:
`penzai_lm.generation.prepare`) is a second of host work per call, and
unstacking copies the weights on accelerators. So the engine's caches key
a model on its structure and the identity of its *weights*, and treat its
other arrays as values that may differ:

* Weights are the arrays held by parameters (``pz.ParameterValue`` and the
  values of ``pz.Parameter`` variables) and the values of state variables;
  they are keyed by identity. Every other array (a patch's vector, mask or
  strength, a hook point's index) is keyed by shape, dtype and sharding.
* While a value is made from a model (`Lineage`), the steps that compute a
  new array from one of the model's arrays -- a block's slice of a stacked
  array, per-row values gathered to the decode rows -- record what they
  did. `Lineage.recipes` then says, for every array of the made value that
  comes from one of the model's non-weight arrays, which one and how
  (`Recipe`).
* A variant (same structure and weights, other non-weight arrays) gets the
  cached value with those arrays recomputed (`rederive`): the weights'
  prepared forms are reused as they are, nothing is unstacked or copied.

A value whose non-weight arrays are not all accounted for by recipes (a
step that does not record computed from one of them) is not derivable:
variants are then prepared from scratch, as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
from penzai import pz

WEIGHT, VALUE, OTHER = "weight", "value", "other"


def _is_node_leaf(x) -> bool:
  return isinstance(x, (pz.ParameterValue, pz.AbstractVariable))


def classified_leaves(model) -> tuple[Any, list, list[str]]:
  """``(treedef, leaves, kinds)`` of ``jax.tree_util.tree_flatten(model)``.

  ``kinds[i]`` is `WEIGHT` for an array held by a parameter, a variable
  itself (keyed by identity with its value), `VALUE` for any other array
  (JAX or numpy) and `OTHER` for anything else.
  """
  top, _ = jax.tree_util.tree_flatten(model, is_leaf=_is_node_leaf)
  leaves, kinds = [], []
  for x in top:
    if isinstance(x, pz.ParameterValue):
      inner = jax.tree_util.tree_leaves(x)
      leaves += inner
      kinds += [WEIGHT] * len(inner)
    elif isinstance(x, pz.AbstractVariable):
      leaves.append(x)
      kinds.append(WEIGHT)
    else:
      leaves.append(x)
      kinds.append(VALUE if isinstance(x, (jax.Array, np.ndarray))
                   else OTHER)
  return jax.tree_util.tree_structure(model), leaves, kinds


def _sharding(x):
  return x.sharding if isinstance(x, jax.Array) else None


def variant_key(model) -> tuple[Any, list, tuple[int, ...]]:
  """A hashable key shared by the variants of one model.

  Returns:
    ``(key, leaves, values)``: the key holds the structure, the identity of
    the weights (and of each variable's current value) and the shape,
    dtype and sharding of the other arrays; ``values`` are the indices in
    ``leaves`` of those other arrays. Keep ``leaves`` alive as long as the
    key is used (ids are only unique then).
  """
  treedef, leaves, kinds = classified_leaves(model)
  items, values = [], []
  for i, (x, kind) in enumerate(zip(leaves, kinds)):
    if kind == VALUE:
      values.append(i)
      items.append((np.shape(x), np.dtype(x.dtype), _sharding(x)))
    elif isinstance(x, pz.AbstractVariable):
      items.append((id(x), id(x.value)))
    else:
      items.append(id(x))
  return (treedef, tuple(items)), leaves, tuple(values)


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How one array of a made value follows one of the model's arrays.

  Attributes:
    target: Index of the array in the made value's arrays.
    source: Index of the model's array (a `VALUE` leaf) it is computed from.
    steps: Functions applied in order (none: it is that array itself).
  """

  target: int
  source: int
  steps: tuple[Callable[[Any], Any], ...] = ()

  def apply(self, source):
    for step in self.steps:
      source = step(source)
    return source


class Lineage:
  """Records which new arrays were computed from which, while a value is
  made from a model (see the module docstring). Holds every recorded
  array until it is dropped, so their ids stay unique."""

  def __init__(self):
    self._made: dict[int, tuple[Any, Any, Callable]] = {}

  def record(self, result, source, step: Callable[[Any], Any]) -> None:
    """``result`` is ``step(source)`` (both arrays, as pytree leaves)."""
    if result is not source:
      self._made[id(result)] = (result, source, step)

  def record_named(self, result, source, op: Callable) -> None:
    """``result = op(source)`` for named arrays, whose one pytree leaf is
    their data array: records ``op`` on that leaf."""
    (src_leaf,), src_def = jax.tree_util.tree_flatten(source)
    (out_leaf,) = jax.tree_util.tree_leaves(result)

    def step(data, src_def=src_def):
      return jax.tree_util.tree_leaves(
          op(jax.tree_util.tree_unflatten(src_def, [data])))[0]

    self.record(out_leaf, src_leaf, step)

  def seed(self, made_leaves: Sequence, model_leaves: Sequence,
           recipes: Sequence[Recipe]) -> None:
    """Records an earlier value's recipes (``made_leaves`` computed from
    ``model_leaves``), so that values made from it trace back through."""
    for r in recipes:
      if r.steps:
        self.record(made_leaves[r.target], model_leaves[r.source], r.apply)

  def recipes(self, made_leaves: Sequence, model_leaves: Sequence,
              values: Sequence[int]) -> tuple[Recipe, ...] | None:
    """Recipes for ``made_leaves`` from the model's `VALUE` arrays
    (indices ``values`` of ``model_leaves``); None if one of those arrays
    reaches no made array through recorded steps (not derivable)."""
    source_of = {id(model_leaves[k]): k for k in values}
    found, out = set(), []
    for j, leaf in enumerate(made_leaves):
      steps, current = [], leaf
      while id(current) not in source_of and id(current) in self._made:
        _, current, step = self._made[id(current)]
        steps.append(step)
      k = source_of.get(id(current))
      if k is not None:
        found.add(k)
        out.append(Recipe(j, k, tuple(reversed(steps))))
    return tuple(out) if found == set(values) else None


def rederive(made_leaves: Sequence, recipes: Sequence[Recipe],
             changed: dict[int, Any]) -> list:
  """``made_leaves`` with the arrays computed from ``changed`` model
  arrays (index -> new array) recomputed; the rest are kept."""
  out = list(made_leaves)
  for r in recipes:
    if r.source in changed:
      out[r.target] = r.apply(changed[r.source])
  return out


def alias_weights(tree, model_leaves: Sequence, values: Sequence[int]):
  """``tree`` with every array that is one of the model's weights (or a
  variable's value) replaced by a new ``jax.Array`` over the same buffers.

  The engine's caches hold what they made from a model, but know the model
  only through weak references to its weights: a value holding those very
  objects kept them, and so the whole model, alive after the user dropped
  it. An alias costs no copy.
  """
  skip = set(values)
  weights = set()
  for i, x in enumerate(model_leaves):
    if i in skip:
      continue
    x = x.value if isinstance(x, pz.AbstractVariable) else x
    if isinstance(x, jax.Array):
      weights.add(id(x))

  def alias(x):
    if id(x) not in weights or x.is_deleted():
      return x
    return jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [s.data for s in x.addressable_shards])

  return jax.tree_util.tree_map(alias, tree)


@dataclasses.dataclass(frozen=True)
class Derivable:
  """A value made from a model, with what remakes it for a variant.

  Attributes:
    value: The value.
    recipes: See `Lineage.recipes` (None: not derivable).
    leaves: ``fn(value)``: the arrays the recipes' targets index.
    rebuild: ``fn(value, arrays)``: the value with those arrays replaced.
  """

  value: Any
  recipes: tuple[Recipe, ...] | None = None
  leaves: Callable[[Any], list] | None = None
  rebuild: Callable[[Any, list], Any] | None = None

  def derive(self, changed: dict[int, Any]) -> "Derivable":
    """This value for a variant whose arrays ``changed`` differ."""
    if not changed:
      return self
    value = self.rebuild(self.value, rederive(self.leaves(self.value),
                                              self.recipes, changed))
    return dataclasses.replace(self, value=value)


def derivable_tree(tree, model_leaves: Sequence, values: Sequence[int],
                   lineage: Lineage) -> Derivable:
  """A `Derivable` for a pytree ``tree`` made from a model (its leaves)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return Derivable(
      tree, lineage.recipes(leaves, model_leaves, values),
      leaves=jax.tree_util.tree_leaves,
      rebuild=lambda _, new: jax.tree_util.tree_unflatten(treedef, new))
