"""Prompts prefilled over the layer stacks (`Engine.prefill_over_stacks`).

The decode loop runs on per-layer blocks (`penzai_lm.runtime.unstack`).
Where the engine prefills over the stacks (`wanted`), a fresh prompt's
prefill runs on the model as the user stacked it, prepared the same way
(`prepare.prepare_model`): its caches come out with the stack axis, and
`StackedPrefill.carry` splits them into the decode model's per-layer
variables, in the order `penzai_lm.runtime.unstack.unstacked_state_order`
gives. The layout of what it hands over comes from the stacked model
alone (`prefill_model`), so a first request traces the prefill and has
XLA compile it before the decode model is prepared; `fits` then checks
that the layout is the decode model's. A continued session turn keeps the
per-layer prefill (its state is the decode model's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.generation.prepare import PreparedModel
from penzai_lm.generation.state import LeafSpec
from penzai_lm.generation.state import StateLayout
from penzai_lm.kernels import on_one_cpu
from penzai_lm.kernels import ops as kernel_ops
from penzai_lm.quantization import tiled
from penzai_lm.runtime.unstack import split_state
from penzai_lm.runtime.unstack import StateSlice


@dataclasses.dataclass(frozen=True)
class StackedPrefill:
  """A prefill program's model with its layer stacks (static).

  Attributes:
    treedef: Its stateless model's structure.
    layout: Its state's layout (caches with the stack axes).
    order: Where each state variable of the decode model comes from.
    carried: The layout of the decode model's state as the prefill hands it
      over: a list of the variables' values (`PreparedModel.unstacked_layout`;
      `with_stacked_prefill` checks that the decode model's is the same).
    split_kernel: Split the stacked caches with `kernel_ops.split` (on one
      CPU device, with the kernels built).
  """

  treedef: Any
  layout: StateLayout
  order: tuple[StateSlice, ...]
  carried: StateLayout
  split_kernel: bool = False

  def carry(self, state) -> list:
    """The stacked model's state (after a prefill) as the decode loop
    carries the decode model's (`StateLayout.pack`): per-layer variables
    are blocks of the stacked ones (split in one kernel call where the
    kernels run), each value in the decode layout's axis order, or zeros
    of its shapes where the prefill left another shape (see
    `StateLayout.conform`)."""
    values = split_state(state, self.order,
                         kernel_ops.split if self.split_kernel else None)
    return self.carried.pack(self.carried.conform(values))


# Stacked weights whose scan costs warm prefill speed on XLA:CPU
# (`docs/cpu-speed.md`, `benchmarks/stacked_prefill.py --engine`): 16-bit
# floats, widened layer by layer. (4-bit blocks cost it too while XLA
# dequantized them; the kernels do now, `kernel_ops.dequantize`. The float16
# scales of quantized weights in tiles are read by the kernels as they lie.)
_SLOW_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _widened(x) -> bool:
  """Whether the scan widens ``x`` (a 16-bit float outside the tiles)."""
  return (jnp.dtype(x.dtype) in _SLOW_DTYPES
          and not set(x.named_shape) & set(tiled.TILE_AXES))


def wanted(setting, model) -> bool:
  """Whether an engine with ``prefill_over_stacks=setting`` prefills
  ``model`` (which has layer stacks) over them. "auto": on one CPU device
  with the kernels built, where no stacked array is a 16-bit float, whose
  widening the scan slows down (float32 and every quantized layout run as
  fast as per layer)."""
  if setting != "auto":
    return setting
  if not (kernel_ops.available() and on_one_cpu(model)):
    return False
  for stack in (pz.select(model).at_instances_of(pz.nn.LayerStack)
                .get_sequence()):
    arrays = (pz.select(stack.stacked_sublayers)
              .at_instances_of(pz.nx.NamedArrayBase).get_sequence())
    if any(_widened(x) for x in arrays):
      return False
  return True


def program_static(prefill: PreparedModel | None) -> StackedPrefill | None:
  """The static part of a prefill program over ``prefill``, a model with
  layer stacks from `prefill_model` (None: the prompt runs on the decode
  model)."""
  if prefill is None:
    return None
  return StackedPrefill(prefill.treedef, prefill.layout, prefill.state_order,
                        prefill.unstacked_layout,
                        # On one CPU device with the kernels built.
                        split_kernel=prefill.cpu_sampler)


def prefill_model(stacked: PreparedModel) -> PreparedModel | None:
  """``stacked`` (a model with layer stacks, prepared like the decode
  model) ready to prefill prompts for the decode model, with the layout of
  the state it hands over (`PreparedModel.unstacked_layout`: its state
  split into the unstacked model's variables); None where that cannot be
  followed (a stack inside a stack) or the state is placed on a mesh.

  The layout comes from the stacked model alone, so a prefill program over
  it is traced before the decode model is prepared (`Run.prefill`);
  `with_stacked_prefill` then checks that it is the decode model's.
  """
  if stacked.state_order is None or stacked.layout.placement is not None:
    return None

  def unstacked(args):
    return split_state(stacked.layout.initial(args), stacked.state_order)

  try:
    values = jax.eval_shape(unstacked, stacked.state_args)
  except (KeyError, ValueError, TypeError):
    return None
  leaves, treedef = jax.tree_util.tree_flatten(values)
  layout = StateLayout(treedef, tuple(
      LeafSpec(tuple(x.shape), np.dtype(x.dtype), None) for x in leaves))
  return dataclasses.replace(stacked, unstacked_layout=layout)


def fits(decode: PreparedModel, prefill: PreparedModel | None) -> bool:
  """Whether ``prefill`` (from `prefill_model`) prefills prompts for
  ``decode`` (the same model with its stacks unstacked, prepared the same
  way): the state it hands over is the decode model's, variable for
  variable, with the same structure, axis order, shapes and dtypes, and
  both pick tokens alike (``cpu_sampler``).
  """
  if (prefill is None or prefill.unstacked_layout is None
      or decode.layout.placement is not None
      or decode.cpu_sampler != prefill.cpu_sampler):
    return False
  carried, layout = prefill.unstacked_layout, decode.layout
  values = [v.value for v in layout.unflatten(
      jax.ShapeDtypeStruct(s.shape, s.dtype) for s in layout.leaves)]
  return (jax.tree_util.tree_structure(values) == carried.treedef
          and [(s.shape, s.dtype) for s in layout.leaves]
          == [(s.shape, s.dtype) for s in carried.leaves])


def with_stacked_prefill(decode: PreparedModel,
                         stacked: PreparedModel | None) -> PreparedModel:
  """``decode`` (a model whose layer stacks were unstacked) with fresh
  prompts prefilled on ``stacked`` (the same model with its stacks, from
  `prefill_model`), where the state carries over (`fits`).

  Scanned over the stack, a new prefill program compiles one block instead
  of one per layer and XLA:CPU builds its kernels' runtimes once, not once
  per layer; its warm runs are slower (`Engine.prefill_over_stacks` has
  the trade, `docs/cpu-speed.md` the figures). Decoding stays on the
  per-layer blocks (`penzai_lm.runtime.unstack`).

  Returns ``decode`` unchanged where ``stacked`` does not fit (a patch
  whose state takes another shape or axis order, for instance).
  """
  if not fits(decode, stacked):
    return decode
  return dataclasses.replace(decode, prefill=stacked)
