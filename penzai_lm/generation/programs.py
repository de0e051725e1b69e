"""The engine's two compiled programs: prefill and the decode loop.

1. **Prefill** (`prefill_program`): writes the prompt columns to the cache
   with ``stateless_call`` and an explicit ``is_padding`` mask, and returns
   the decode loop's `LoopState`. Where ``PrefillShape.emits_first``
   (cached decoding without captures) it writes all ``P`` columns and
   picks every row's first token as a loop iteration would (`_pick`), from
   the last column's logits: the model's value is cut to that column right
   after its ``final_norm`` hook point, so only one column is projected to
   the vocabulary. Otherwise it writes the first ``P - 1`` columns (the
   logits are unused, so XLA drops the output projection) and the loop's
   first iteration feeds the last one. With
   ``num_samples > 1`` the prefill runs once per prompt at the prompt batch
   and the resulting state (caches, positions and any patch state with the
   batch axis) is gathered to the decode rows. Where the engine prefills
   over the layer stacks (`Engine.prefill_over_stacks`), a fresh prompt
   runs on the stacked model (one block compiled and scanned,
   `stacked_prefill.py`) and its caches are split into the
   decode model's per-layer ones.
2. **Decode loop** (`decode_program`, a `jax.lax.while_loop`): each
   iteration feeds every row's pending token (the last prompt token first)
   through the functional cached model, then picks each row's next token:
   the head of the row's forced-token queue if any, else
   `penzai_lm.sampling.sample_next` with the row's own seed and step (so a
   row never depends on its batch slot or its neighbours; on one CPU
   device, in one call of its kernel: ``DecodeShape.cpu_sampler``).
   Tokens, log-probs, top-n alternatives and a forced flag are recorded
   per row. A row finishes on a stop token (``stop``), at its
   ``max_new_tokens`` (``length``), or when the cache has no free slot
   (``cache_full``); finished rows feed
   padding from then on, which no row attends to. The loop exits as soon as
   no row needs another token, when a row waits for the host (a tool call
   marker, or its forced queue continues on the host), or when ``t`` reaches
   ``stop_at`` -- which is how streaming runs the same program in chunks of
   k steps, keeping the state on device between chunks.

With ``use_cache=False`` the same loop recomputes the whole sequence with the
uncached model at every step (a reference for the cached path).

Both programs take the weights as arguments (never constants) and a static
``(shape, treedef, layout)`` triple; see `penzai_lm.runtime.program_cache`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm import sampling
from penzai_lm.generation.shapes import DecodeShape
from penzai_lm.generation.shapes import PrefillShape
from penzai_lm.generation.state import CACHE_FULL
from penzai_lm.generation.state import DecodeInputs
from penzai_lm.generation.state import LENGTH
from penzai_lm.generation.state import LoopState
from penzai_lm.generation.state import NON_FINITE
from penzai_lm.generation.state import Outputs
from penzai_lm.generation.state import PADDING_ROW
from penzai_lm.generation.state import RecomputeState
from penzai_lm.generation.state import RUNNING
from penzai_lm.generation.state import StateLayout
from penzai_lm.generation.state import STOP
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


def _named(x, axis):
  return pz.nx.wrap(x).tag(axis, "seq")


def _side(gen_start, axis) -> dict:
  """Side inputs the engine adds to every model call: each row's
  ``generation_start`` (the position of its first generated token), which
  interventions' token rules read (`penzai_lm.interp.TokenRule`)."""
  return dict(generation_start=pz.nx.wrap(gen_start).tag(axis))


def _first_row_of(src, rows: int):
  """For each of ``rows`` prefill rows, a decode row gathered from it."""
  return jnp.argmax(src[None, :] == jnp.arange(rows)[:, None], axis=1)


def _logprob_of(logits, token):
  picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


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
        model, state, _named(tokens[:, :columns], axis),
        is_padding=_named(padding[:, :columns], axis),
        **_side(gen_start, axis))
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
      model's structure and state layout, and ``stacked``, a
      `stacked_prefill.StackedPrefill` (the prompt then runs on the model
      with its layer stacks, whose state is handed to the decode model's
      layout) or None (on the decode model itself).
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
      state = stacked.unstacked(state, layout)
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
    c = _pick(decode, inputs, c, logits)
  return constrain(layout.placement, c)


def _feed_fn(shape: DecodeShape, model, layout: StateLayout):
  """feed(model_state, slots, token, mask, gen_start) -> (logits (B, V)
  f32, state)."""
  axis = shape.batch_axis

  def feed_cached(packed, slots, token, mask, gen_start):
    del slots
    state = layout.unpack(packed)
    logits, new = stateless_call(
        model, state, _named(token[:, None], axis),
        is_padding=_named(~mask[:, None], axis), **_side(gen_start, axis))
    logits = logits.unwrap(axis, "seq", "vocabulary")[:, 0]
    new = pz.nx.order_like(list(new), state)
    return logits.astype(jnp.float32), layout.pack(new)

  def feed_recompute(s: RecomputeState, slots, token, mask, gen_start):
    tokens = jax.lax.dynamic_update_slice(s.tokens, token[:, None],
                                          (0, slots))
    next_pos = jnp.max(s.positions, axis=1) + 1
    positions = jax.lax.dynamic_update_slice(
        s.positions, jnp.where(mask, next_pos, -1)[:, None], (0, slots))
    logits, state = stateless_call(
        model, s.state, _named(tokens, axis),
        token_positions=_named(positions, axis), **_side(gen_start, axis))
    logits = logits.unwrap(axis, "seq", "vocabulary")
    logits = jax.lax.dynamic_index_in_dim(logits, slots, 1, keepdims=False)
    new = RecomputeState(tokens, positions,
                         pz.nx.order_like(list(state), s.state))
    return logits.astype(jnp.float32), new

  return feed_cached if shape.use_cache else feed_recompute


def _apply_host_control(c: LoopState, x: DecodeInputs) -> LoopState:
  """Ends rows the host ended (stop strings, cancellation) and resumes
  paused rows."""
  end = x.end_rows & (c.reason == RUNNING)
  waiting = c.waiting & ~end
  resumed = x.resume & waiting
  return dataclasses.replace(
      c, reason=jnp.where(end, x.end_reason, c.reason),
      feed=(c.feed & ~end) | resumed, waiting=waiting & ~resumed,
      q_pos=jnp.zeros_like(c.q_pos))


def _early_stop_bans(x: DecodeInputs, step, vocab: int) -> jax.Array:
  """bool (B, vocab): each row's stop ids while it has generated fewer than
  ``min_new`` tokens (a traced value: no program per setting)."""
  early = (step < x.min_new)[:, None] & (x.stop_ids >= 0)
  ids = jnp.where(early, x.stop_ids, vocab)  # `vocab`: dropped.
  rows = jnp.arange(ids.shape[0])[:, None]
  return jnp.zeros((ids.shape[0], vocab), bool).at[rows, ids].set(
      True, mode="drop")


def _loop_step(shape: DecodeShape, feed_model, x: DecodeInputs,
               c: LoopState) -> LoopState:
  """One iteration: feed every active row's token, pick the next ones.

  With captures, a row that just finished feeds its last token once more
  (``tail``), so its activations are recorded; nothing else of that
  iteration is kept for it.
  """
  logits, model_state = feed_model(c.model_state, c.slots, c.next_token,
                                   c.feed | c.tail, c.gen_start)
  return _pick(shape, x, dataclasses.replace(c, model_state=model_state),
               logits)


def _pick(shape: DecodeShape, x: DecodeInputs, c: LoopState,
          logits) -> LoopState:
  """The rest of an iteration, once ``c.next_token`` was fed (its state in
  ``c.model_state``) and gave ``logits`` (B, V) float32: picks each row's
  next token and advances the loop state by one step."""
  Q, T = shape.queue_len, shape.cache_len
  # NaN or +inf logits (broken weights, an overflowing intervention) end
  # the row rather than being sampled from (-inf is a legitimate ban).
  broken = c.feed & jnp.any(jnp.isnan(logits) | (logits == jnp.inf),
                            axis=-1)
  active = c.feed & ~broken
  sampled, logprob = sampling.sample_next(
      logits, x.settings, c.sampler, c.step,
      extra_bans=_early_stop_bans(x, c.step, logits.shape[-1]),
      kernel=shape.cpu_sampler)
  queued = jnp.take_along_axis(
      x.q_tokens, jnp.minimum(c.q_pos, Q - 1)[:, None], axis=1)[:, 0]
  forced = active & (c.q_pos < x.q_len)
  token = jnp.where(forced, queued, sampled)
  logprob = jax.lax.cond(
      jnp.any(forced),
      lambda: jnp.where(forced, _logprob_of(logits, token), logprob),
      lambda: logprob)
  q_pos = c.q_pos + forced.astype(jnp.int32)
  top = sampling.top_logprobs(logits, shape.top_n) if shape.top_n else None
  out = c.out.write(jnp.where(active, c.step, T), token, logprob, forced, top)
  step = c.step + active.astype(jnp.int32)

  is_stop = active & jnp.any(token[:, None] == x.stop_ids, axis=1)
  is_len = active & (step >= x.max_new)
  going = active & ~is_stop & ~is_len
  # Pause for the host: a tool-call end marker was sampled, or the forced
  # queue ran out while the host holds more forced tokens for the row.
  pause = going & ((~forced & (token == x.pause_id))
                   | (forced & (q_pos >= x.q_len) & x.q_more))
  return LoopState(
      model_state=c.model_state,
      slots=c.slots + 1,
      next_token=jnp.where(active, token, c.next_token),
      feed=going & ~pause,
      step=step,
      reason=jnp.where(is_stop, STOP, jnp.where(
          is_len, LENGTH, jnp.where(broken, NON_FINITE, c.reason))),
      waiting=c.waiting | pause,
      q_pos=q_pos,
      t=c.t + 1,
      gen_start=c.gen_start,
      tail=(is_stop | is_len) if shape.capture else c.tail,
      sampler=sampling.update_sampler_state(c.sampler, token, active),
      out=out,
  )


def decode_program(static, model_leaves, carry: LoopState,
                   inputs: DecodeInputs) -> LoopState:
  """Decode program: runs the loop until done, paused or ``t == stop_at``.

  Args:
    static: ``(DecodeShape, treedef, StateLayout)``.
    model_leaves: The stateless model's arrays.
    carry: The loop state (donated: updated in place).
    inputs: This call's host inputs.
  """
  shape, treedef, layout = static
  model = jax.tree_util.tree_unflatten(treedef, model_leaves)
  feed_model = _feed_fn(shape, model, layout)

  def cond(c: LoopState):
    return ((c.t < inputs.stop_at) & jnp.any(c.feed | c.tail)
            & ~jnp.any(c.waiting) & (c.slots < shape.cache_len))

  c = _apply_host_control(carry, inputs)
  c = jax.lax.while_loop(
      cond, lambda c: _loop_step(shape, feed_model, inputs, c), c)
  full = c.feed & (c.slots >= shape.cache_len)
  return constrain(layout.placement, dataclasses.replace(
      c, reason=jnp.where(full, CACHE_FULL, c.reason), feed=c.feed & ~full,
      tail=c.tail & (c.slots < shape.cache_len)))
