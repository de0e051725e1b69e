"""Sharding rules: which mesh axes each named axis is split over."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Mapping, Union

import jax

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


def as_mesh_axes(value: MeshAxes, axis: str) -> tuple[str, ...]:
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
    return cls(tuple((axis, as_mesh_axes(value, axis))
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
