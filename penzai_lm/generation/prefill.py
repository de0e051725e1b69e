"""The prefill program: the prompts written to the cache, and the decode
loop's first `LoopState`.

`prefill_program` writes the prompt columns to the cache with
``stateless_call`` and an explicit ``is_padding`` mask. Where
``PrefillShape.emits_first`` (cached decoding without captures) it writes
all ``P`` columns and picks every row's first token as a loop iteration
would (`programs.pick`), from the last column's logits: the model's value
is cut to that column right after its ``final_norm`` hook point, so only
one column is projected to the vocabulary. Otherwise it writes the first
``P - 1`` columns (the logits are unused, so XLA drops the output
projection) and the loop's first iteration feeds the last one.

With ``num_samples > 1`` the prefill runs once per prompt at the prompt
batch and the resulting state (caches, positions and any patch state with
the batch axis) is gathered to the decode rows. Where the engine prefills
over the layer stacks (`Engine.prefill_over_stacks`), a fresh prompt runs
on the stacked model (one block compiled and scanned, `stacked_prefill.py`)
and its caches are split into the decode model's per-layer ones. With
``use_cache=False`` it builds the recomputing loop's token buffer instead.

Like the decode program it takes the weights as arguments (never
constants) and a static tuple; see `penzai_lm.runtime.program_cache`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm import sampling
from penzai_lm.generation import programs
from penzai_lm.generation.shapes import PrefillShape
from penzai_lm.generation.state import DecodeInputs
from penzai_lm.generation.state import LoopState
from penzai_lm.generation.state import Outputs
from penzai_lm.generation.state import PADDING_ROW
from penzai_lm.generation.state import RecomputeState
from penzai_lm.generation.state import RUNNING
from penzai_lm.generation.state import StateLayout
from penzai_lm.model.cache_layout import CacheLayout
from penzai_lm.model.hooks import HookPoint
from penzai_lm.model.stateless import stateless_call
from penzai_lm.runtime.placement import constrain


def _map_batch_arrays(tree, axis: str, fn):
  """Applies ``fn`` (on the batch-leading data) to NamedArrays with ``axis``."""

  def apply(x):
    if isinstance(x, pz.nx.NamedArrayBase) and axis in x.named_shape:
      return pz.nx.nmap(fn)(x.untag(axis)).tag(axis)
    return x

  return jax.tree_util.tree_map(apply, tree, is_leaf=pz.nx.is_namedarray)


def _first_row_of(src, rows: int):
  """For each of ``rows`` prefill rows, a decode row gathered from it."""
  return jnp.argmax(src[None, :] == jnp.arange(rows)[:, None], axis=1)


def _continued_state(layout: StateLayout, state_args, start):
  """A previous turn's state (grown to this cache), cut at slot ``start``.

  Slots from ``start`` on are discarded: the cache end index goes back to
  ``start`` and their positions to -1, so no token attends to them and the
  next tokens overwrite them.
  """
  state = layout.unflatten(state_args)
  values = {v.label: v.value for v in state}
  labels = layout.labels
  end, positions = CacheLayout.cut(values[labels.end],
                                   values[labels.positions], start)
  cut = {labels.end: end, labels.positions: positions}
  return [dataclasses.replace(v, value=cut[v.label]) if v.label in cut
          else v for v in state]


def _history(state, labels, axis):
  """(tokens, mask) of everything in the cache, for the sampler's penalties."""
  values = {v.label: v.value for v in state}
  return CacheLayout.history(values[labels.tokens],
                             values[labels.positions], axis)


@pz.pytree_dataclass
class _LastColumn(pz.nn.Layer):
  """Keeps the last column of ``seq`` (left-padded prompts end there)."""

  def __call__(self, x, /, **_side_inputs):
    return x[{"seq": pz.slice[-1:]}]


def _logits_of_last_column(model):
  """``model`` projecting only the last column to the vocabulary: cut
  right after its ``final_norm`` hook point (after every intervention at
  that point). A model without one projects every column."""
  final = (pz.select(model).at_instances_of(HookPoint)
           .where(lambda h: type(h) is HookPoint and h.point == "final_norm"))
  if final.count() != 1:
    return model
  return final.apply(lambda h: pz.nn.Sequential([h, _LastColumn()]))


def _prefill_cache(shape: PrefillShape, model, state0, tokens, padding, src,
                   gen_start):
  """Writes the prompts to the cache (all ``P`` columns where
  ``shape.emits_first``, else all but the last); returns ``(logits, state)``:
  each decode row's (B, V) float32 logits of the last column (None without
  ``emits_first``) and its state.

  With ``gather`` the prefill runs one row per prompt: the model's per-row
  values (`penzai_lm.generation.prepare.rows_to_batch`, laid out per decode
  row) are taken from a decode row of each prompt.
  """
  axis = shape.decode.batch_axis
  columns = shape.prompt_len if shape.emits_first else shape.prompt_len - 1
  if shape.gather:
    first = _first_row_of(src, shape.batch)
    model = _map_batch_arrays(
        dataclasses.replace(model, batch_axes={axis: shape.batch}), axis,
        lambda a: a[first])
    state = _map_batch_arrays(state0, axis, lambda a: a[:shape.batch])
  else:
    state = state0
  if shape.emits_first:
    model = _logits_of_last_column(model)
  logits = None
  if columns:
    out, state = stateless_call(
        model, state, programs.named_tokens(tokens[:, :columns], axis),
        is_padding=programs.named_tokens(padding[:, :columns], axis),
        **programs.side_inputs(gen_start, axis))
    state = list(state)
    if shape.emits_first:
      logits = out.unwrap(axis, "seq", "vocabulary")[:, -1].astype(
          jnp.float32)
  if shape.gather:
    state = _map_batch_arrays(state, axis, lambda a: a[src])
    logits = None if logits is None else logits[src]
  return logits, state


def _recompute_state(shape: PrefillShape, state0, tokens, padding):
  """The ``use_cache=False`` loop's initial model state."""
  B, C, P = shape.decode.batch, shape.decode.cache_len, shape.prompt_len
  buf = jnp.zeros((B, C), jnp.int32).at[:, :P - 1].set(tokens[:, :P - 1])
  real_cols = ~padding[:, :P - 1]
  count = jnp.cumsum(real_cols, axis=1, dtype=jnp.int32)
  pos = jnp.full((B, C), -1, jnp.int32).at[:, :P - 1].set(
      jnp.where(real_cols, count - 1, -1))
  return RecomputeState(tokens=buf, positions=pos, state=state0)


def prefill_program(static, model_leaves, state_args, tokens, padding, src,
                    real, start, inputs: DecodeInputs) -> LoopState:
  """Prefill program: returns the initial decode-loop state (after the
  first iteration where ``shape.emits_first``).

  Args:
    static: ``(PrefillShape, treedef, StateLayout, stacked)``: the decode
      model's structure and state layout (None, None with ``stacked``),
      and ``stacked``, a `stacked_prefill.StackedPrefill` (the prompt then
      runs on the model with its layer stacks, whose state it hands over
      in the decode model's layout) or None (on the decode model itself).
    model_leaves: The arrays of the stateless model the prompt runs on.
    state_args: Its non-constant initial state leaves (all leaves of a
      continued state).
    tokens, padding: (prefill rows, P) left-padded prompts and their mask.
    src: (B,) prefill row of each decode row.
    real: (B,) whether each decode row belongs to the request.
    start: The first cache slot of this prompt: 0, or where a continuation
      appends to the previous state.
    inputs: The first decode call's host inputs (``stop_at`` 1), which
      the first token is picked with where ``shape.emits_first``.
  """
  shape, treedef, layout, stacked = static
  decode = shape.decode
  if stacked is not None:
    treedef, run_layout = stacked.treedef, stacked.layout
  else:
    run_layout = layout
  model = jax.tree_util.tree_unflatten(treedef, model_leaves)
  if shape.continued:
    state0 = _continued_state(run_layout, state_args, start)
  else:
    state0 = run_layout.initial(state_args)
  P = shape.prompt_len
  dtokens, dpadding = (tokens[src], padding[src]) if shape.gather else (
      tokens, padding)
  # Each prefill row's first generated position: its real prompt tokens
  # plus a continued session's history.
  gen_start = jnp.sum(~padding, axis=1, dtype=jnp.int32)
  if shape.continued:
    history, history_mask = _history(state0, run_layout.labels,
                                     decode.batch_axis)
    del history
    gen_start += jnp.sum(history_mask, axis=1, dtype=jnp.int32)
  logits = None
  if decode.use_cache:
    logits, state = _prefill_cache(shape, model, state0, tokens, padding, src,
                                   gen_start)
    if stacked is not None:
      model_state = stacked.carry(state)
    else:
      state = layout.conform(state)
      model_state = layout.pack(state)
  else:
    model_state = _recompute_state(shape, state0, dtokens, dpadding)
  if shape.continued:
    # Penalties see the whole conversation, not just the new tokens.
    seen, seen_mask = _history(state, layout.labels, decode.batch_axis)
    seen = jnp.concatenate([seen, dtokens[:, P - 1:]], axis=1)
    seen_mask = jnp.concatenate([seen_mask, ~dpadding[:, P - 1:]], axis=1)
  else:
    seen, seen_mask = dtokens, ~dpadding
  B = decode.batch
  zeros = jnp.zeros((B,), jnp.int32)
  c = LoopState(
      model_state=model_state,
      slots=jnp.asarray(start + P - 1, jnp.int32),
      next_token=dtokens[:, P - 1],
      feed=real,
      step=zeros,
      reason=jnp.where(real, RUNNING, PADDING_ROW).astype(jnp.int32),
      waiting=jnp.zeros((B,), bool),
      q_pos=zeros,
      t=jnp.asarray(0, jnp.int32),
      gen_start=gen_start[src] if shape.gather else gen_start,
      tail=jnp.zeros((B,), bool),
      sampler=sampling.init_sampler_state(seen, seen_mask,
                                          vocab_size=decode.vocab),
      out=Outputs.empty(B, decode.cache_len, decode.top_n),
  )
  if logits is not None:
    # The loop's first iteration: its condition holds (every planned cache
    # has a slot after the prompt, and ``stop_at`` is 1).
    c = programs.pick(decode, inputs, c, logits)
  return constrain(None if layout is None else layout.placement, c)


