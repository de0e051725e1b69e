"""Every family's uncached logits against the naive numpy reference."""

import jax.numpy as jnp
import numpy as np
from penzai import pz

from tests.model.conftest import random_tokens
from tests.model.reference import reference_logits


def test_uncached_matches_reference(model):
  # 11 tokens: longer than the sliding windows (4) of mistral and gemma3.
  tokens = random_tokens((11,))
  logits = model(pz.nx.wrap(jnp.asarray(tokens)).tag("seq"))
  expected = reference_logits(model, tokens)
  np.testing.assert_allclose(
      np.asarray(logits.unwrap("seq", "vocabulary")), expected, atol=2e-4
  )
