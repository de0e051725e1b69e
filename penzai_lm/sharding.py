"""Sharding a model over a device mesh, by the names of its axes.

Conventions:

* A `ShardingRules` maps named axes (see `penzai_lm.model.transformer` for
  the names) to mesh axes. An axis it does not list, or lists with ``()``,
  stays whole (replicated). `DEFAULT_RULES`: tensor parallelism on a mesh
  axis ``"model"`` over attention heads (``heads``, ``head_groups``), MLP
  ``neurons`` and the ``vocabulary`` (embedding and unembedding), and data
  parallelism on a mesh axis ``"data"`` over ``batch`` (used by the
  generation engine for its per-row state; no weight has a batch axis).
* `shard(model, mesh, rules)` places every parameter (``pz.Parameter`` or
  ``pz.ParameterValue`` holding a named array) with a
  ``jax.sharding.NamedSharding`` built from its axis names; a parameter axis
  a mesh axis does not divide is an error, never silently replicated.
  `parameter_sharding` is the same rule for one array (for loaders that place
  each tensor as they read it).
* A quantized projection (`penzai_lm.quantization.QuantizedLinear`) keeps
  its output axes flattened into ``quant_out`` and its input axes into
  ``quant_in`` (values) and ``quant_groups`` (scale groups). Each flattened
  axis splits as the layer's leading output / input axis does (a query
  projection's ``quant_out`` over ``head_groups``, an MLP down projection's
  ``quant_in`` over ``neurons``), which cuts it into contiguous runs of
  whole rows and whole scale groups; a rule that splits a later axis of
  the flattened ones, or scale groups that do not divide, is an error.
* Programs run SPMD with automatic propagation: meshes are used with
  ``AxisType.Auto`` axes (``jax.make_mesh`` makes ``Explicit`` ones, whose
  sharding-in-types would reject the model's contractions over sharded
  axes), so a mesh of either kind gives the same placement.
* Multi-host: call ``jax.distributed.initialize()`` in every process, build
  the mesh over ``jax.devices()`` (all processes' devices) and run the same
  code in every process.

penzai's ``toolshed.sharding_util.name_to_name_sharding`` maps names the same
way, but neither checks that a mesh axis divides the axis it splits nor
counts a named array's positional axes, so the spec is built here.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Union

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from penzai import pz

from penzai_lm.quantization.layers import QuantizedLinear

MeshAxes = Union[str, tuple[str, ...], None]
"""Mesh axes of one rule: a name, several (split over their product), or
None / ``()`` (the axis stays whole)."""

KNOWN_AXES = frozenset({
    "batch", "seq", "kv_seq", "embedding", "heads", "head_groups",
    "query_heads", "projection", "neurons", "vocabulary", "blocks",
    "positions",
})
"""Axis names of penzai_lm's models and engine (rules may name them even
where one model lacks them, e.g. ``heads`` for a grouped-query model)."""


def _mesh_axes(value: MeshAxes, axis: str) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    return (value,)
  if isinstance(value, tuple) and all(isinstance(a, str) for a in value):
    return value
  raise TypeError(
      f"the rule for axis {axis!r} must be a mesh axis name, a tuple of"
      f" them, or None, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Which mesh axes each named axis is split over.

  Build with `ShardingRules.of` (a complete set) or change `DEFAULT_RULES`
  with `override`::

      rules = penzai_lm.sharding.DEFAULT_RULES.override(vocabulary=None)

  Attributes:
    axes: ``(axis name, mesh axes)`` pairs; ``()`` keeps the axis whole, as
      does leaving it out.
  """

  axes: tuple[tuple[str, tuple[str, ...]], ...] = ()

  @classmethod
  def of(cls, mapping: Mapping[str, MeshAxes]) -> ShardingRules:
    """Rules from ``{axis name: mesh axis, tuple of them, or None}``."""
    if not isinstance(mapping, Mapping):
      raise TypeError(
          "sharding rules must be a mapping {axis name: mesh axis or None},"
          f" got {type(mapping).__name__}.")
    for axis in mapping:
      if not isinstance(axis, str):
        raise TypeError(f"rule keys must be axis names, got {axis!r}.")
    return cls(tuple((axis, _mesh_axes(value, axis))
                     for axis, value in mapping.items()))

  def override(self, mapping: Mapping[str, MeshAxes] | None = None,
               **axes: MeshAxes) -> ShardingRules:
    """These rules with some axes changed (None: keep the axis whole)."""
    return ShardingRules.of({**self.as_dict(), **(mapping or {}), **axes})

  def as_dict(self) -> dict[str, tuple[str, ...]]:
    return dict(self.axes)

  def mesh_axes(self, axis: str) -> tuple[str, ...]:
    """The mesh axes ``axis`` is split over (``()``: whole)."""
    return self.as_dict().get(axis, ())


DEFAULT_RULES = ShardingRules.of({
    "batch": "data",
    "heads": "model",
    "head_groups": "model",
    "neurons": "model",
    "vocabulary": "model",
})


def check_mesh(mesh) -> jax.sharding.Mesh:
  """``mesh`` with automatic (``AxisType.Auto``) axes; see the module
  docstring.

  Raises:
    TypeError: if ``mesh`` is not a ``jax.sharding.Mesh``.
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
        "mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((2, 4),"
        f" ('data', 'model'))), got {type(mesh).__name__}.")
  auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
  if tuple(mesh.axis_types) == auto:
    return mesh
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def resolve_rules(rules: ShardingRules | Mapping[str, MeshAxes] | None,
                  mesh: jax.sharding.Mesh, *,
                  model_axes: frozenset[str] | None = None) -> ShardingRules:
  """The complete, checked rules for ``mesh``.

  Args:
    rules: None for `DEFAULT_RULES`; a mapping to override some of them
      (``{"vocabulary": None}``); a `ShardingRules` to replace them all.
    mesh: The mesh.
    model_axes: The model's parameter axis names, if known: a rule for an
      axis neither the model nor penzai_lm uses is then an error (a typo).

  The defaults' mesh axes that ``mesh`` lacks are dropped (a mesh with only
  a ``"model"`` axis is tensor parallel only); the caller's must exist.

  Raises:
    TypeError / ValueError: for malformed rules, a mesh axis the mesh does
      not have, or an unknown axis name.
  """
  mesh = check_mesh(mesh)
  names = tuple(mesh.axis_names)
  if rules is None or isinstance(rules, Mapping):
    given = ShardingRules.of(rules or {}).as_dict()
    defaults = {axis: tuple(a for a in axes if a in names)
                for axis, axes in DEFAULT_RULES.axes}
    if rules is None and not any(defaults.values()):
      raise ValueError(
          "the default sharding rules use mesh axes 'model' (tensor"
          f" parallel) and 'data' (batch), but the mesh has axes {names};"
          " name the mesh axes so, or pass rules={axis name: mesh axis}.")
  elif isinstance(rules, ShardingRules):
    given, defaults = rules.as_dict(), {}
  else:
    raise TypeError(
        "rules must be None, a mapping {axis name: mesh axis or None} or a"
        f" penzai_lm.ShardingRules, got {type(rules).__name__}.")
  for axis, axes in given.items():
    missing = [a for a in axes if a not in names]
    if missing:
      raise ValueError(
          f"the rule {axis!r} -> {axes} names mesh axis {missing[0]!r}, but"
          f" the mesh has axes {names}; use one of those (or None to keep"
          f" {axis!r} whole).")
    if len(set(axes)) != len(axes):
      raise ValueError(f"the rule for {axis!r} repeats a mesh axis: {axes}.")
    if model_axes is not None and axis not in model_axes | KNOWN_AXES:
      close = difflib.get_close_matches(axis, model_axes | KNOWN_AXES, 1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise ValueError(
          f"the sharding rules name axis {axis!r}{hint}, which the model"
          f" does not use; its parameter axes are {sorted(model_axes)}.")
  return ShardingRules.of({**defaults, **given})


def _data_axes(x: pz.nx.NamedArrayBase) -> tuple[str | None, ...]:
  """The axis name of each dimension of ``x.data_array`` (None:
  positional)."""
  if isinstance(x, pz.nx.NamedArrayView):
    names = [None] * len(x.data_shape)
    for name, dim in x.data_axis_for_name.items():
      names[dim] = name
    return tuple(names)
  return (None,) * len(x.positional_shape) + tuple(x.named_axes)


def _spec(axes, shape, mesh: jax.sharding.Mesh, rules: ShardingRules, *,
          strict: bool, label: str) -> PartitionSpec:
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
    axes, shape = _data_axes(array), array.data_array.shape
  elif isinstance(array, Mapping):
    axes, shape = tuple(array), tuple(array.values())
  else:
    raise TypeError(
        "array must be a named array or {axis name: size}, got"
        f" {type(array).__name__}.")
  return NamedSharding(mesh, _spec(axes, shape, mesh, rules, strict=True,
                                   label=repr(label)))


def state_sharding(array: Any, mesh: jax.sharding.Mesh,
                   rules: ShardingRules) -> NamedSharding:
  """The sharding of a state array (a KV cache, a capture buffer): like a
  parameter's, but an axis a mesh axis cannot split stays whole (the
  engine's batch bucket need not divide the data axis). Arrays without
  names are replicated."""
  if isinstance(array, pz.nx.NamedArrayBase):
    spec = _spec(_data_axes(array), array.data_array.shape, mesh, rules,
                 strict=False, label="")
  else:
    spec = PartitionSpec()
  return NamedSharding(mesh, spec)


@dataclasses.dataclass(frozen=True)
class _Flattened:
  """The axes a quantized weight's arrays flatten (see the module
  docstring): ``(name, size)`` of the layer's output and input axes, and
  its number of scale groups along the input."""

  out_axes: tuple[tuple[str, int], ...]
  in_axes: tuple[tuple[str, int], ...]
  groups: int


def _flattened(model) -> dict[str, _Flattened]:
  """By parameter label, the axes of every quantized weight's arrays."""
  found = {}
  for layer in (pz.select(model).at_instances_of(QuantizedLinear)
                .get_sequence()):
    groups = layer.scale.value.named_shape["quant_groups"]
    for part in (layer.qs, layer.scale, layer.mins):
      if part is not None:
        found[part.label] = _Flattened(layer.out_axes, layer.in_axes, groups)
  return found


def _unflattened_axes(value, flat: _Flattened, mesh, rules: ShardingRules,
                      label: str) -> tuple[list, list]:
  """Names and sizes of a quantized array's dimensions as `_spec` checks
  them: each flattened axis as the model axis it splits like."""
  sizes = dict(mesh.shape)

  def ways(name):
    n = 1
    for a in rules.mesh_axes(name):
      n *= sizes[a]
    return n

  for kind, axes in (("output", flat.out_axes), ("input", flat.in_axes)):
    for name, _ in axes[1:]:
      if ways(name) > 1:
        raise ValueError(
            f"cannot shard {label}: a quantized layer keeps its {kind} axes"
            f" {[a for a, _ in axes]} as one flattened axis, which splits"
            f" only along {axes[0][0]!r}, not {name!r}. Keep {name!r} whole"
            f" (rules={{{name!r}: None}}), or shard the float model.")
  (out_name, out_size), (in_name, in_size) = flat.out_axes[0], flat.in_axes[0]
  if flat.groups > 1 and flat.groups % ways(in_name):
    raise ValueError(
        f"cannot shard {label}: its {flat.groups} scale groups along"
        f" {in_name!r} do not divide over {ways(in_name)} devices. Use a"
        f" mesh whose axes divide them, or keep {in_name!r} whole (rules="
        f"{{{in_name!r}: None}}).")
  names, shape = [], []
  for name, size in zip(_data_axes(value), value.data_array.shape):
    if name == "quant_out":
      name, size = out_name, out_size
    elif name == "quant_in" or (name == "quant_groups" and flat.groups > 1):
      name, size = in_name, in_size
    elif name == "quant_groups":  # One scale per row: never split.
      name = None
    names.append(name)
    shape.append(size)
  return names, shape


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
  parameters = _parameters(model)
  if not parameters:
    raise ValueError(
        "the model has no parameters to shard (unbound slots? load or build"
        " it with weights first).")
  flattened = _flattened(model)
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
        axes, shape = _unflattened_axes(value, flattened[label], mesh, rules,
                                        where)
      else:
        axes, shape = _data_axes(value), value.data_array.shape
      sharding = NamedSharding(mesh, _spec(axes, shape, mesh, rules,
                                           strict=True, label=where))
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


def model_sharding(model) -> ModelSharding | None:
  """The mesh and rules of a model's ``NamedSharding``-placed arrays, or
  None if it has none (one device).

  Rules are read back from the arrays rather than kept with the model, so a
  model sharded by hand works as well; an axis split differently by
  different arrays counts as whole.

  Raises:
    ValueError: if its arrays are on different meshes.
  """
  meshes, found, mixed = set(), {}, set()
  # A quantized weight's flattened axes count as the axes they split like.
  leading = {}
  for label, flat in _flattened(model).items():
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
    for name, entry in zip(_data_axes(x), spec):
      name = names.get(name, name)
      if name is not None and not name.startswith("quant_"):
        axes = _mesh_axes(entry, name)
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
