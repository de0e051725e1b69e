"""How a quantized weight's flattened axes split (see the package
docstring)."""

from __future__ import annotations

import dataclasses

from penzai import pz

from penzai_lm.quantization.layers import QuantizedLinear
from penzai_lm.sharding.rules import ShardingRules
from penzai_lm.sharding.specs import data_axes


@dataclasses.dataclass(frozen=True)
class Flattened:
  """The axes a quantized weight's arrays flatten (see the package
  docstring): ``(name, size)`` of the layer's output and input axes, and
  its number of scale groups along the input."""

  out_axes: tuple[tuple[str, int], ...]
  in_axes: tuple[tuple[str, int], ...]
  groups: int


def flattened_weights(model) -> dict[str, Flattened]:
  """By parameter label, the axes of every quantized weight's arrays."""
  found = {}
  for layer in (pz.select(model).at_instances_of(QuantizedLinear)
                .get_sequence()):
    groups = layer.scale.value.named_shape["quant_groups"]
    for part in (layer.qs, layer.scale, layer.mins):
      if part is not None:
        found[part.label] = Flattened(layer.out_axes, layer.in_axes, groups)
  return found


def check_flattened(flat: Flattened, mesh, rules: ShardingRules,
                    label: str) -> None:
  """Raises ValueError if ``mesh`` and ``rules`` cannot split a quantized
  weight whose arrays flatten ``flat`` (also before it is quantized)."""
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
  in_name = flat.in_axes[0][0]
  if flat.groups > 1 and flat.groups % ways(in_name):
    raise ValueError(
        f"cannot shard {label}: its {flat.groups} scale groups along"
        f" {in_name!r} do not divide over {ways(in_name)} devices. Use a"
        f" mesh whose axes divide them, or keep {in_name!r} whole (rules="
        f"{{{in_name!r}: None}}).")


def unflattened_axes(value, flat: Flattened, mesh, rules: ShardingRules,
                      label: str) -> tuple[list, list]:
  """Names and sizes of a quantized array's dimensions as `_spec` checks
  them: each flattened axis as the model axis it splits like."""
  check_flattened(flat, mesh, rules, label)
  (out_name, out_size), (in_name, in_size) = flat.out_axes[0], flat.in_axes[0]
  names, shape = [], []
  for name, size in zip(data_axes(value), value.data_array.shape):
    if name == "quant_out":
      name, size = out_name, out_size
    elif name == "quant_in" or (name == "quant_groups" and flat.groups > 1):
      name, size = in_name, in_size
    elif name == "quant_groups":  # One scale per row: never split.
      name = None
    names.append(name)
    shape.append(size)
  return names, shape
