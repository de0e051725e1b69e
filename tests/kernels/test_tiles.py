"""Q4_0 weights in tiles of 16 outputs (`penzai_lm.kernels.tiles`): the
layout, and a quantized model's layers moving into it. The product itself
is tested with the other int8-activation products
(`test_int8_activations.py`)."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from penzai import pz

from penzai_lm.kernels import ops
from penzai_lm.kernels import tiles
from penzai_lm.kernels import with_cpu_kernels
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer
from penzai_lm.quantization import QuantizedLinear
from penzai_lm.quantization import quantize


def test_the_layout_puts_output_j_in_lane_j():
  rng = np.random.default_rng(0)
  n, k = 48, 96
  qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
  scale = rng.standard_normal((n, k // 32)).astype(np.float32)
  qs_t, scale_t = map(np.asarray, tiles.to_tiles(qs, scale))
  assert qs_t.shape == (3, 3 * 256) and scale_t.shape == (3, 3 * 16)
  for t, b, d, j, i in [(0, 0, 0, 0, 0), (2, 1, 3, 15, 2), (1, 2, 1, 7, 3)]:
    assert qs_t[t, 256 * b + 64 * d + 4 * j + i] == qs[16 * t + j,
                                                        16 * b + 4 * d + i]
    assert scale_t[t, 16 * b + j] == scale[16 * t + j, b]
  back = tiles.from_tiles(qs_t, scale_t)
  np.testing.assert_array_equal(back[0], qs)
  np.testing.assert_array_equal(back[1], scale)


def test_leading_axes_are_kept():
  rng = np.random.default_rng(1)
  qs = rng.integers(0, 256, (2, 3, 32, 64), dtype=np.uint8)
  scale = rng.standard_normal((2, 3, 32, 4)).astype(np.float32)
  qs_t, scale_t = tiles.to_tiles(qs, scale)
  assert qs_t.shape == (2, 3, 2, 4 * 256)
  np.testing.assert_array_equal(qs_t[1, 2], tiles.to_tiles(qs[1, 2],
                                                           scale[1, 2])[0])
  for got, want in zip(tiles.from_tiles(qs_t, scale_t), (qs, scale)):
    np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not ops.available(),
                    reason="no C++ compiler for the kernels")
@pytest.mark.parametrize("n,k", [(16, 32), (48, 576), (32, 1536)])
def test_dequantized_from_tiles_bit_for_bit(n, k):
  """A prompt's weight, dequantized from the tiles, is the one its rows
  give (`ops.dequantize`, as `formats.dequantize` computes it)."""
  rng = np.random.default_rng(2)
  qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
  scale = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float32)
  got = np.asarray(tiles.dequantize(*tiles.to_tiles(qs, scale)))
  want = np.asarray(ops.dequantize(qs, scale, -8 * scale))
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="tiles of 16 outputs"):
    tiles.dequantize(np.zeros((1, 255), np.uint8), np.zeros((1, 16),
                                                            np.float32))


@pytest.mark.parametrize("n,k", [(24, 64), (32, 48), (0, 64)])
def test_shapes_that_do_not_tile_are_refused(n, k):
  assert not tiles.tileable(n, k)
  with pytest.raises(ValueError, match="N % 16 == 0"):
    tiles.to_tiles(np.zeros((n, k // 2), np.uint8),
                   np.zeros((n, max(k // 32, 1)), np.float32))


def _model():
  config = TransformerConfig(
      family="llama", vocab_size=97, hidden_size=64, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=96,
      max_position_embeddings=256)
  return quantize(build_transformer(config, seed=0), "q4_0")


@pytest.mark.skipif(not ops.available(),
                    reason="no C++ compiler for the kernels")
def test_int8_activations_move_q4_0_layers_into_tiles():
  model = _model()
  x8 = with_cpu_kernels(model, int8_activations=True)
  before = pz.select(model).at_instances_of(QuantizedLinear).get_sequence()
  after = pz.select(x8).at_instances_of(QuantizedLinear).get_sequence()
  # Every projection tiles (N % 16 == 0); the 97-word unembedding cannot.
  assert [l.tiled for l in after] == [
      tiles.tileable(math.prod(s for _, s in l.out_axes),
                     math.prod(s for _, s in l.in_axes)) for l in before]
  assert any(l.tiled for l in after) and not all(l.tiled for l in after)
  for old, new in zip(before, after):
    assert not old.tiled  # the user's model is not changed
    if new.tiled:
      assert new.mins is None and new.qs.label == old.qs.label
      assert set(new.qs.value.named_shape) >= {"quant_tiles",
                                               "quant_tile_bytes"}
      # Read back in rows, the weight is the same.
      qs, scale = tiles.from_tiles(
          new.qs.value.order_as("blocks", "quant_tiles",
                                "quant_tile_bytes").data_array,
          new.scale.value.order_as("blocks", "quant_tiles",
                                   "quant_tile_scales").data_array)
      np.testing.assert_array_equal(qs, old.qs.value.order_as(
          "blocks", "quant_out", "quant_in").data_array)
      np.testing.assert_array_equal(scale, old.scale.value.order_as(
          "blocks", "quant_out", "quant_groups").data_array)
  tokens = pz.nx.wrap(np.random.default_rng(0).integers(
      1, 97, (2, 3)).astype(np.int32)).tag("batch", "seq")
  fn = jax.jit(lambda m: m(tokens).untag("batch", "seq", "vocabulary")
               .data_array)
  assert "pzlm_matvec_q4_0_x8_tiles" in fn.lower(x8).as_text()
  # Against the same products in rows: only the float sums' order moves.
  in_rows = pz.select(model).at_instances_of(QuantizedLinear).apply(
      lambda l: dataclasses.replace(l, use_cpu_kernel=True,
                                    int8_activations=True))
  want, got = np.asarray(fn(in_rows)), np.asarray(fn(x8))
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=1e-4 * np.abs(want).max())
  # A prompt (more rows than a decode step) reads the tiles back as rows.
  long = pz.nx.wrap(np.random.default_rng(1).integers(
      1, 97, (2, 24)).astype(np.int32)).tag("batch", "seq")
  prompt = jax.jit(lambda m: m(long).untag("batch", "seq", "vocabulary")
                   .data_array)
  np.testing.assert_allclose(np.asarray(prompt(x8)),
                             np.asarray(prompt(in_rows)), rtol=0,
                             atol=1e-4 * np.abs(want).max())
  # Going on the kernels again keeps the tiles as they are.
  again = with_cpu_kernels(x8, int8_activations=True)
  assert [l.tiled for l in pz.select(again).at_instances_of(
      QuantizedLinear).get_sequence()] == [l.tiled for l in after]
