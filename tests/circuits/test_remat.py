"""remat: attention recomputed in the backward pass, one block at a time.

XLA's own memory analysis of a batch's compiled program: with
`Rematerialized` attention its temporaries hold about one block's
``[heads, T, T]`` patterns, without it (`LinearizedModel.forward_mode`)
every block's; the rows are the same either way.
"""

import importlib

import jax.numpy as jnp
import numpy as np

import penzai_lm
from penzai_lm import circuits
from penzai_lm.circuits.feature_weights import FeatureWeights
from penzai_lm.circuits.feature_weights import feature_sources
from tests.circuits.test_attribute import _transcoders
from tests.model.configs import config

rows = importlib.import_module("penzai_lm.circuits.rows")

SEQ, LAYERS, HEADS, WIDTH = 512, 3, 4, 32


def _compiled(linear, transcoders):
  flat = [t.flat() for t in transcoders]
  weights = FeatureWeights(tuple(f["w_enc"] for f in flat),
                           tuple(f["w_dec"] for f in flat))
  n = 64
  sources = {**feature_sources(
      weights, np.repeat(np.arange(LAYERS), [22, 21, 21]).astype(np.int32),
      np.arange(n, dtype=np.int32) % SEQ, np.arange(n, dtype=np.int32),
      np.ones(n, np.float32), n, jnp.asarray),
             "errors": jnp.ones((LAYERS, SEQ, WIDTH)),
             "embed": jnp.ones((SEQ, WIDTH))}
  batch = 2
  args = (linear, sources, jnp.array([2, 1]), jnp.array([SEQ - 1, 7]),
          jnp.ones((batch, WIDTH)),
          jnp.zeros((batch, config("llama_gqa").vocab_size)))
  compiled = rows._batch_rows.lower(*args, chunk=16).compile()
  return compiled.memory_analysis().temp_size_in_bytes, compiled(*args)


def test_one_blocks_patterns_at_a_time():
  model = penzai_lm.build_transformer(config("llama_gqa"), seed=3)
  transcoders = _transcoders()
  tokens = np.arange(SEQ, dtype=np.int32) % 90 + 3
  linear = circuits.linearize(model, transcoders, tokens)
  remat_temp, remat_rows = _compiled(linear, transcoders)
  kept_temp, kept_rows = _compiled(linear.forward_mode(), transcoders)
  pattern = HEADS * SEQ * SEQ * 4
  # Without rematerializing, every block's patterns are kept.
  assert kept_temp - remat_temp > (LAYERS - 1.5) * pattern, (
      kept_temp, remat_temp, pattern)
  assert np.abs(np.asarray(kept_rows)).max() > 0.1
  np.testing.assert_allclose(np.asarray(remat_rows), np.asarray(kept_rows),
                             rtol=1e-5, atol=1e-5)
