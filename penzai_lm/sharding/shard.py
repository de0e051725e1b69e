"""`shard`: every parameter of a model on a mesh; `model_sharding`: the
mesh and rules read back from a model's arrays."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from penzai import pz

from penzai_lm.quantization import in_rows
from penzai_lm.sharding.quantized import flattened_weights
from penzai_lm.sharding.quantized import unflattened_axes
from penzai_lm.sharding.rules import MeshAxes
from penzai_lm.sharding.rules import ShardingRules
from penzai_lm.sharding.rules import as_mesh_axes
from penzai_lm.sharding.rules import check_mesh
from penzai_lm.sharding.rules import resolve_rules
from penzai_lm.sharding.specs import data_axes
from penzai_lm.sharding.specs import partition_spec


def _parameters(model) -> list:
  return (pz.select(model)
          .at_instances_of((pz.Parameter, pz.ParameterValue))
          .get_sequence())


def shard(model, mesh: jax.sharding.Mesh,
          rules: ShardingRules | Mapping[str, MeshAxes] | None = None):
  """The model with every parameter placed on ``mesh`` by its axis names.

  Generation (`penzai_lm.generate`, `stream`, `Session`), captures and
  interventions then run SPMD over the mesh, with the same results as on
  one device::

      mesh = jax.make_mesh((2, 4), ("data", "model"))
      model = penzai_lm.shard(model, mesh)                  # DEFAULT_RULES
      model = penzai_lm.shard(model, mesh, {"vocabulary": None})  # override

  Args:
    model: A model whose parameters are ``pz.Parameter`` or
      ``pz.ParameterValue`` (frozen) variables holding named arrays.
      Mutable parameters are replaced by new ones (the given model is not
      changed); parameters shared by several layers stay shared.
    mesh: A ``jax.sharding.Mesh``.
    rules: None for `DEFAULT_RULES`, a mapping overriding some of them, or a
      complete `ShardingRules` (see `resolve_rules`).

  Raises:
    TypeError / ValueError: for a bad mesh or rules, a model without
      parameters, or a parameter axis a mesh axis does not divide (naming
      the parameter, the axis and the sizes).
  """
  mesh = check_mesh(mesh)
  # Quantized weights in the CPU kernels' tiles split as rows (new arrays).
  model = in_rows(model)
  parameters = _parameters(model)
  if not parameters:
    raise ValueError(
        "the model has no parameters to shard (unbound slots? load or build"
        " it with weights first).")
  flattened = flattened_weights(model)
  model_axes = frozenset(
      name for p in parameters if isinstance(p.value, pz.nx.NamedArrayBase)
      for name in p.value.named_shape) | frozenset(
          name for flat in flattened.values()
          for name, _ in flat.out_axes + flat.in_axes)
  rules = resolve_rules(rules, mesh, model_axes=model_axes)

  def put(value, label):
    if isinstance(value, pz.nx.NamedArrayBase):
      where = f"parameter {label!r}"
      if label in flattened:
        axes, shape = unflattened_axes(value, flattened[label], mesh, rules,
                                        where)
      else:
        axes, shape = data_axes(value), value.data_array.shape
      sharding = NamedSharding(mesh, partition_spec(
          axes, shape, mesh, rules, strict=True, label=where))
    else:
      sharding = NamedSharding(mesh, PartitionSpec())
    return jax.device_put(value, sharding)

  model = (pz.select(model).at_instances_of(pz.ParameterValue)
           .apply(lambda p: dataclasses.replace(p, value=put(p.value,
                                                             p.label))))
  unbound, variables = pz.unbind_params(model)
  return pz.bind_variables(unbound, [
      pz.Parameter(value=put(v.value, v.label), label=v.label,
                   metadata=v.metadata) for v in variables])


@dataclasses.dataclass(frozen=True)
class ModelSharding:
  """Where a sharded model lives, read back from its arrays.

  Attributes:
    mesh: The mesh of its sharded arrays.
    rules: The axis -> mesh axes mapping its arrays follow, plus ``batch``
      over the mesh axes no array uses (data parallelism), for state the
      engine builds.
  """

  mesh: jax.sharding.Mesh
  rules: ShardingRules


def _any_named_sharding(model) -> bool:
  """Whether an array of ``model`` (or of one of its variables) is placed
  with a ``NamedSharding``."""
  for x in jax.tree_util.tree_leaves(model):
    arrays = (jax.tree_util.tree_leaves(x.value)
              if isinstance(x, pz.AbstractVariable) else (x,))
    if any(isinstance(getattr(a, "sharding", None), NamedSharding)
           for a in arrays):
      return True
  return False


def model_sharding(model) -> ModelSharding | None:
  """The mesh and rules of a model's ``NamedSharding``-placed arrays, or
  None if it has none (one device).

  Rules are read back from the arrays rather than kept with the model, so a
  model sharded by hand works as well; an axis split differently by
  different arrays counts as whole.

  Raises:
    ValueError: if its arrays are on different meshes.
  """
  if not _any_named_sharding(model):
    return None  # One device: one flatten, none of the selections below.
  meshes, found, mixed = set(), {}, set()
  # A quantized weight's flattened axes count as the axes they split like.
  leading = {}
  for label, flat in flattened_weights(model).items():
    groups = flat.in_axes[0][0] if flat.groups > 1 else None
    leading[label] = dict(quant_out=flat.out_axes[0][0],
                          quant_in=flat.in_axes[0][0], quant_groups=groups)
  arrays = [(x, leading.get(p.label, {})) for p in _parameters(model)
            if isinstance(x := p.value, pz.nx.NamedArrayBase)]
  arrays += [(x, {}) for x in pz.select(model).at_instances_of(
      pz.nx.NamedArrayBase).get_sequence()]
  for x, names in arrays:
    sharding = getattr(x.data_array, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      continue
    meshes.add(sharding.mesh)
    spec = tuple(sharding.spec) + (None,) * len(x.data_array.shape)
    for name, entry in zip(data_axes(x), spec):
      name = names.get(name, name)
      if name is not None and not name.startswith("quant_"):
        axes = as_mesh_axes(entry, name)
        if found.setdefault(name, axes) != axes:
          mixed.add(name)
  if not meshes:
    return None
  if len(meshes) > 1:
    raise ValueError(
        f"the model's arrays are sharded over {len(meshes)} different"
        " meshes; place them all on one (penzai_lm.shard(model, mesh)).")
  mesh, = meshes
  rules = {name: axes for name, axes in found.items() if name not in mixed}
  used = {a for axes in rules.values() for a in axes}
  rules.setdefault("batch", tuple(a for a in mesh.axis_names
                                  if a not in used))
  return ModelSharding(mesh, ShardingRules.of(rules))
