"""Empirical sample frequencies match the exactly computed filtered softmax.

Each case draws N tokens (rows of identical logits with steps 0..N-1, so every
draw has its own key) and compares the counts with ``reference.filtered_probs``
by a chi-square test whose threshold is the 1e-6 upper quantile of the
chi-square distribution (bins with expected count < 5 merged): a correct
sampler fails it with probability ~1e-6, while a bias of d in a bin of
probability p adds ~N d^2 / p to the statistic. The draws are seeded, so the
test is deterministic. Tokens outside the kept set must never appear.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.kernels import ops
from penzai_lm.sampling import SamplingSettings
from penzai_lm.sampling import init_sampler_state
from penzai_lm.sampling import sample_next
from tests.sampling import reference

NUM_DRAWS = 20_000
ROWS_PER_CALL = 2_000

_SAMPLE = {False: jax.jit(sample_next),
           True: jax.jit(functools.partial(sample_next, kernel=True))}

# The JAX sampler, and the CPU kernel that makes its choices in one call
# (`penzai_lm.kernels.ops.sample`; the decode loop's sampler on CPU).
SAMPLERS = pytest.mark.parametrize("kernel", [
    False, pytest.param(True, marks=pytest.mark.skipif(
        not ops.available(), reason="no C++ compiler for the kernels"))])


def draw_counts(logits: np.ndarray, seed: int = 7, kernel: bool = False,
                **kwargs) -> np.ndarray:
  """Histogram of NUM_DRAWS tokens sampled from one logit row (with the
  CPU kernel if ``kernel``)."""
  vocab = logits.shape[0]
  batch = ROWS_PER_CALL
  settings = SamplingSettings.make(batch, vocab, seed=seed, **kwargs)
  state = init_sampler_state(jnp.zeros((batch, 1), jnp.int32),
                             jnp.zeros((batch, 1), bool), vocab_size=vocab)
  rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (batch, vocab))
  counts = np.zeros(vocab, np.int64)
  for start in range(0, NUM_DRAWS, batch):
    steps = start + jnp.arange(batch, dtype=jnp.int32)
    tokens, _ = _SAMPLE[kernel](rows, settings, state, steps)
    counts += np.bincount(np.asarray(tokens), minlength=vocab)
  return counts


def assert_draws_follow(probs: np.ndarray, logits: np.ndarray,
                        **kwargs) -> None:
  """NUM_DRAWS tokens sampled with ``kwargs`` follow ``probs`` (chi-square
  test) and never take a token of probability 0."""
  counts = draw_counts(logits, **kwargs)
  assert counts.sum() == NUM_DRAWS
  assert counts[probs == 0].sum() == 0, "sampled a filtered-out token"
  ratio, tv = reference.goodness_of_fit(counts, probs)
  assert ratio < 1.0, f"chi-square {ratio:.2f}x its 1e-6 bound (TV {tv:.4f})"


def zipf_logits(vocab: int, seed: int = 0, power: float = 1.0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  rank = rng.permutation(vocab) + 1
  return (-power * np.log(rank) + 0.3 * rng.standard_normal(vocab)).astype(
      np.float32)


CASES = {
    "temperature": (64, dict(temperature=0.7)),
    "hot": (64, dict(temperature=1.8)),
    "top_k": (64, dict(top_k=5)),
    "top_p": (64, dict(top_p=0.8)),
    "min_p": (64, dict(min_p=0.1)),
    "combined": (64, dict(temperature=1.3, top_k=10, top_p=0.9, min_p=0.02)),
    "top_k_p_small_cap": (64, dict(top_k=12, top_p=0.7, top_k_cap=16)),
    "top_p_fits_candidates": (64, dict(top_p=0.3, top_k_cap=16)),
    # Nucleus larger than the 4 candidates: exact bisection fallback.
    "top_p_fallback": (64, dict(temperature=1.5, top_p=0.9, top_k_cap=4)),
    "top_p_fallback_min_p": (64, dict(top_p=0.95, min_p=0.05, top_k_cap=4)),
    # Vocab not a multiple of the chunk size (two-level draw with padding).
    "plain_1000": (1000, dict(temperature=1.0)),
    "min_p_1000": (1000, dict(min_p=0.02)),
    "bias_and_bans": (64, dict(logit_bias={3: 2.0, 10: -1.0},
                               banned_tokens=[0, 1, 2])),
}


@SAMPLERS
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_filtered_softmax(name, kernel):
  vocab, kwargs = CASES[name]
  logits = zipf_logits(vocab)
  ref_kwargs = {k: v for k, v in kwargs.items() if k != "top_k_cap"}
  ref_kwargs["banned"] = ref_kwargs.pop("banned_tokens", ())
  if kwargs.get("top_p", 1.0) < 1:  # float32 boundary decisions must be clear.
    assert reference.top_p_margin(
        logits, temperature=kwargs.get("temperature", 1.0),
        top_k=kwargs.get("top_k", 0), top_p=kwargs["top_p"]) > 1e-4
  assert_draws_follow(reference.filtered_probs(logits, **ref_kwargs), logits,
                      kernel=kernel, **kwargs)


@SAMPLERS
def test_ties_at_top_p_boundary_keep_lowest_ids(kernel):
  """Uniform logits: the nucleus is the ceil(top_p * V) lowest ids."""
  vocab = 40
  logits = np.zeros(vocab, np.float32)
  for cap in (4, 256):  # Bisection fallback and exhaustive candidates.
    counts = draw_counts(logits, top_p=0.5, top_k_cap=cap, kernel=kernel)
    assert counts[20:].sum() == 0
    ratio, _ = reference.goodness_of_fit(
        counts, reference.filtered_probs(logits, top_p=0.5))
    assert ratio < 1.0


def test_different_seeds_give_different_streams():
  logits = zipf_logits(64)
  a = draw_counts(logits, seed=1, temperature=1.0)
  b = draw_counts(logits, seed=2, temperature=1.0)
  assert not np.array_equal(a, b)
