"""Models made ready for the engine's compiled programs.

`prepare_model` turns a user's model into what the programs take: layer
stacks unstacked (see below), converted to cached mode for the request's
batch and cache size (an uncached `TransformerLM`), frozen, split into
stateless layers and state, and flattened. The `Engine` caches the results
per model structure, weights and shape (`penzai_lm.runtime.program_cache`).

Layer stacks are unstacked for decoding (`penzai_lm.runtime.unstack`);
an engine may prefill prompts on the stacked model (`stacked_prefill.py`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.generation.state import LeafSpec
from penzai_lm.generation.state import StateLayout
from penzai_lm.kernels import on_one_cpu
from penzai_lm.kernels import ops as kernel_ops
from penzai_lm.kernels import with_cpu_kernels
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model.captures import CaptureSpec
from penzai_lm.model.captures import insert_captures
from penzai_lm.model.points import Point
from penzai_lm.model.prompt_attention import on_gpus
from penzai_lm.model.prompt_attention import on_one_gpu
from penzai_lm.model.prompt_attention import with_fused_prompt_attention
from penzai_lm.model.stateless import stateless_call
from penzai_lm.runtime.compiler_options import count_blocks
from penzai_lm.runtime.compiler_options import count_parameters
from penzai_lm.runtime.derived import Lineage
from penzai_lm.runtime.placement import placement_of
from penzai_lm.runtime.shared_traces import share_block_traces
from penzai_lm.runtime.unstack import host_view
from penzai_lm.runtime.unstack import StateSlice
from penzai_lm.runtime.unstack import unstacked_state_order


def per_row_size(model, batch_axis: str) -> int | None:
  """The rows of a model's per-row values: arrays (of patches, e.g. a
  strength per row) with the batch axis; None if it has none.

  Raises:
    ValueError: if they disagree on the number of rows.
  """
  sizes = {x.named_shape[batch_axis] for x in pz.select(model)
           .at_instances_of(pz.nx.NamedArrayBase).get_sequence()
           if batch_axis in x.named_shape}
  if len(sizes) > 1:
    raise ValueError(
        f"the model's per-row values have different numbers of rows along"
        f" {batch_axis!r}: {sorted(sizes)}; give every per-row value one"
        " entry per prompt (or per row).")
  return sizes.pop() if sizes else None


def row_index(size: int | None, *, num_prompts: int, num_samples: int,
              batch: int) -> tuple[int, ...] | None:
  """Which per-row entry each of the ``batch`` decode rows takes.

  Per-row values have one entry per prompt or one per row of the request
  (``num_prompts * num_samples``; the same without ``num_samples``); decode
  rows are prompt-major and padded to a bucket (padding rows take entry 0,
  and nothing reads them). A cached model's values may also match its own
  batch already. None: nothing to gather.

  Raises:
    ValueError: for any other number of entries.
  """
  rows = num_prompts * num_samples
  if size is None or (size == batch and size != num_prompts):
    return None
  if size == num_prompts:
    index = [r // num_samples for r in range(rows)]
  elif size == rows:
    index = list(range(rows))
  else:
    per_row = f" or {rows} (one per row)" if num_samples > 1 else ""
    raise ValueError(
        f"the model's per-row values have {size} rows, but the request has"
        f" {num_prompts} prompt(s): give {num_prompts} (one per"
        f" prompt){per_row}.")
  return tuple(index + [0] * (batch - rows))


def rows_to_batch(model, batch_axis: str, index,
                  lineage: Lineage | None = None):
  """The model with every array over ``batch_axis`` gathered to the decode
  rows (``index``: entry of each row), so the compiled programs see the
  same shapes for every request of one batch bucket. The gathers are
  recorded in ``lineage``."""
  index = np.asarray(index, np.int32)

  def gather(x):
    ordered = x.order_as(batch_axis, *(a for a in x.named_shape
                                       if a != batch_axis))
    axes = dict(ordered.named_axes, **{batch_axis: len(index)})
    return pz.nx.NamedArray(
        named_axes=collections.OrderedDict(axes),
        data_array=jnp.take(ordered.data_array, index,
                            axis=len(ordered.positional_shape)))

  def gather_recorded(x):
    out = gather(x)
    if lineage is not None:
      lineage.record_named(out, x, gather)
    return out

  return (pz.select(model).at_instances_of(pz.nx.NamedArrayBase)
          .where(lambda x: batch_axis in x.named_shape)
          .apply(gather_recorded))


@dataclasses.dataclass(frozen=True)
class PreparedModel:
  """A model ready for the compiled programs.

  Attributes:
    model_leaves: Arrays of the stateless model (weights first of all).
    treedef: Its pytree structure (static in the programs).
    layout: The layout of its state.
    state_args: The non-constant leaves of its initial state.
    captures: Where captured points' values are kept in the state.
    blocks: The transformer blocks the programs run one after the other (a
      layer stack counts once), for `engine.default_compiler_options`.
    parameters: The model's array elements, for the same.
    cpu_sampler: Whether the decode loop asks the CPU kernel to pick tokens
      (`penzai_lm.kernels.ops.sample`; see `sampling.sample_next`): the
      model is on one CPU device and the kernels are available.
    prefill: The model with its layer stacks, prepared the same way, that
      fresh prompts are prefilled on (`stacked_prefill.py`); None: they are
      prefilled on this model.
    state_order: For a model with layer stacks, where each state variable
      of its unstacked form comes from (`unstacked_state_order`).
    unstacked_layout: For a model with layer stacks that prompts are
      prefilled on: the layout of the state its prefill hands the decode
      loop (its state split into the unstacked model's variables, as a list
      of values; `stacked_prefill.prefill_model`).
  """

  model_leaves: list
  treedef: Any
  layout: StateLayout
  state_args: list
  captures: tuple[CaptureSpec, ...] = ()
  blocks: int = 0
  parameters: int = 0
  cpu_sampler: bool = False
  prefill: "PreparedModel | None" = None
  state_order: tuple[StateSlice, ...] | None = None
  unstacked_layout: StateLayout | None = None

  def arrays(self) -> list:
    """The arrays of the stateless model and of its `prefill` model's (the
    ones a variant's recipes index; `penzai_lm.runtime.derived`)."""
    if self.prefill is None:
      return list(self.model_leaves)
    return list(self.model_leaves) + list(self.prefill.model_leaves)

  def with_arrays(self, new: list) -> "PreparedModel":
    """This model with `arrays` replaced by ``new``."""
    n = len(self.model_leaves)
    prefill = self.prefill
    if prefill is not None:
      prefill = dataclasses.replace(prefill, model_leaves=list(new[n:]))
    return dataclasses.replace(self, model_leaves=list(new[:n]),
                               prefill=prefill)


def _constant_fill(x):
  """The value of a constant array (all elements equal), else None.

  Arrays on one CPU device are read in place with numpy: eager ``jnp``
  would compile two small programs per shape.
  """
  view = host_view(x)
  xp, x = (np, view) if view is not None else (jnp, jnp.asarray(x))
  if x.size == 0:
    return None
  first = x.reshape(-1)[0]
  if bool(xp.all(x == first)):
    return first.item()
  return None


def _carried_state(state0, user_labels, example_call):
  """The initial state in the shapes the decode loop carries.

  A patch's state variable may take its shape from the call that sets it
  (penzai's ``SaveIntermediate`` starts as None and holds the last value it
  saw). Such a variable (one whose value after a decode step,
  ``example_call(state)``, differs in structure or shape from its value
  now) starts as zeros of its decode-step shape; the others keep their
  values. Only the user's variables (``user_labels``) can be such.
  """
  if not user_labels:
    return state0
  after = example_call(state0)
  out = []
  for v, new in zip(state0, after):
    if v.label in user_labels and not _same_shapes(v.value, new.value):
      v = dataclasses.replace(v, value=jax.tree_util.tree_map(
          lambda s: jnp.zeros(s.shape, s.dtype), new.value))
    out.append(v)
  return out


def _same_shapes(value, struct) -> bool:
  leaves, structs = (jax.tree_util.tree_leaves(value),
                     jax.tree_util.tree_leaves(struct))
  return (jax.tree_util.tree_structure(value) == jax.tree_util.tree_structure(
      struct) and all(np.shape(a) == tuple(b.shape) and np.dtype(
          a.dtype) == b.dtype for a, b in zip(leaves, structs)))


def _example_call(stateless, cached: bool, batch_axis: str, batch: int,
                  cache_len: int):
  """``fn(state)``: the shapes of the state after one decode step."""
  seq = 1 if cached else cache_len
  # Host zeros: eager jnp.zeros would compile a program per shape.
  tokens = pz.nx.wrap(jax.device_put(np.zeros((batch, seq), np.int32))).tag(
      batch_axis, "seq")
  if cached:
    side = dict(is_padding=pz.nx.wrap(jax.device_put(
        np.zeros((batch, 1), bool))).tag(batch_axis, "seq"))
  else:
    side = dict(token_positions=pz.nx.wrap(jax.device_put(np.zeros(
        (batch, cache_len), np.int32))).tag(batch_axis, "seq"))
  call = lambda state, tokens, side: list(  # noqa: E731
      stateless_call(stateless, state, tokens, **side)[1])
  # Inputs as arguments: traced, so the model's eager id checks stay off.
  return lambda state: jax.eval_shape(call, state, tokens, side)


def _prepare_runnable(runnable, user_labels, batch_axis, batch,
                      cache_len) -> PreparedModel:
  stateless, state0 = pz.unbind_state_vars(_frozen_params(runnable),
                                           freeze=True)
  cached = isinstance(runnable, KVCachingTransformerLM)
  state0 = _carried_state(list(state0), user_labels, _example_call(
      stateless, cached, batch_axis, batch, cache_len))
  model_leaves, treedef = jax.tree_util.tree_flatten(stateless)
  state_leaves, state_treedef = jax.tree_util.tree_flatten(list(state0))
  specs, args, which = [], [], []
  for i, x in enumerate(state_leaves):
    fill = _constant_fill(x) if hasattr(x, "shape") else None
    specs.append(LeafSpec(tuple(np.shape(x)), np.dtype(x.dtype), fill))
    if fill is None:
      args.append(x)
      which.append(i)
  placement = placement_of(stateless, list(state0))
  if placement is not None:
    args = placement.put(args, which)
  labels = None
  if cached:
    labels = runnable.layout.labels
  layout = StateLayout(state_treedef, tuple(specs), labels,
                       frozenset(user_labels), placement)
  stacked = pz.select(runnable).at_instances_of(pz.nn.LayerStack).count()
  return PreparedModel(model_leaves, treedef, layout, args,
                       blocks=count_blocks(stateless),
                       parameters=count_parameters(model_leaves),
                       state_order=(unstacked_state_order(runnable)
                                    if stacked else None))


def _frozen_params(model):
  """``pz.freeze_params(model)``, skipped when no parameter is mutable (as
  `penzai_lm.load` returns models): its selection rebuilds the whole tree,
  where one flatten tells whether there is any."""
  if any(isinstance(x, pz.Parameter) for x in jax.tree_util.tree_leaves(model)):
    return pz.freeze_params(model)
  return model


# `Engine(prompt_attention=...)` values.
PROMPT_ATTENTION = ("auto", "cudnn", "xla", None)


def check_prompt_attention(prompt_attention: str | None, model) -> None:
  """Refuses ``prompt_attention="cudnn"`` for a model not on GPUs (checked
  with the request, before anything is prepared).

  Raises:
    ValueError: saying which values work.
  """
  if prompt_attention == "cudnn" and not on_gpus(model):
    raise ValueError(
        'prompt_attention="cudnn" (cuDNN flash attention) needs a model on'
        ' GPUs; this one is not. Use "auto", "xla" or None.')


def prepare_model(model, *, cached_model: bool, use_cache: bool,
                  batch_axis: str, batch: int, cache_len: int,
                  decoded=None, capture: tuple[Point, ...] = (),
                  prompt_attention: str | None = "auto") -> PreparedModel:
  """Converts (cached mode, no overflow callback), freezes and flattens a
  model for a batch and cache size.

  Args:
    model: The user's model.
    cached_model: Whether it is a `KVCachingTransformerLM` already.
    use_cache: Decode with a KV cache (else the uncached model is used).
    batch_axis: Name of the batch axis.
    batch: Rows of the cache to build.
    cache_len: Slots of the cache to build.
    decoded: The model to decode with, if not ``model`` itself: with its
      layer stacks unstacked (`unstack_layers`) and/or its per-row values
      gathered to the decode rows (`rows_to_batch`).
    capture: Points to record for every token: `Capture` layers with a
      per-slot buffer (like a KV cache) are inserted after them.
    prompt_attention: See `Engine.prompt_attention` ("cudnn" checked by
      `check_prompt_attention` before).
  """
  _check_bound(model)
  decoded = model if decoded is None else decoded
  user_labels = _user_labels(decoded)
  one_cpu = on_one_cpu(decoded)
  if prompt_attention == "auto":
    prompt_attention = "cudnn" if on_one_gpu(decoded) else None
  specs = ()
  if capture:
    decoded, captures = insert_captures(
        decoded, capture, {batch_axis: batch, "seq": cache_len},
        label_prefix="engine_capture")
    specs = tuple(spec for _, spec in captures.values())
  if cached_model:
    runnable = _without_overflow_callback(decoded)
  elif use_cache:
    runnable = _without_overflow_callback(
        KVCachingTransformerLM.from_uncached(
            decoded, cache_len, {batch_axis: batch}))
  else:
    runnable = decoded
  if prompt_attention is not None:
    # Before the CPU kernels, which then keep these layers (their decode
    # steps run penzai's chain).
    runnable = with_fused_prompt_attention(runnable, prompt_attention)
  if one_cpu:
    # Small products and decode attention on compiled kernels (XLA:CPU
    # copies bf16/f16 weights to float32 before every dot, and runs
    # attention as ~10 small ops over the whole cache).
    runnable = with_cpu_kernels(runnable)
  # Blocks of one structure are traced once per program, not once each.
  runnable = share_block_traces(runnable)
  prepared = _prepare_runnable(runnable, user_labels, batch_axis, batch,
                               cache_len)
  return dataclasses.replace(prepared, captures=specs,
                             cpu_sampler=one_cpu and kernel_ops.available())


def _user_labels(model) -> list:
  """Labels of a model's own state variables: those of its patches, not the
  caches and bookkeeping of a `KVCachingTransformerLM`."""
  caches = set()
  if isinstance(model, KVCachingTransformerLM):
    caches = {model.cache_end_index.label, model.kv_positions.label,
              model.previous_tokens.label}
    caches |= {layer.kv_cache.label for layer in pz.select(model)
               .at_instances_of(pz.nn.KVCachingAttention).get_sequence()}
  return [v.label for v in pz.unbind_state_vars(model)[1]
          if v.label not in caches]


def _check_bound(model) -> None:
  unbound = pz.select(model).at_instances_of(pz.ParameterSlot).count()
  if unbound:
    raise ValueError(
        f"the model has {unbound} unbound parameter slot(s); load weights"
        " (pz.bind_variables) or build it with a seed before generating.")


def _without_overflow_callback(cached):
  """The loop never overflows the cache by construction (it stops at
  ``cache_full``), so the model's run-time overflow check (a host callback,
  which keeps programs out of JAX's persistent cache) is turned off where
  the model supports it."""
  names = {f.name for f in dataclasses.fields(cached)}
  if "runtime_overflow_check" in names and cached.runtime_overflow_check:
    return dataclasses.replace(cached, runtime_overflow_check=False)
  return cached
