"""Prompts prefilled over the layer stacks (`Engine.prefill_over_stacks`).

The decode loop runs on per-layer blocks (`penzai_lm.runtime.unstack`).
Where the engine prefills over the stacks (`wanted`), a fresh prompt's
prefill runs on the model as the user stacked it, prepared the same way
(`prepare.prepare_model`): its caches come out with the stack axis, and
`StackedPrefill.unstacked` splits them into the decode model's per-layer
variables, in the order `penzai_lm.runtime.unstack.unstacked_state_order`
gives. A continued session turn keeps the per-layer prefill (its state is
the decode model's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.generation.prepare import PreparedModel
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
    split_kernel: Split the stacked caches with `kernel_ops.split` (on one
      CPU device, with the kernels built).
  """

  treedef: Any
  layout: StateLayout
  order: tuple[StateSlice, ...]
  split_kernel: bool = False

  def unstacked(self, state, layout: StateLayout) -> list:
    """The stacked model's state (after a prefill) as the decode model's
    (``layout``): per-layer variables are blocks of the stacked ones (split
    in one kernel call where the kernels run)."""
    refs = layout.unflatten(jnp.zeros(s.shape, s.dtype)
                            for s in layout.leaves)
    values = split_state(state, self.order,
                         kernel_ops.split if self.split_kernel else None)
    return layout.conform([dataclasses.replace(ref, value=value)
                           for ref, value in zip(refs, values)])


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


def program_static(prepared: PreparedModel) -> StackedPrefill | None:
  """The static part of a prefill program over ``prepared``'s stacked
  model (None: it has none)."""
  if prepared.prefill is None:
    return None
  return StackedPrefill(prepared.prefill.treedef, prepared.prefill.layout,
                        prepared.prefill.state_order,
                        # On one CPU device with the kernels built.
                        split_kernel=prepared.prefill.cpu_sampler)


def with_stacked_prefill(decode: PreparedModel,
                         stacked: PreparedModel) -> PreparedModel:
  """``decode`` (a model whose layer stacks were unstacked) with fresh
  prompts prefilled on ``stacked`` (the same model with its stacks,
  prepared the same way), where the state carries over.

  Scanned over the stack, a new prefill program compiles one block instead
  of one per layer and XLA:CPU builds its kernels' runtimes once, not once
  per layer; its warm runs are slower (`Engine.prefill_over_stacks` has
  the trade, `docs/cpu-speed.md` the figures). Decoding stays on the
  per-layer blocks (`penzai_lm.runtime.unstack`).

  Returns ``decode`` unchanged where the stacked model's state does not
  map onto the decode model's variable for variable with the same shapes
  (a stack inside a stack, a patch whose state takes another shape).
  """
  if stacked.state_order is None or (stacked.layout.placement is not None
                                     or decode.layout.placement is not None):
    return decode

  def unstacked(args):
    return split_state(stacked.layout.initial(args), stacked.state_order)

  try:
    got = jax.eval_shape(unstacked, stacked.state_args)
  except (KeyError, ValueError, TypeError):
    return decode
  want = [v.value for v in decode.layout.unflatten(
      jax.ShapeDtypeStruct(s.shape, s.dtype) for s in decode.layout.leaves)]
  if len(got) != len(want) or any(
      _shapes(a) != _shapes(b) for a, b in zip(got, want)):
    return decode
  return dataclasses.replace(decode, prefill=stacked)


def _shapes(value) -> list:
  """Each array of a state value: its named axes (in any order), its
  positional shape and its dtype."""
  out = []
  for x in jax.tree_util.tree_leaves(value, is_leaf=pz.nx.is_namedarray):
    if isinstance(x, pz.nx.NamedArrayBase):
      out.append((sorted(x.named_shape.items()), x.positional_shape,
                  np.dtype(x.dtype)))
    else:
      out.append(((), tuple(np.shape(x)), np.dtype(x.dtype)))
  return out
