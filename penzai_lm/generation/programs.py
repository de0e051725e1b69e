"""The decode loop program, and the pick of each row's next token.

**Decode loop** (`decode_program`, a `jax.lax.while_loop`): each
iteration feeds every row's pending token (the last prompt token first,
unless the prefill picked the first tokens: `prefill.py`) through the
functional cached model, then picks each row's next token (`pick`): the
head of the row's forced-token queue if any, else
`penzai_lm.sampling.sample_next` with the row's own seed and step (so a
row never depends on its batch slot or its neighbours; on one CPU device,
in one call of its kernel: ``DecodeShape.cpu_sampler``). Tokens, log-probs,
top-n alternatives and a forced flag are recorded per row. A row finishes
on a stop token (``stop``), at its ``max_new_tokens`` (``length``), or when
the cache has no free slot (``cache_full``); finished rows feed padding
from then on, which no row attends to. The loop exits as soon as no row
needs another token, when a row waits for the host (a tool call marker, or
its forced queue continues on the host), or when ``t`` reaches ``stop_at``
-- which is how streaming runs the same program in chunks of k steps,
keeping the state on device between chunks.

With ``use_cache=False`` the same loop recomputes the whole sequence with the
uncached model at every step (a reference for the cached path).

The program takes the weights as arguments (never constants) and a static
``(shape, treedef, layout)`` triple; see `penzai_lm.runtime.program_cache`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm import sampling
from penzai_lm.generation.shapes import DecodeShape
from penzai_lm.generation.state import CACHE_FULL
from penzai_lm.generation.state import DecodeInputs
from penzai_lm.generation.state import LENGTH
from penzai_lm.generation.state import LoopState
from penzai_lm.generation.state import NON_FINITE
from penzai_lm.generation.state import RecomputeState
from penzai_lm.generation.state import RUNNING
from penzai_lm.generation.state import StateLayout
from penzai_lm.generation.state import STOP
from penzai_lm.model.stateless import stateless_call
from penzai_lm.runtime.placement import constrain


def named_tokens(x, axis):
  """(rows, columns) ids as a NamedArray over ``(axis, "seq")``."""
  return pz.nx.wrap(x).tag(axis, "seq")


def side_inputs(gen_start, axis) -> dict:
  """Side inputs the engine adds to every model call: each row's
  ``generation_start`` (the position of its first generated token), which
  interventions' token rules read (`penzai_lm.interp.TokenRule`)."""
  return dict(generation_start=pz.nx.wrap(gen_start).tag(axis))


def _logprob_of(logits, token):
  picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def _feed_fn(shape: DecodeShape, model, layout: StateLayout):
  """feed(model_state, slots, token, mask, gen_start) -> (logits (B, V)
  f32, state)."""
  axis = shape.batch_axis

  def feed_cached(packed, slots, token, mask, gen_start):
    del slots
    state = layout.unpack(packed)
    logits, new = stateless_call(
        model, state, named_tokens(token[:, None], axis),
        is_padding=named_tokens(~mask[:, None], axis), **side_inputs(gen_start, axis))
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
        model, s.state, named_tokens(tokens, axis),
        token_positions=named_tokens(positions, axis), **side_inputs(gen_start, axis))
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
  return pick(shape, x, dataclasses.replace(c, model_state=model_state),
               logits)


def pick(shape: DecodeShape, x: DecodeInputs, c: LoopState,
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
