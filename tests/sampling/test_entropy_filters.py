"""Typical, epsilon and eta sampling against Hugging Face's own warpers.

``transformers`` is the independent reference: its ``TypicalLogitsWarper``,
``EpsilonLogitsWarper`` and ``EtaLogitsWarper`` run on the same logits. The
masks must keep the same tokens, and ``sample_next`` must draw from the
distribution HF's whole warper chain leaves (chi-square test, as in
test_distribution.py).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.sampling import entropy_filters
from tests.sampling import reference
from tests.sampling.test_distribution import NUM_DRAWS
from tests.sampling.test_distribution import SAMPLERS
from tests.sampling.test_distribution import assert_draws_follow
from tests.sampling.test_distribution import draw_counts
from tests.sampling.test_distribution import zipf_logits

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")


def _rows(batch=64, vocab=500, seed=0):
  """Rows from near-uniform to very peaked."""
  rng = np.random.default_rng(seed)
  scale = rng.uniform(0.3, 4.0, (batch, 1))
  return (rng.standard_normal((batch, vocab)) * scale).astype(np.float32)


def _hf_keep(warper, logits):
  return np.isfinite(warper(None, torch.tensor(logits)).numpy())


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.95, 0.999])
def test_typical_mask_keeps_what_hf_keeps(mass):
  logits = _rows()
  got = np.asarray(entropy_filters.typical_mask(
      jnp.asarray(logits), jnp.full((64,), mass, jnp.float32)))
  np.testing.assert_array_equal(
      got, _hf_keep(lp.TypicalLogitsWarper(mass), logits))


@pytest.mark.parametrize("name", ["epsilon", "eta"])
@pytest.mark.parametrize("cutoff", [1e-4, 3e-3, 0.01, 0.2])
def test_cutoff_masks_keep_what_hf_keeps(name, cutoff):
  logits = _rows()
  fn, warper = {
      "epsilon": (entropy_filters.epsilon_mask, lp.EpsilonLogitsWarper),
      "eta": (entropy_filters.eta_mask, lp.EtaLogitsWarper),
  }[name]
  got = np.asarray(fn(jnp.asarray(logits), jnp.full((64,), cutoff,
                                                     jnp.float32)))
  want = _hf_keep(warper(cutoff), logits)
  # float32 may decide a token whose probability equals the cutoff to a
  # few ulps either way; every other decision must agree.
  p = reference.softmax  # Row-wise, float64.
  for b, t in np.argwhere(got != want):
    probs = p(logits[b])
    if name == "epsilon":
      cut = cutoff
    else:
      entropy = -np.sum(probs[probs > 0] * np.log(probs[probs > 0]))
      cut = min(cutoff, np.sqrt(cutoff) * np.exp(-entropy))
    assert abs(probs[t] - cut) < 1e-5 * cut, (b, t, probs[t], cut)
  assert (got != want).sum() <= 2
  assert got.sum(1).min() >= 1  # The most likely token always stays.


def test_masks_respect_earlier_filters_and_keep_the_top_token():
  logits = _rows(batch=8)
  masked = np.where(np.arange(500) % 3 == 0, -np.inf, logits).astype(
      np.float32)
  for mask in (
      entropy_filters.typical_mask(jnp.asarray(masked), jnp.full(8, 0.3)),
      entropy_filters.epsilon_mask(jnp.asarray(masked), jnp.full(8, 0.5)),
      entropy_filters.eta_mask(jnp.asarray(masked), jnp.full(8, 0.5))):
    mask = np.asarray(mask)
    assert not mask[:, ::3].any()  # Removed tokens never come back.
    assert mask.sum(1).min() >= 1
  top = np.argmax(masked, axis=1)
  eps = np.asarray(entropy_filters.epsilon_mask(jnp.asarray(masked),
                                                jnp.full(8, 0.9)))
  np.testing.assert_array_equal(np.argwhere(eps)[:, 1], top)


def test_neutral_values_keep_every_finite_token():
  logits = _rows(batch=4)
  logits[:, :7] = -np.inf
  x = jnp.asarray(logits)
  for mask in (entropy_filters.typical_mask(x, jnp.ones(4)),
               entropy_filters.epsilon_mask(x, jnp.zeros(4)),
               entropy_filters.eta_mask(x, jnp.zeros(4))):
    np.testing.assert_array_equal(np.asarray(mask), np.isfinite(logits))


CASES = {
    "typical": dict(typical_p=0.6),
    "typical_hot": dict(temperature=1.5, typical_p=0.7),
    "epsilon": dict(temperature=1.4, epsilon_cutoff=0.02),
    "eta": dict(temperature=1.4, eta_cutoff=0.3),
    "with_top_k": dict(temperature=0.9, top_k=20, typical_p=0.7),
    "with_top_p_min_p": dict(top_p=0.9, min_p=0.01, epsilon_cutoff=0.005,
                             eta_cutoff=0.01),
    # The nucleus is larger than the 4 candidates: exact bisection, then the
    # typical set of what it keeps.
    "top_p_fallback": dict(temperature=1.5, top_p=0.9, typical_p=0.8,
                           top_k_cap=4),
    "all": dict(temperature=1.2, top_k=40, top_p=0.95, min_p=0.01,
                typical_p=0.95, epsilon_cutoff=1e-3, eta_cutoff=1e-3),
}


@SAMPLERS
@pytest.mark.parametrize("name", sorted(CASES))
def test_draws_match_hf_warper_chain(name, kernel):
  kwargs = CASES[name]
  logits = zipf_logits(64, seed=3)
  probs = reference.hf_warped_probs(
      logits, **{k: v for k, v in kwargs.items() if k != "top_k_cap"})
  assert 2 < (probs > 0).sum() < 64, "the case should filter something"
  assert_draws_follow(probs, logits, kernel=kernel, **kwargs)


@SAMPLERS
def test_typical_can_drop_the_most_likely_token(kernel):
  """One token 20x likelier than 63 others is atypical (surprisal 1.4
  nats, entropy 3.7): HF drops it, and so must we."""
  logits = np.concatenate([[3.0], np.zeros(63)]).astype(np.float32)
  probs = reference.hf_warped_probs(logits, typical_p=0.5)
  assert probs[0] == 0
  counts = draw_counts(logits, typical_p=0.5, kernel=kernel)
  assert counts[0] == 0
  assert counts[1:].sum() == NUM_DRAWS
