"""Filters that read the whole distribution: typical, epsilon and eta.

Array conventions (as in ``filters``):
  * ``masked``: float32 ``(batch, vocab)`` temperature-scaled logits with
    ``-inf`` for the tokens the earlier filters removed. Probabilities are
    those of ``softmax(masked)``: each filter sees the distribution the
    previous ones left, renormalised (HF ``generate()`` semantics).
  * Each filter returns a bool ``(batch, vocab)`` keep mask (a subset of the
    finite entries) and keeps at least the most likely token.
  * Per-row parameters are ``(batch,)`` arrays; the neutral value (typical_p
    1, cutoffs 0) keeps every finite token.

HF order (after top-k, top-p and min-p): typical, epsilon, eta. Unlike top-k
and top-p, the typical set need not be a prefix of the tokens sorted by
probability (the most likely token can be atypical), so these filters work on
the whole vocabulary; like top-p's fallback, typical sampling finds its
threshold by bisection instead of sorting the vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from penzai_lm.sampling import filters
from penzai_lm.sampling.settings import SamplingSettings


def any_active(settings: SamplingSettings) -> jax.Array:
  """bool (batch,): rows that use typical, epsilon or eta sampling."""
  return ((settings.typical_p < 1) | (settings.epsilon_cutoff > 0)
          | (settings.eta_cutoff > 0))


def _log_probs_and_entropy(masked):
  logp = jax.nn.log_softmax(masked, axis=-1)
  finite = jnp.isfinite(masked)
  p = jnp.where(finite, jnp.exp(logp), 0.0)
  entropy = -jnp.sum(jnp.where(finite, p * logp, 0.0), axis=-1)
  return logp, p, entropy, finite


def _top(masked):
  return masked >= jnp.max(masked, axis=-1, keepdims=True)


def typical_mask(masked: jax.Array, typical_p: jax.Array) -> jax.Array:
  """Locally typical sampling (HF ``TypicalLogitsWarper``).

  Tokens are ranked by ``|surprisal - entropy|``; HF keeps every token whose
  score is at most ``s*``, the score at which the mass of the ranked tokens
  first reaches ``typical_p``. That mass is monotone in the score, so ``s*``
  is found by bisection over the float32 bit patterns (at most 32 masked
  sums), without sorting. A row whose total mass rounds below ``typical_p``
  keeps everything, as HF's clamp does.
  """
  logp, p, entropy, finite = _log_probs_and_entropy(masked)
  score = jnp.where(finite, jnp.abs(logp + entropy[:, None]), jnp.inf)
  mass_upto = lambda s: jnp.sum(jnp.where(score <= s[:, None], p, 0.0), -1)  # noqa: E731
  hi = filters.sortable(jnp.max(jnp.where(finite, score, -jnp.inf), axis=-1))
  lo = filters.sortable(jnp.min(score, axis=-1)) - 1
  threshold = filters.unsortable(filters.bisect(
      lo, hi, lambda k: (k >= hi) | (
          mass_upto(filters.unsortable(k)) >= typical_p)))
  off = (typical_p >= 1)[:, None]
  return finite & (off | (score <= threshold[:, None]))


def epsilon_mask(masked: jax.Array, epsilon: jax.Array) -> jax.Array:
  """Epsilon sampling (HF ``EpsilonLogitsWarper``): drops p < epsilon."""
  _, p, _, finite = _log_probs_and_entropy(masked)
  return finite & ((p >= epsilon[:, None]) | _top(masked))


def eta_mask(masked: jax.Array, eta: jax.Array) -> jax.Array:
  """Eta sampling (HF ``EtaLogitsWarper``): drops p below
  ``min(eta, sqrt(eta) * exp(-entropy))``."""
  _, p, entropy, finite = _log_probs_and_entropy(masked)
  cut = jnp.minimum(eta, jnp.sqrt(eta) * jnp.exp(-entropy))
  return finite & ((p >= cut[:, None]) | _top(masked))


def apply(scaled: jax.Array, keep: jax.Array,
          settings: SamplingSettings) -> jax.Array:
  """Typical, then epsilon, then eta, on the tokens ``keep`` leaves.

  Args:
    scaled: f32 (batch, vocab) temperature-scaled logits.
    keep: bool (batch, vocab) what top-k, top-p and min-p kept.
    settings: The rows' settings.

  Returns:
    bool (batch, vocab): the tokens left to sample from.
  """
  # Each filter sees what the previous ones left, and runs only when some
  # row uses it (typical sampling costs ~0.6 ms a step at batch 1 on a 49k
  # vocabulary, each cutoff ~0.25 ms: benchmarks/sampling_filters.py).
  for on, mask, value in (
      (settings.typical_p < 1, typical_mask, settings.typical_p),
      (settings.epsilon_cutoff > 0, epsilon_mask, settings.epsilon_cutoff),
      (settings.eta_cutoff > 0, eta_mask, settings.eta_cutoff)):
    keep = jax.lax.cond(
        jnp.any(on),
        lambda keep=keep, mask=mask, value=value: mask(
            jnp.where(keep, scaled, -jnp.inf), value),
        lambda keep=keep: keep)
  return keep
