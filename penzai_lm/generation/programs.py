"""The engine's two compiled programs: prefill and the decode loop.

1. **Prefill** (`prefill_program`): writes the first ``P - 1`` prompt
   columns to the cache with ``stateless_call`` and an explicit
   ``is_padding`` mask (the logits are unused, so XLA drops the output
   projection), and returns the decode loop's carry. With ``num_samples >
   1`` the prefill runs once per prompt at the prompt batch and the resulting
   state (caches, positions and any patch state with the batch axis) is
   gathered to the decode rows.
2. **Decode loop** (`decode_program`, a `jax.lax.while_loop`): each
   iteration feeds every row's pending token (the last prompt token first)
   through the functional cached model, then picks each row's next token:
   the head of the row's forced-token queue if any, else
   `penzai_lm.sampling.sample_next` with the row's own seed and step (so a
   row never depends on its batch slot or its neighbours). Tokens, log-probs,
   top-n alternatives and a forced flag are recorded per row. A row finishes
   on a stop token (``stop``), at its ``max_new_tokens`` (``length``), or
   when the cache has no free slot (``cache_full``); finished rows feed
   padding from then on, which no row attends to. The loop exits as soon as
   no row needs another token, when a row waits for the host (a tool call
   marker, or its forced queue continues on the host), or after ``stop_at``
   iterations -- which is how streaming runs the same program in chunks of k
   steps, keeping the state on device between chunks.

With ``use_cache=False`` the same loop recomputes the whole sequence with the
uncached model at every step (a reference for the cached path).

Both programs take the weights as arguments (never constants) and a static
``(plan, treedef, ...)`` tuple; see `penzai_lm.generation.program_cache`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm import sampling

# Row status codes on device.
RUNNING, STOP, LENGTH, CACHE_FULL, CANCELLED, PADDING_ROW = range(6)
REASON_NAMES = {STOP: "stop", LENGTH: "length", CACHE_FULL: "cache_full",
                CANCELLED: "cancelled"}


def _map_batch_arrays(tree, axis: str, fn):
  """Applies ``fn`` (on the batch-leading data) to NamedArrays with ``axis``."""

  def apply(x):
    if isinstance(x, pz.nx.NamedArrayBase) and axis in x.named_shape:
      return pz.nx.nmap(fn)(x.untag(axis)).tag(axis)
    return x

  return jax.tree_util.tree_map(apply, tree, is_leaf=pz.nx.is_namedarray)


def _named(x, axis):
  return pz.nx.wrap(x).tag(axis, "seq")


def _logprob_of(logits, token):
  picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def _initial_state(state_static, state_args):
  state_treedef, spec, _, _ = state_static
  args = iter(state_args)
  leaves = [next(args) if s is None else jnp.full(s[0], s[2], s[1])
            for s in spec]
  return jax.tree_util.tree_unflatten(state_treedef, leaves)


def _continued_state(state_static, state_args, start):
  """A previous run's state (grown to this plan's cache), cut at ``start``.

  Slots from ``start`` on are discarded: the cache end index goes back to
  ``start`` and their positions to -1, so no token attends to them and the
  next tokens overwrite them.
  """
  state_treedef, _, _, labels = state_static
  state = jax.tree_util.tree_unflatten(state_treedef, list(state_args))
  end_label, positions_label, _ = labels
  out = []
  for v in state:
    if v.label == end_label:
      v = dataclasses.replace(v, value=jnp.asarray(start, v.value.dtype))
    elif v.label == positions_label:
      slots = pz.nx.arange("seq", v.value.named_shape["seq"])
      cut = pz.nx.nmap(jnp.where)(slots >= start, -1, v.value)
      v = dataclasses.replace(v, value=pz.nx.order_like(cut, v.value))
    out.append(v)
  return out


def pack_state(state) -> list:
  """The state's arrays without their size-1 dimensions (the loop's carry).

  With a batch of one row, every cache has a size-1 dimension. XLA drops it
  (a bitcast) where attention reads the cache, and then fuses the in-place
  cache write once per differently shaped user, copying the whole cache for
  each (at a 2048-slot cache that made SmolLM2's decode 2x slower). Carrying
  the arrays already squeezed gives every user the same shape.
  """
  return [x.reshape([d for d in x.shape if d != 1])
          for x in jax.tree_util.tree_leaves(state)]


def unpack_state(leaves, state_static):
  """Inverse of `pack_state` (``state_static`` as in `Prepared`)."""
  state_treedef, _, shapes, _ = state_static
  return jax.tree_util.tree_unflatten(
      state_treedef, [x.reshape(s) for x, s in zip(leaves, shapes)])


def _history(mstate, labels, axis):
  """(tokens, mask) of everything in the cache, for the sampler's penalties."""
  values = {v.label: v.value for v in mstate}
  _, positions_label, tokens_label = labels
  tokens = values[tokens_label].unwrap(axis, "seq")
  positions = values[positions_label].unwrap(axis, "seq")
  return tokens, positions >= 0


def prefill_program(static, model_leaves, state_args, tokens, padding, src,
                    real, start):
  """Prefill program: returns the initial decode-loop carry.

  ``start`` is the first cache slot of this prompt: 0, or where a
  continuation (``plan.continued``) appends to the previous state.
  """
  plan, treedef, state_static = static
  model = jax.tree_util.tree_unflatten(treedef, model_leaves)
  if plan.continued:
    state0 = _continued_state(state_static, state_args, start)
  else:
    state0 = _initial_state(state_static, state_args)
  axis, P = plan.batch_axis, plan.prompt_len
  if plan.gather:
    gather = lambda a: a[src]  # noqa: E731
    dtokens, dpadding = tokens[src], padding[src]
  else:
    gather = None
    dtokens, dpadding = tokens, padding
  if plan.use_cache:
    if plan.gather:
      pmodel = dataclasses.replace(
          model, batch_axes={axis: plan.prefill_batch})
      pstate = _map_batch_arrays(
          state0, axis, lambda a: a[:plan.prefill_batch])
    else:
      pmodel, pstate = model, state0
    if P > 1:
      _, pstate = pmodel.stateless_call(
          pstate, _named(tokens[:, :P - 1], axis),
          is_padding=_named(padding[:, :P - 1], axis))
      pstate = list(pstate)
    mstate = _map_batch_arrays(pstate, axis, gather) if gather else pstate
    mstate = pz.nx.order_like(mstate, state0)
  else:
    C = plan.cache_len
    B = plan.batch
    buf = jnp.zeros((B, C), jnp.int32).at[:, :P - 1].set(dtokens[:, :P - 1])
    real_cols = ~dpadding[:, :P - 1]
    count = jnp.cumsum(real_cols, axis=1, dtype=jnp.int32)
    pos = jnp.full((B, C), -1, jnp.int32).at[:, :P - 1].set(
        jnp.where(real_cols, count - 1, -1))
    mstate = dict(tokens=buf, positions=pos, state=state0)

  B, T, V = plan.batch, plan.out_len, plan.vocab
  if plan.continued:
    # Penalties see the whole conversation, not just the new tokens.
    seen, seen_mask = _history(mstate, state_static[3], axis)
    seen = jnp.concatenate([seen, dtokens[:, P - 1:]], axis=1)
    seen_mask = jnp.concatenate([seen_mask, ~dpadding[:, P - 1:]], axis=1)
  else:
    seen, seen_mask = dtokens, ~dpadding
  carry = dict(
      mstate=pack_state(mstate) if plan.use_cache else mstate,
      slots=jnp.asarray(start + P - 1, jnp.int32),
      next_token=dtokens[:, P - 1],
      feed=real,
      step=jnp.zeros((B,), jnp.int32),
      reason=jnp.where(real, RUNNING, PADDING_ROW).astype(jnp.int32),
      waiting=jnp.zeros((B,), bool),
      sampler=sampling.init_sampler_state(seen, seen_mask, vocab_size=V),
      out_tokens=jnp.zeros((B, T), jnp.int32),
      out_logprobs=jnp.zeros((B, T), jnp.float32),
      out_forced=jnp.zeros((B, T), bool),
      q_pos=jnp.zeros((B,), jnp.int32),
      t=jnp.asarray(0, jnp.int32),
  )
  if plan.top_n:
    carry["out_top_logprobs"] = jnp.zeros((B, T, plan.top_n), jnp.float32)
    carry["out_top_ids"] = jnp.zeros((B, T, plan.top_n), jnp.int32)
  return carry


def _feed_fn(plan, model, state_static):
  """Returns feed(mstate, slots, token, mask) -> (logits (B, V) f32, mstate)."""
  axis = plan.batch_axis

  if plan.use_cache:

    def feed(packed, slots, token, mask):
      del slots
      mstate = unpack_state(packed, state_static)
      logits, new = model.stateless_call(
          mstate, _named(token[:, None], axis),
          is_padding=_named(~mask[:, None], axis))
      logits = logits.unwrap(axis, "seq", "vocabulary")[:, 0]
      new = pz.nx.order_like(list(new), mstate)
      return logits.astype(jnp.float32), pack_state(new)

    return feed

  def feed(mstate, slots, token, mask):
    tokens = jax.lax.dynamic_update_slice(
        mstate["tokens"], token[:, None], (0, slots))
    positions = mstate["positions"]
    next_pos = jnp.max(positions, axis=1) + 1
    positions = jax.lax.dynamic_update_slice(
        positions, jnp.where(mask, next_pos, -1)[:, None], (0, slots))
    logits, state = model.stateless_call(
        mstate["state"], _named(tokens, axis),
        token_positions=_named(positions, axis))
    logits = logits.unwrap(axis, "seq", "vocabulary")
    logits = jax.lax.dynamic_index_in_dim(logits, slots, 1, keepdims=False)
    new = dict(tokens=tokens, positions=positions,
               state=pz.nx.order_like(list(state), mstate["state"]))
    return logits.astype(jnp.float32), new

  return feed


def decode_program(static, model_leaves, carry, settings, max_new, stop_ids,
            pause_id, stop_at, end_rows, end_reason, resume, q_tokens, q_len,
            q_more):
  """Decode program: runs the loop until done, paused or ``t == stop_at``."""
  plan, treedef, state_static = static
  model = jax.tree_util.tree_unflatten(treedef, model_leaves)
  feed_model = _feed_fn(plan, model, state_static)
  B, T, Q = plan.batch, plan.out_len, plan.queue_len
  rows = jnp.arange(B)

  # Host control: end rows (stop strings, cancellation), resume paused rows.
  c = dict(carry)
  end = end_rows & (c["reason"] == RUNNING)
  c["reason"] = jnp.where(end, end_reason, c["reason"])
  c["feed"] = c["feed"] & ~end
  c["waiting"] = c["waiting"] & ~end
  resumed = resume & c["waiting"]
  c["feed"] = c["feed"] | resumed
  c["waiting"] = c["waiting"] & ~resumed
  c["q_pos"] = jnp.zeros((B,), jnp.int32)

  def cond(c):
    return ((c["t"] < stop_at) & jnp.any(c["feed"]) & ~jnp.any(c["waiting"])
            & (c["slots"] < plan.cache_len))

  def body(c):
    c = dict(c)
    active = c["feed"]
    logits, c["mstate"] = feed_model(
        c["mstate"], c["slots"], c["next_token"], active)
    c["slots"] = c["slots"] + 1

    sampled, logprob = sampling.sample_next(
        logits, settings, c["sampler"], c["step"])
    has_q = c["q_pos"] < q_len
    queued = jnp.take_along_axis(
        q_tokens, jnp.minimum(c["q_pos"], Q - 1)[:, None], axis=1)[:, 0]
    forced = active & has_q
    token = jnp.where(forced, queued, sampled)
    logprob = jax.lax.cond(
        jnp.any(forced),
        lambda: jnp.where(forced, _logprob_of(logits, token), logprob),
        lambda: logprob)
    c["q_pos"] = c["q_pos"] + forced.astype(jnp.int32)

    index = jnp.where(active, c["step"], T)
    c["out_tokens"] = c["out_tokens"].at[rows, index].set(token, mode="drop")
    c["out_logprobs"] = c["out_logprobs"].at[rows, index].set(
        logprob, mode="drop")
    c["out_forced"] = c["out_forced"].at[rows, index].set(forced, mode="drop")
    if plan.top_n:
      top_lp, top_ids = sampling.top_logprobs(logits, plan.top_n)
      c["out_top_logprobs"] = c["out_top_logprobs"].at[rows, index].set(
          top_lp, mode="drop")
      c["out_top_ids"] = c["out_top_ids"].at[rows, index].set(
          top_ids, mode="drop")
    c["sampler"] = sampling.update_sampler_state(c["sampler"], token, active)
    c["step"] = c["step"] + active.astype(jnp.int32)

    is_stop = active & jnp.any(token[:, None] == stop_ids, axis=1)
    is_len = active & (c["step"] >= max_new)
    c["reason"] = jnp.where(
        is_stop, STOP, jnp.where(is_len, LENGTH, c["reason"]))
    going = active & ~is_stop & ~is_len
    # Pause for the host: a tool-call end marker was sampled, or the forced
    # queue ran out while the host holds more forced tokens for the row.
    pause = going & (
        (~forced & (token == pause_id))
        | (forced & (c["q_pos"] >= q_len) & q_more))
    c["waiting"] = c["waiting"] | pause
    c["feed"] = going & ~pause
    c["next_token"] = jnp.where(active, token, c["next_token"])
    c["t"] = c["t"] + 1
    return c

  c = jax.lax.while_loop(cond, body, c)
  full = c["feed"] & (c["slots"] >= plan.cache_len)
  c["reason"] = jnp.where(full, CACHE_FULL, c["reason"])
  c["feed"] = c["feed"] & ~full
  return c
