"""feature_weights: features' vectors gathered from the transcoders' weights.

The chunked device read-out equals a numpy sum over materialized decoder
vectors (per-layer and cross-layer weights, padding, features a prefix does
not hold, chunks that do not divide a block's features); the host gathers
equal the weights' rows; transcoders that rescale by the decoder norm give
the graph of the equivalent plain transcoders.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import penzai_lm
from penzai_lm import circuits
from penzai_lm.circuits.feature_weights import FeatureWeights
from penzai_lm.circuits.feature_weights import feature_edges
from penzai_lm.circuits.feature_weights import feature_sources
from penzai_lm.sae import SAEConfig
from penzai_lm.sae import SparseAutoencoder
from tests.model.configs import config
from tests.sae.random_saes import random_arrays

LAYERS, WIDTH, FEATURES = 3, 8, 10


def _weights(cross_layer: bool, scaled: bool = False) -> FeatureWeights:
  rng = np.random.default_rng(1)
  if cross_layer:
    return FeatureWeights(
        encoders=jnp.asarray(rng.standard_normal((LAYERS, WIDTH, FEATURES)),
                             jnp.float32),
        decoders=tuple(jnp.asarray(rng.standard_normal(
            (FEATURES, LAYERS - l, WIDTH)), jnp.float32)
                       for l in range(LAYERS)), cross_layer=True)
  return FeatureWeights(
      encoders=tuple(jnp.asarray(rng.standard_normal((WIDTH, FEATURES)),
                                 jnp.float32) for _ in range(LAYERS)),
      decoders=tuple(jnp.asarray(rng.standard_normal((FEATURES, WIDTH)),
                                 jnp.float32) for _ in range(LAYERS)),
      scales=tuple(rng.uniform(0.5, 2.0, FEATURES).astype(np.float32)
                   for _ in range(LAYERS)) if scaled else None)


def _features(n: int, seq: int, seed: int = 2):
  rng = np.random.default_rng(seed)
  layers = np.sort(rng.integers(0, LAYERS, n)).astype(np.int32)
  layers[layers == 1] = 0  # Block 1 has no features: an empty range.
  layers = np.sort(layers)
  positions = rng.integers(0, seq, n).astype(np.int32)
  ids = rng.integers(0, FEATURES, n).astype(np.int32)
  coef = rng.uniform(0.5, 2.0, n).astype(np.float32)
  return layers, positions, ids, coef


@pytest.mark.parametrize("cross_layer", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_read_out_is_the_sum_over_materialized_vectors(cross_layer, chunk):
  weights = _weights(cross_layer)
  batch, seq, n = 3, 6, 23
  layers, positions, ids, coef = _features(n, seq)
  vectors = weights.decoder_rows(layers, ids, coef)  # [n, D] or [n, L, D]
  if not cross_layer:  # Check the host gather too.
    for i in range(n):
      np.testing.assert_allclose(
          vectors[i], coef[i] * np.asarray(weights.decoders[layers[i]])[
              ids[i]], rtol=1e-6)
  held = seq - 2  # A prefix: features at the last two positions read 0.
  grad = np.random.default_rng(3).standard_normal(
      (batch, LAYERS, held, WIDTH)).astype(np.float32)
  expected = np.zeros((batch, n), np.float32)
  for i in range(n):
    if positions[i] >= held:
      continue
    g = grad[:, :, positions[i]]  # [B, L, D]
    expected[:, i] = (np.einsum("bld,ld->b", g, vectors[i]) if cross_layer
                      else g[:, layers[i]] @ vectors[i])
  sources = feature_sources(weights, layers, positions, ids, coef, 32,
                            jnp.asarray)
  got = jax.jit(feature_edges, static_argnums=2)(grad, sources, chunk)
  assert got.shape == (batch, 32)
  np.testing.assert_allclose(np.asarray(got)[:, :n], expected, rtol=1e-5,
                             atol=1e-5)
  assert not np.asarray(got)[:, n:].any()  # Padding reads zero.


def test_encoder_rows_are_the_scaled_columns():
  weights = _weights(False, scaled=True)
  layers, _, ids, _ = _features(12, 4)
  got = weights.encoder_rows(layers, ids)
  for i in range(len(ids)):
    column = np.asarray(weights.encoders[layers[i]])[:, ids[i]]
    np.testing.assert_allclose(got[i], column * weights.scales[layers[i]][
        ids[i]], rtol=1e-6)
  clt = _weights(True)
  got = clt.encoder_rows(layers, ids)
  np.testing.assert_allclose(
      got, np.asarray(clt.encoders)[layers, :, ids], rtol=1e-6)


def _transcoder(layer: int, arrays: dict, rescale: bool) -> SparseAutoencoder:
  cfg = SAEConfig(
      activation="relu", num_features=16,
      input_axes=(("embedding", 32),), output_axes=(("embedding", 32),),
      hook_point=f"blocks.{layer}.mlp_in",
      output_point=f"blocks.{layer}.mlp_out",
      rescale_acts_by_decoder_norm=rescale)
  return SparseAutoencoder.from_arrays(cfg, **arrays)


def test_decoder_norm_rescaling_is_the_equivalent_plain_graph():
  """``pre = (x @ w_enc + b_enc) * |w_dec|``, ``out = acts / |w_dec| @
  w_dec``: the same transcoder as ``w_enc * |w_dec|``, ``b_enc *
  |w_dec|``, ``w_dec / |w_dec|`` without rescaling."""
  model = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  rescaled, plain = [], []
  for layer in range(3):
    a = random_arrays(32, 16, 32, seed=20 + layer, threshold=False)
    a["w_dec"] = a["w_dec"] * np.linspace(0.5, 3.0, 16)[:, None].astype(
        np.float32)
    norms = np.linalg.norm(a["w_dec"], axis=1)
    rescaled.append(_transcoder(layer, a, True))
    plain.append(_transcoder(layer, {
        **a, "w_enc": a["w_enc"] * norms, "b_enc": a["b_enc"] * norms,
        "w_dec": a["w_dec"] / norms[:, None]}, False))
  prompt = [1, 5, 9, 13, 2, 7]
  got = circuits.attribute(model, rescaled, prompt, zero_positions=0)
  want = circuits.attribute(model, plain, prompt, zero_positions=0)
  np.testing.assert_array_equal(got.active_features, want.active_features)
  np.testing.assert_allclose(got.activation_values, want.activation_values,
                             rtol=1e-5)
  assert np.abs(want.edges).max() > 0.1
  np.testing.assert_allclose(got.edges, want.edges, rtol=1e-4,
                             atol=1e-5 * np.abs(want.edges).max())
