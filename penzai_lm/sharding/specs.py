"""The partition spec of one array from the names of its axes."""

from __future__ import annotations

from typing import Any, Mapping

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from penzai import pz

from penzai_lm.sharding.rules import MeshAxes
from penzai_lm.sharding.rules import ShardingRules
from penzai_lm.sharding.rules import check_mesh
from penzai_lm.sharding.rules import resolve_rules


def data_axes(x: pz.nx.NamedArrayBase) -> tuple[str | None, ...]:
  """The axis name of each dimension of ``x.data_array`` (None:
  positional)."""
  if isinstance(x, pz.nx.NamedArrayView):
    names = [None] * len(x.data_shape)
    for name, dim in x.data_axis_for_name.items():
      names[dim] = name
    return tuple(names)
  return (None,) * len(x.positional_shape) + tuple(x.named_axes)


def partition_spec(axes, shape, mesh: jax.sharding.Mesh,
                   rules: ShardingRules, *, strict: bool,
                   label: str) -> PartitionSpec:
  """The spec of an array whose dimensions have names ``axes`` and sizes
  ``shape``. Not ``strict``: an axis a mesh axis cannot split (it does not
  divide it, or another axis of the array uses it) stays whole."""
  sizes = dict(mesh.shape)
  used, spec = set(), []
  for name, size in zip(axes, shape):
    mesh_axes = rules.mesh_axes(name) if name is not None else ()
    ways = 1
    for a in mesh_axes:
      ways *= sizes[a]
    problem = None
    if used & set(mesh_axes):
      problem = (f"axis {name!r} would reuse mesh axes"
                 f" {sorted(used & set(mesh_axes))} that another of its axes"
                 " is split over")
    elif size % ways:
      problem = (f"axis {name!r} of size {size} does not divide over mesh"
                 f" axes {mesh_axes} of {ways} devices")
    if problem and strict:
      raise ValueError(
          f"cannot shard {label}: {problem}. Use a mesh whose"
          f" {mesh_axes} axes divide it, or keep {name!r} whole (rules="
          f"{{{name!r}: None}}).")
    if problem or not mesh_axes:
      spec.append(None)
      continue
    used |= set(mesh_axes)
    spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return PartitionSpec(*spec)


def parameter_sharding(array: pz.nx.NamedArrayBase | Mapping[str, int],
                       mesh: jax.sharding.Mesh,
                       rules: ShardingRules | Mapping[str, MeshAxes]
                       | None = None, *,
                       label: str = "parameter") -> NamedSharding:
  """The sharding of one parameter: what `shard` gives it.

  For loaders that place each tensor on its shards as they read it::

      rules = sharding.resolve_rules(rules, mesh, model_axes=...)  # Once.
      value = jax.device_put(host_array,
                             sharding.parameter_sharding(axes, mesh, rules,
                                                         label=name))

  Args:
    array: A named array (its data may be a ``jax.ShapeDtypeStruct``), or
      ``{axis name: size}`` in the order of the data's dimensions.
    mesh: The mesh.
    rules: As in `resolve_rules` (a resolved `ShardingRules` is taken as
      is, apart from its mesh axes being checked).
    label: The parameter's name, for errors.

  Raises:
    ValueError: if a mesh axis does not divide the axis it splits.
  """
  mesh = check_mesh(mesh)
  rules = resolve_rules(rules, mesh)
  if isinstance(array, pz.nx.NamedArrayBase):
    axes, shape = data_axes(array), array.data_array.shape
  elif isinstance(array, Mapping):
    axes, shape = tuple(array), tuple(array.values())
  else:
    raise TypeError(
        "array must be a named array or {axis name: size}, got"
        f" {type(array).__name__}.")
  return NamedSharding(mesh, partition_spec(
      axes, shape, mesh, rules, strict=True, label=repr(label)))


def state_sharding(array: Any, mesh: jax.sharding.Mesh,
                   rules: ShardingRules) -> NamedSharding:
  """The sharding of a state array (a KV cache, a capture buffer): like a
  parameter's, but an axis a mesh axis cannot split stays whole (the
  engine's batch bucket need not divide the data axis). Arrays without
  names are replicated."""
  if isinstance(array, pz.nx.NamedArrayBase):
    spec = partition_spec(data_axes(array), array.data_array.shape, mesh,
                          rules, strict=False, label="")
  else:
    spec = PartitionSpec()
  return NamedSharding(mesh, spec)
