"""Logit filters: bias/bans, temperature, top-k, top-p, min-p and XTC.

Array conventions:
  * ``logits`` / ``scaled``: float32 ``(batch, vocab)``; ``-inf`` marks a
    token that can never be sampled.
  * Per-row parameters are ``(batch,)`` arrays (see ``SamplingSettings``).
  * "Candidates" are the ``K`` highest scaled logits of each row, sorted in
    descending order with ties broken towards the lower token id (the order
    ``jax.lax.top_k`` returns): ``vals`` float32 ``(batch, K)`` and ``ids``
    int32 ``(batch, K)``. In this order every filter keeps a prefix.

Semantics (HF ``generate()`` order and definitions):
  * top-k keeps the first ``k`` candidates (exactly ``k``: ties at the
    boundary go to the lower token id, so ``top_k=1`` is greedy).
  * top-p is applied to the top-k-renormalised distribution and keeps
    position ``j`` iff the probability mass of positions ``< j`` is
    ``< top_p`` (the first token is always kept).
  * min-p keeps tokens with ``p >= min_p * p_max``, i.e.
    ``logit >= max_logit + log(min_p)``; renormalising does not change this,
    so it commutes with the mask of the previous filters.
  * XTC (llama.cpp's "exclude top choices", not an HF filter) comes last,
    after the entropy filters (`entropy_filters`): see :func:`xtc_mask`.

All functions are pure ``jnp`` and shape-static: values may change freely
without recompiling. Nothing here sorts the whole vocabulary: top-k uses
``jax.lax.top_k`` with a static candidate count, and the rare top-p rows
whose nucleus does not fit in the candidates use an exact bisection on the
probability threshold (:func:`top_p_keep_mask_full`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Temperatures below this are treated as greedy (dividing by them overflows).
MIN_TEMPERATURE = 1e-5


def apply_bias_and_bans(
    logits: jax.Array,
    logit_bias: jax.Array | None,
    banned_tokens: jax.Array | None,
) -> jax.Array:
  """Adds the dense logit bias, then sets banned tokens to -inf."""
  if logit_bias is not None:
    logits = logits + logit_bias
  if banned_tokens is not None:
    logits = jnp.where(banned_tokens, -jnp.inf, logits)
  return logits


def argmax_first(logits: jax.Array) -> jax.Array:
  """int32 (batch,) argmax per row, ties to the lowest id.

  Same result as ``jnp.argmax(logits, -1)`` but about 5x faster on CPU: a
  plain max-reduce (vectorised) over chunks of ~sqrt(vocab), then two small
  argmaxes (the first chunk holding the maximum, then its first maximum).
  """
  padded, chunk = chunk_rows(logits)
  which = jnp.argmax(jnp.max(padded, axis=-1), axis=-1)
  inside = jnp.take_along_axis(padded, which[:, None, None], axis=1)[:, 0]
  return (which * chunk + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def chunk_shape(vocab: int) -> tuple[int, int]:
  """(num_chunks, chunk): chunk is the power of two >= sqrt(vocab)."""
  chunk = 1 << max(0, math.ceil(math.log2(math.sqrt(vocab))))
  return -(-vocab // chunk), chunk


def chunk_rows(logits: jax.Array) -> tuple[jax.Array, int]:
  """Pads with -inf and reshapes (batch, vocab) to (batch, n, chunk)."""
  batch, vocab = logits.shape
  num_chunks, chunk = chunk_shape(vocab)
  padded = jnp.pad(logits, ((0, 0), (0, num_chunks * chunk - vocab)),
                   constant_values=-jnp.inf)
  return padded.reshape(batch, num_chunks, chunk), chunk


def is_greedy(temperature: jax.Array) -> jax.Array:
  """bool (batch,): rows decoded by argmax (temperature ~ 0)."""
  return temperature < MIN_TEMPERATURE


def scale_by_temperature(logits: jax.Array,
                         temperature: jax.Array) -> jax.Array:
  """Divides each row by its temperature (greedy rows are left unscaled)."""
  safe = jnp.where(is_greedy(temperature), 1.0, temperature)
  return logits / safe[:, None]


def min_p_mask(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
  """bool (batch, vocab): tokens with p >= min_p * p_max (min_p=0 keeps all)."""
  row_max = jnp.max(scaled, axis=-1, keepdims=True)
  return scaled >= row_max + jnp.log(min_p)[:, None]


def top_k_candidates(scaled: jax.Array,
                     num: int) -> tuple[jax.Array, jax.Array]:
  """The ``num`` largest logits per row, descending, ties to lower ids.

  On CPU XLA lowers this to a partial-sort custom call that costs about one
  pass over the vocabulary. The optimization barrier stops XLA from fusing
  later slices of the result into the sort, which would silently turn it back
  into a full sort of the vocabulary (about 100x slower).

  Args:
    scaled: f32 (batch, vocab).
    num: Static number of candidates, <= vocab.

  Returns:
    ``(vals, ids)``, f32 and int32 of shape (batch, num).
  """
  vals, ids = jax.lax.top_k(scaled, num)
  # One barrier per output: a barrier on the (vals, ids) tuple aborts XLA:CPU
  # when the program runs on several devices (a sharded model): its top-k
  # rewrite then finds the barrier, not a get-tuple-element, as the top-k's
  # user.
  return (jax.lax.optimization_barrier(vals),
          jax.lax.optimization_barrier(ids))


def candidate_keep_mask(
    vals: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    log_norm: jax.Array,
    *,
    exhaustive: bool,
) -> tuple[jax.Array, jax.Array]:
  """Applies top-k, top-p and min-p to sorted candidates.

  Args:
    vals: f32 (batch, K) candidate logits, sorted descending.
    top_k: i32 (batch,); 0 = off (values above K are clamped to K).
    top_p: f32 (batch,); 1 = off.
    min_p: f32 (batch,); 0 = off.
    log_norm: f32 (batch,) logsumexp of the full row; used to normalise when
      top-k is off, so that top-p sees full-vocabulary probabilities.
    exhaustive: Static; True if the candidates are the whole vocabulary.

  Returns:
    ``(keep, covered)``: bool (batch, K) mask of kept candidates, and bool
    (batch,) telling whether the exact kept set lies inside the candidates
    (always true with top-k; with top-p alone, true when the candidates hold
    at least ``top_p`` of the mass).
  """
  num = vals.shape[-1]
  pos = jnp.arange(num)
  k_on = top_k > 0
  in_k = ~k_on[:, None] | (pos < top_k[:, None])
  vals_k = jnp.where(in_k, vals, -jnp.inf)
  log_norm = jnp.where(k_on, jax.nn.logsumexp(vals_k, axis=-1), log_norm)
  probs = jnp.exp(vals_k - log_norm[:, None])
  cum = jnp.cumsum(probs, axis=-1)
  mass_before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], -1)
  in_p = (top_p[:, None] >= 1) | (mass_before < top_p[:, None])
  row_max = jnp.max(vals, axis=-1, keepdims=True)
  in_min = vals >= row_max + jnp.log(min_p)[:, None]
  keep = (in_k & in_p & in_min) | (pos == 0)
  covered = k_on | (cum[:, -1] >= top_p) | exhaustive
  return keep, covered


def sortable(x: jax.Array) -> jax.Array:
  """Maps float32 to uint32 so that unsigned order equals float order."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  sign = bits >> 31
  return jnp.where(sign == 1, ~bits, bits | jnp.uint32(0x80000000))


def unsortable(key: jax.Array) -> jax.Array:
  """Inverse of :func:`sortable`."""
  bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def bisect(lo: jax.Array, hi: jax.Array, ok) -> jax.Array:
  """Per row, the smallest integer ``x`` in ``(lo, hi]`` with ``ok(x)``.

  ``ok`` must be monotone (False then True) and True at ``hi``; it maps a
  (batch,) integer array to a (batch,) bool array. Takes at most
  ``log2(hi - lo)`` iterations.
  """

  def body(carry):
    lo, hi = carry
    live = hi - lo > 1
    mid = lo + (hi - lo) // 2
    good = ok(mid)
    return jnp.where(live & ~good, mid, lo), jnp.where(live & good, mid, hi)

  return jax.lax.while_loop(lambda c: jnp.any(c[1] - c[0] > 1), body,
                            (lo, hi))[1]


def top_p_keep_mask_full(
    scaled: jax.Array,
    log_norm: jax.Array,
    top_p: jax.Array,
    upper: jax.Array,
) -> jax.Array:
  """Exact top-p mask over the whole vocabulary, without sorting.

  With HF semantics the kept set is every token above a threshold value
  ``t*`` plus the first (lowest-id) few tokens equal to ``t*``. ``t*`` is the
  smallest token value whose strictly-higher mass is ``< top_p``; that mass is
  monotone in the threshold, so an exact bisection over the 2**32 float32 bit
  patterns finds it in at most 32 passes over the vocabulary (each a masked
  sum, cheap compared with a sort). Ties at ``t*`` (rare) take a second
  bisection over token ids.

  Args:
    scaled: f32 (batch, vocab) temperature-scaled logits (top-k off).
    log_norm: f32 (batch,) logsumexp of ``scaled``.
    top_p: f32 (batch,) in (0, 1].
    upper: f32 (batch,) a value whose strictly-higher mass is known to be
      ``< top_p`` (e.g. the smallest top-k candidate); narrows the search.

  Returns:
    bool (batch, vocab) mask of the nucleus.
  """
  batch, vocab = scaled.shape
  probs = jnp.exp(scaled - log_norm[:, None])
  mass_above = lambda t: jnp.sum(
      jnp.where(scaled > t[:, None], probs, 0.0), axis=-1)
  hi = sortable(upper)
  lo = jnp.minimum(sortable(jnp.min(scaled, axis=-1)) - 1, hi - 1)
  t = unsortable(bisect(lo, hi, lambda k: mass_above(unsortable(k)) < top_p))

  above = scaled > t[:, None]
  group = scaled == t[:, None]
  group_size = jnp.sum(group, axis=-1, dtype=jnp.int32)
  room = (top_p - mass_above(t)) / jnp.exp(t - log_norm)
  room = jnp.nan_to_num(jnp.ceil(room), nan=1.0, posinf=vocab)
  n_group = jnp.clip(room, 1, jnp.maximum(group_size, 1)).astype(jnp.int32)

  def first_of_group():
    ids = jnp.arange(vocab, dtype=jnp.int32)
    count_below = lambda m: jnp.sum(group & (ids < m[:, None]), axis=-1)
    end = bisect(jnp.zeros((batch,), jnp.int32),
                 jnp.full((batch,), vocab, jnp.int32),
                 lambda m: count_below(m) >= n_group)
    return group & (ids < end[:, None])

  tied = jax.lax.cond(jnp.any(group_size > 1), first_of_group, lambda: group)
  return above | tied


def xtc_applies(settings, coin: jax.Array) -> jax.Array:
  """bool (batch,): the rows whose XTC step removes tokens this step, if
  two or more of their tokens reach the threshold.

  As llama.cpp: XTC acts when ``xtc_probability > 0``, ``xtc_threshold <=
  0.5`` and the row's uniform draw ``coin`` (in [0, 1)) is ``<=
  xtc_probability``. Greedy rows are left to the caller (they never
  sample).
  """
  return ((settings.xtc_probability > 0) & (settings.xtc_threshold <= 0.5)
          & (coin <= settings.xtc_probability))


def xtc_mask(scaled: jax.Array, keep: jax.Array, threshold: jax.Array,
             applies: jax.Array) -> jax.Array:
  """XTC ("exclude top choices"), as llama.cpp's ``llama_sampler_xtc``.

  Of the tokens ``keep`` leaves, those whose probability under
  ``softmax(where(keep, scaled, -inf))`` is ``>= threshold`` are the top
  choices; when a row ``applies`` and has at least two of them, all of them
  but the last in candidate order (value descending, ties to the lower
  index) are removed: the least likely top choice stays, with every token
  below the threshold. Probabilities are ``e / sum(e)`` with ``e = exp(x -
  max)``, as the CPU kernel computes them.

  Args:
    scaled: f32 (batch, n) temperature-scaled logits: the vocabulary, or
      sorted candidates (then the index order is the candidate order).
    keep: bool (batch, n) what the earlier filters kept (at least one
      token per row).
    threshold: f32 (batch,) ``xtc_threshold``.
    applies: bool (batch,) :func:`xtc_applies` (and not greedy).

  Returns:
    bool (batch, n): a subset of ``keep`` with at least one token per row.
  """
  masked = jnp.where(keep, scaled, -jnp.inf)
  e = jnp.exp(masked - jnp.max(masked, axis=-1, keepdims=True))
  p = e / jnp.sum(e, axis=-1, keepdims=True)
  top = keep & (p >= threshold[:, None])
  lowest = jnp.min(jnp.where(top, masked, jnp.inf), axis=-1, keepdims=True)
  index = jnp.arange(scaled.shape[-1], dtype=jnp.int32)
  last = jnp.max(jnp.where(top & (masked == lowest), index, -1), axis=-1,
                 keepdims=True)
  drop = applies & (jnp.sum(top, axis=-1) >= 2)
  return keep & ~(drop[:, None] & top & (index != last))
