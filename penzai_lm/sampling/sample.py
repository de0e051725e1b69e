"""Next-token sampling: one call per decoded token, jit/while_loop friendly.

Array conventions:
  * ``logits``: float32 ``(batch, vocab)``, the model's raw next-token logits.
  * ``step``: int32 ``(batch,)`` (or a scalar for all rows), the number of
    tokens row ``r`` has generated so far; row r's random key is
    ``fold_in(key(seed[r]), step[r])``, so a row's samples never depend on
    its batch position or on the other rows (batch invariance) and a run is
    reproducible from its seeds. The key gives the row's Gumbel noise
    (:func:`row_gumbels`) and its XTC coin (:func:`row_coins`).
  * Returns ``token`` int32 ``(batch,)`` and ``logprob`` float32 ``(batch,)``.

Filter order (as in HF ``generate()``): (1) repetition, presence and
frequency penalties, (2) logit bias, then banned tokens -> -inf,
(3) temperature, (4) top-k, (5) top-p, (6) min-p, (7) typical, epsilon
and eta (``entropy_filters``), (8) XTC (``filters.xtc_mask``; not an HF
filter: last, after every truncation, as in llama.cpp's default chain),
then a categorical draw (Gumbel-max). Greedy rows (temperature 0) take the
argmax of the logits after steps (1)-(2) and ignore (3)-(8); ties go to
the lowest token id, as they do for ``top_k=1`` and a tiny ``top_p``.
XTC's probabilities are those of the temperature-scaled, filtered logits
(llama.cpp's default chain divides by the temperature after XTC, so there
XTC sees temperature-1 probabilities).

Cost: the batch decides, with ``jax.lax.cond``, which paths run (penalties
only when some row uses them; each path only when some row needs it):
  * greedy rows: a chunked argmax (a vectorised max-reduce, then two small
    argmaxes; ~5x faster than ``jnp.argmax`` over the vocabulary on CPU).
  * rows without top-k/top-p ("plain"): min-p needs only the row max; the
    draw is a two-level Gumbel-max (pick a chunk of ~sqrt(vocab) tokens by its
    total mass, then a token inside it), which needs ~2*sqrt(vocab) random
    numbers instead of ``vocab`` (random bits dominate a full-vocab
    ``jax.random.categorical`` on CPU).
  * rows with top-k or top-p: ``jax.lax.top_k`` extracts ``top_k_cap``
    candidates (a partial sort, about one pass over the vocabulary), the
    filters act on them and the draw is over them. A top-p-only row whose
    nucleus is larger than the candidates falls back to an exact bisection
    over the full vocabulary (``filters.top_p_keep_mask_full``).
  * XTC acts on the kept candidates of a top-k / top-p row, on the kept
    vocabulary of the other rows (a few masked passes, only at the steps
    where some row's coin makes it act).
  * rows with typical, epsilon or eta sampling join the plain rows' draw:
    their top-k / top-p become a mask over the vocabulary (the typical set
    is not a prefix of the candidates; its threshold is a bisection). The
    fallback rows, the plain rows and these share one draw over the
    vocabulary, and the top-k rows of every kind one candidate extraction.
No path sorts the whole vocabulary. Do not ``jax.vmap`` ``sample_next`` over
rows: it is already batched, and vmap turns its conds into selects that run
every path.

On CPU, ``kernel=True`` makes the same choices from the same Gumbel noise
and coins in one call of penzai_lm's sampling kernel
(`penzai_lm.kernels.ops.sample`, ``sampler.cc``); the engine's decode loop
does this for models on one CPU device. The kernel is used only when it
implements every sampling setting (`settings.kernel_implements_all`, from
each `SamplingField`'s ``kernel``): settings are traced values, so a
setting the kernel lacks makes the whole program use the JAX sampler
rather than be ignored. XLA:CPU compiles each vocabulary-wide step above,
and every branch of the conds, as a kernel of its own, so the kernel's
loop compiles much faster (measured in docs/design.md,
`benchmarks/sampling_filters.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from penzai_lm.sampling import entropy_filters
from penzai_lm.sampling import filters
from penzai_lm.sampling import penalties
from penzai_lm.sampling.penalties import SamplerState
from penzai_lm.sampling.settings import FIELDS
from penzai_lm.sampling.settings import KERNEL_PARAMS
from penzai_lm.sampling.settings import kernel_implements_all
from penzai_lm.sampling.settings import SamplingField
from penzai_lm.sampling.settings import SamplingSettings

# fold_in data of the key a row's XTC coin is drawn from (its Gumbel noise
# uses the row's key itself).
_COIN_STREAM = 1


def row_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
  """Typed PRNG keys (batch,) = ``fold_in(key(seed[r]), step[r])``."""
  return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(
      seed, step)


def row_gumbels(keys: jax.Array, num: int) -> jax.Array:
  """f32 (batch, num) standard Gumbel noise, one independent draw per row.

  The random choices of a path use disjoint slices of this one draw (a row
  takes exactly one path per step), so a row's randomness depends only on its
  key, and XLA compiles a single PRNG kernel.
  """
  return jax.vmap(lambda k: jax.random.gumbel(k, (num,), jnp.float32))(keys)


def row_coins(keys: jax.Array) -> jax.Array:
  """f32 (batch,) one uniform draw in [0, 1) per row (XTC's coin).

  Drawn from ``fold_in(key, 1)``: independent of the row's Gumbel noise,
  which is not changed by it.
  """
  return jax.vmap(lambda k: jax.random.uniform(
      jax.random.fold_in(k, _COIN_STREAM), (), jnp.float32))(keys)


def uses_kernel(kernel: bool,
                fields: tuple[SamplingField, ...] = FIELDS) -> bool:
  """Whether ``sample_next(kernel=kernel)`` calls the CPU kernel: asked
  for, and every setting of ``fields`` implemented by it (static)."""
  return bool(kernel) and kernel_implements_all(fields)


def noise_size(vocab: int, top_k_cap: int) -> int:
  """Gumbel numbers per row that :func:`sample_next` needs (static)."""
  num_chunks, chunk = filters.chunk_shape(vocab)
  return max(num_chunks + chunk, min(top_k_cap, vocab))


def sample_full_vocab(noise: jax.Array, logits: jax.Array) -> jax.Array:
  """Draws one token per row from ``softmax(logits)`` (-inf = excluded).

  Exact two-level Gumbel-max draw: first a chunk of ~sqrt(vocab) tokens with
  probability equal to its total mass, then a token within that chunk. It
  needs ~2*sqrt(vocab) Gumbel numbers instead of vocab.

  Args:
    noise: f32 (batch, >= num_chunks + chunk) Gumbel noise
      (:func:`row_gumbels`).
    logits: f32 (batch, vocab); at least one finite entry per row.

  Returns:
    int32 (batch,) token ids.
  """
  padded, chunk = filters.chunk_rows(logits)
  num_chunks = padded.shape[1]
  row_max = jnp.max(logits, axis=-1)[:, None, None]
  log_mass = jnp.log(jnp.sum(jnp.exp(padded - row_max), axis=-1))
  which = jnp.argmax(log_mass + noise[:, :num_chunks], axis=-1)
  inside = jnp.take_along_axis(padded, which[:, None, None], axis=1)[:, 0]
  pick = jnp.argmax(inside + noise[:, num_chunks:num_chunks + chunk], axis=-1)
  return (which * chunk + pick).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Candidates:
  """The ``top_k_cap`` best tokens of each row and what top-k / top-p /
  min-p keep of them (see `filters.candidate_keep_mask`).

  Attributes:
    vals: f32 (batch, K) scaled logits, descending.
    ids: i32 (batch, K) their token ids.
    keep: bool (batch, K) kept candidates.
    need_full: bool (batch,) rows whose nucleus does not fit in the
      candidates (exact top-p over the vocabulary instead).
    log_norm: f32 (batch,) the row's normaliser for top-p without top-k.
  """

  vals: jax.Array
  ids: jax.Array
  keep: jax.Array
  need_full: jax.Array
  log_norm: jax.Array


def _candidates(scaled, settings, truncating) -> _Candidates:
  """Top-k / top-p / min-p over ``top_k_cap`` candidates."""
  batch, vocab = scaled.shape
  num = min(settings.top_k_cap, vocab)
  p_only = truncating & (settings.top_k <= 0)
  # Full-row normaliser, only needed by top-p rows without top-k.
  log_norm = jax.lax.cond(
      jnp.any(p_only), lambda: jax.nn.logsumexp(scaled, axis=-1),
      lambda: jnp.zeros((batch,), jnp.float32))
  vals, ids = filters.top_k_candidates(scaled, num)
  keep, covered = filters.candidate_keep_mask(
      vals, settings.top_k, settings.top_p, settings.min_p, log_norm,
      exhaustive=num == vocab)
  return _Candidates(vals, ids, keep, truncating & ~covered, log_norm)


def _vocabulary_mask(scaled, settings, cand: _Candidates) -> jax.Array:
  """bool (batch, vocab): what top-k, top-p and min-p keep, as a vocabulary
  mask (rows of ``cand.need_full``: the exact nucleus, by bisection)."""
  batch, vocab = scaled.shape
  mask = jnp.zeros((batch, vocab), bool).at[
      jnp.arange(batch)[:, None], cand.ids].set(cand.keep)

  def full_nucleus():
    nucleus = filters.top_p_keep_mask_full(
        scaled, cand.log_norm, settings.top_p, upper=cand.vals[:, -1])
    return nucleus & filters.min_p_mask(scaled, settings.min_p)

  full = jax.lax.cond(jnp.any(cand.need_full), full_nucleus, lambda: mask)
  return jnp.where(cand.need_full[:, None], full, mask)


def _no_candidates(batch: int, num: int) -> _Candidates:
  return _Candidates(
      jnp.zeros((batch, num), jnp.float32), jnp.zeros((batch, num), jnp.int32),
      jnp.zeros((batch, num), bool), jnp.zeros((batch,), bool),
      jnp.zeros((batch,), jnp.float32))


def _draw_over_vocabulary(noise, processed, settings, cand: _Candidates,
                          masked: jax.Array, special: jax.Array,
                          xtc: jax.Array) -> jax.Array:
  """Draws for the rows that do not use the candidates.

  Args:
    noise: The rows' Gumbel noise.
    processed: f32 (batch, vocab) penalised, biased logits.
    settings: The rows' settings.
    cand: The candidates (valid for the top-k / top-p rows).
    masked: bool (batch,) rows whose top-k / top-p become a vocabulary mask.
    special: bool (batch,) rows that need more than temperature and min-p.
    xtc: bool (batch,) rows whose XTC acts at this step.
  """

  def filtered():
    scaled = filters.scale_by_temperature(processed, settings.temperature)
    keep = filters.min_p_mask(scaled, settings.min_p)
    keep = jax.lax.cond(
        jnp.any(masked),
        lambda: jnp.where(masked[:, None],
                          _vocabulary_mask(scaled, settings, cand), keep),
        lambda: keep)
    keep = entropy_filters.apply(scaled, keep, settings)
    keep = jax.lax.cond(
        jnp.any(xtc),
        lambda: filters.xtc_mask(scaled, keep, settings.xtc_threshold, xtc),
        lambda: keep)
    return sample_full_vocab(noise, jnp.where(keep, scaled, -jnp.inf))

  def plain():
    scaled = filters.scale_by_temperature(processed, settings.temperature)
    keep = filters.min_p_mask(scaled, settings.min_p)
    return sample_full_vocab(noise, jnp.where(keep, scaled, -jnp.inf))

  # Plain rows alone (temperature, min-p) keep their mask fused into the
  # draw; the conds of `filtered` materialize it (temperature-only steps
  # took 0.96 instead of 0.50 ms at batch 8, vocab 49k:
  # benchmarks/sampling_filters.py).
  return jax.lax.cond(jnp.any(special), filtered, plain)


def _choose(processed, settings, noise, coin):
  """Token per row from penalised, biased logits (steps 3-8 + draw).

  Greedy rows take the argmax; rows with top-k / top-p draw over their
  candidates; all other rows (no top-k / top-p, a nucleus larger than the
  candidates, typical / epsilon / eta, XTC without top-k / top-p) draw over
  the vocabulary. ``coin``: f32 (batch,) the rows' XTC draws.
  """
  batch, vocab = processed.shape
  num = min(settings.top_k_cap, vocab)
  greedy = filters.is_greedy(settings.temperature)
  truncating = ~greedy & ((settings.top_k > 0) | (settings.top_p < 1))
  entropy = ~greedy & entropy_filters.any_active(settings)
  xtc = ~greedy & filters.xtc_applies(settings, coin)
  zeros = jnp.zeros((batch,), jnp.int32)

  token = jax.lax.cond(jnp.any(greedy),
                       lambda: filters.argmax_first(processed), lambda: zeros)
  cand = jax.lax.cond(
      jnp.any(truncating),
      lambda: _candidates(filters.scale_by_temperature(
          processed, settings.temperature), settings, truncating),
      lambda: _no_candidates(batch, num))
  by_candidates = truncating & ~entropy & ~cand.need_full
  keep = jax.lax.cond(
      jnp.any(by_candidates & xtc),
      lambda: filters.xtc_mask(cand.vals, cand.keep, settings.xtc_threshold,
                               by_candidates & xtc),
      lambda: cand.keep)
  pos = jnp.argmax(jnp.where(keep, cand.vals, -jnp.inf)
                   + noise[:, :num], axis=-1)
  token = jnp.where(
      by_candidates,
      jnp.take_along_axis(cand.ids, pos[:, None], axis=-1)[:, 0], token)

  by_vocabulary = ~greedy & ~by_candidates
  masked = by_vocabulary & truncating
  return jnp.where(by_vocabulary, jax.lax.cond(
      jnp.any(by_vocabulary),
      lambda: _draw_over_vocabulary(
          noise, processed, settings, cand, masked,
          masked | (by_vocabulary & (entropy | xtc)), by_vocabulary & xtc),
      lambda: zeros), token)


def _check_shapes(logits: jax.Array, settings: SamplingSettings,
                  state: SamplerState) -> None:
  if logits.ndim != 2:
    raise ValueError(f"logits must have shape (batch, vocab), got "
                     f"{logits.shape}; add a batch axis with logits[None].")
  batch, vocab = logits.shape
  if settings.temperature.shape != (batch,):
    raise ValueError(f"settings are for {settings.temperature.shape[0]} rows "
                     f"but the logits have {batch}; build them with "
                     f"SamplingSettings.make({batch}, {vocab}, ...).")
  for name in ("logit_bias", "banned_tokens"):
    dense = getattr(settings, name)
    if dense is not None and dense.shape != (batch, vocab):
      raise ValueError(f"settings.{name} has shape {dense.shape} but the "
                       f"logits have shape {(batch, vocab)}; build the "
                       f"settings with vocab_size={vocab}.")
  if state.counts.shape != logits.shape or state.seen.shape != logits.shape:
    raise ValueError(f"the sampler state has shape {state.counts.shape} but "
                     f"the logits have shape {logits.shape}; build it with "
                     f"init_sampler_state(..., vocab_size={vocab}).")


def sample_next(
    logits: jax.Array,
    settings: SamplingSettings,
    state: SamplerState,
    step: jax.Array | int,
    *,
    extra_bans: jax.Array | None = None,
    kernel: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row (see the module docstring for the order).

  Args:
    logits: f32 (batch, vocab) raw model logits.
    settings: Per-row settings for this batch.
    state: Token statistics for the penalties (``init_sampler_state``);
      update it with ``update_sampler_state`` after each call.
    step: int (batch,) or scalar: tokens generated so far by each row.
    extra_bans: Optional bool (batch, vocab): tokens banned at this step only,
      on top of ``settings.banned_tokens`` (the generation loop bans stop
      tokens before a row's ``min_new_tokens``).
    kernel: Static: make the same choices in one call of penzai_lm's CPU
      kernel (`penzai_lm.kernels.ops.sample`; check
      ``kernels.ops.available()``), for arrays on the CPU, provided the
      kernel implements every sampling setting (:func:`uses_kernel`);
      otherwise this function's JAX sampler runs, so no setting is ever
      ignored. XLA:CPU compiles every vocabulary-wide step of this
      function, and every branch of its conds, as a kernel of its own
      (about 116: 1.4 s of compilation in every new decode program); the
      kernel call is one. Its floating-point sums may round differently,
      so a choice within a few ulps of a top-p, typical, cutoff or XTC
      threshold can differ.

  Returns:
    ``(token, logprob)``: int32 (batch,) chosen ids and float32 (batch,)
    log-probabilities of those ids under the model's *raw* distribution,
    ``log_softmax(logits)`` before any penalty, bias or filter (what
    OpenAI-style ``logprobs`` report).
  """
  logits = jnp.asarray(logits, jnp.float32)
  _check_shapes(logits, settings, state)
  batch, vocab = logits.shape
  step = jnp.broadcast_to(jnp.asarray(step, jnp.int32), (batch,))
  keys = row_keys(settings.seed, step)
  size = noise_size(vocab, settings.top_k_cap)

  def draws():
    return row_gumbels(keys, size), row_coins(keys)

  banned = settings.banned_tokens
  if extra_bans is not None:
    if extra_bans.shape != (batch, vocab):
      raise ValueError(f"extra_bans has shape {extra_bans.shape} but the "
                       f"logits have shape {(batch, vocab)}.")
    banned = extra_bans if banned is None else banned | extra_bans
  if uses_kernel(kernel):
    from penzai_lm.kernels import ops  # pylint: disable=g-import-not-at-top
    _, chunk = filters.chunk_shape(vocab)
    # Greedy rows read neither noise nor coin, so a step whose rows are all
    # greedy skips the draw (XLA:CPU runs threefry as a loop of its own;
    # docs/cpu-speed.md).
    noise, coin = jax.lax.cond(
        jnp.any(~filters.is_greedy(settings.temperature)), draws,
        lambda: (jnp.zeros((batch, size), jnp.float32),
                 jnp.zeros((batch,), jnp.float32)))
    params = jnp.stack([jnp.asarray(getattr(settings, name), jnp.float32)
                        for name in KERNEL_PARAMS], axis=1)
    return ops.sample(logits, params, settings.top_k, state.counts,
                      state.seen, settings.logit_bias, banned, noise, coin,
                      param_names=KERNEL_PARAMS,
                      num=min(settings.top_k_cap, vocab), chunk=chunk)

  noise, coin = draws()

  def processed(penalise: bool):
    out = logits
    if penalise:
      out = penalties.penalize(
          logits, state.counts, state.seen, settings.repetition_penalty,
          settings.presence_penalty, settings.frequency_penalty)
    return filters.apply_bias_and_bans(out, settings.logit_bias, banned)

  # Only the penalised, biased logits depend on the cond (both branches
  # write a new array: no copy when the engine's bans apply). With the
  # whole pipeline in both branches every filter was compiled twice: a
  # 1-layer SmolLM2-shaped decode program spent 3.1 s in XLA:CPU's code
  # generation instead of 2.3 s, in every first `generate`.
  token = _choose(jax.lax.cond(penalties.any_active(settings),
                               lambda: processed(True),
                               lambda: processed(False)), settings, noise,
                  coin)
  raw = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
  return token, raw - jax.nn.logsumexp(logits, axis=-1)


def top_logprobs(logits: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """The ``n`` most likely tokens under the raw distribution.

  Args:
    logits: f32 (batch, vocab) raw model logits.
    n: Static number of entries (1 <= n <= vocab).

  Returns:
    ``(logprobs, ids)``: float32 and int32 of shape (batch, n), sorted by
    decreasing probability, ties to the lower id; logprobs are
    ``log_softmax(logits)`` values.
  """
  logits = jnp.asarray(logits, jnp.float32)
  if not 1 <= n <= logits.shape[-1]:
    raise ValueError(f"n must be in [1, vocab={logits.shape[-1]}], got {n}.")
  vals, ids = filters.top_k_candidates(logits, n)
  return vals - jax.nn.logsumexp(logits, axis=-1, keepdims=True), ids
