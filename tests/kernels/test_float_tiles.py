"""Q4_0 and Q4_1 products with float activations on weights in tiles of 16
outputs (`tiles.float_product`, `matvec_q4_tiles.cc`), and the quantized
models that hold those weights in tiles on an AVX-512 CPU
(`penzai_lm.quantization.quantize`, `ops.q4_float_tiles`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.kernels import ops
from penzai_lm.kernels import tiles
from penzai_lm.kernels import with_cpu_kernels
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer
from penzai_lm.quantization import QuantizedEmbeddingLookup
from penzai_lm.quantization import QuantizedLinear
from penzai_lm.quantization import formats
from penzai_lm.quantization import quantize

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason="no C++ compiler for the kernels")


def _weight(fmt, n, k, seed=0):
  w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
  q = formats.quantize(jnp.asarray(w), fmt)
  arrays = tiles.to_tiles(q.qs, q.scale, *([q.mins] if fmt == "q4_1" else []))
  return q, arrays


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("n,k,rows", [(16, 32, 1), (48, 64, 2), (576, 576, 1),
                                      (1536, 576, 8), (576, 1536, 5),
                                      (64, 96, 13), (160, 320, 3)])
def test_the_product_is_the_dequantized_weights_product(fmt, n, k, rows):
  q, arrays = _weight(fmt, n, k)
  x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
  w = np.asarray(formats.dequantize(q.qs, q.scale, q.mins, fmt), np.float64)
  want = x.astype(np.float64) @ w.T
  got = np.asarray(jax.jit(tiles.float_product)(x, *arrays))
  # Float sums of K products: a few float32 roundings of the largest output.
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_a_row_alone_equals_the_row_in_a_batch(fmt):
  _, arrays = _weight(fmt, 320, 576)
  x = np.random.default_rng(2).standard_normal((12, 576)).astype(np.float32)
  product = jax.jit(tiles.float_product)
  batch = np.asarray(product(x, *arrays))
  for r in range(12):
    np.testing.assert_array_equal(np.asarray(product(x[r:r + 1], *arrays))[0],
                                  batch[r])


def test_other_formats_and_shapes_are_refused():
  _, q8 = _weight("q8_0", 32, 64)
  with pytest.raises(ValueError, match="q8_0"):
    tiles.float_product(np.zeros((1, 64), np.float32), *q8)
  _, q4 = _weight("q4_0", 32, 64)
  with pytest.raises(ValueError, match=r"must be \[R, 64\]"):
    tiles.float_product(np.zeros((1, 32), np.float32), *q4)


def _config(**kwargs):
  return TransformerConfig(
      family="llama", vocab_size=96, hidden_size=64, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=96,
      max_position_embeddings=64, **kwargs)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_quantize_holds_4_bit_weights_in_tiles_where_the_kernels_take_them(
    fmt):
  float_model = build_transformer(_config(tie_embeddings=True), seed=0)
  tiled_model = quantize(float_model, fmt)
  rows_model = quantize(float_model, fmt, cpu_tiles=False)
  layers = pz.select(tiled_model).at_instances_of(
      QuantizedLinear).get_sequence()
  rows = pz.select(rows_model).at_instances_of(QuantizedLinear).get_sequence()
  assert not any(l.tiled for l in rows)
  # Every layer tiles here (N % 16 == 0, K % 32 == 0), on AVX-512 only.
  assert all(l.tiled == ops.q4_float_tiles() for l in layers)
  lookup, = pz.select(tiled_model).at_instances_of(
      QuantizedEmbeddingLookup).get_sequence()
  unembed, = [l for l in layers if l.qs.label == lookup.qs.label]
  assert lookup.tiled == unembed.tiled
  assert lookup.qs.value.data_array is unembed.qs.value.data_array
  # In rows again, the very blocks `cpu_tiles=False` keeps (Q4_0's mins,
  # -8 scales, derived).
  for layer, want in zip(layers, rows):
    back = layer.in_rows()
    assert not back.tiled and back.qs.label == want.qs.label
    for got, kept in [(back.qs, want.qs), (back.scale, want.scale),
                      (back.mins, want.mins)]:
      axes = kept.value.named_axes
      np.testing.assert_array_equal(
          np.asarray(got.value.order_as(*axes).data_array),
          np.asarray(kept.value.order_as(*axes).data_array))
  # The float model's weights are its own still (only the quantized rows
  # `quantize` made were deleted as they moved).
  assert not any(
      p.value.data_array.is_deleted() for p in
      pz.select(float_model).at_instances_of(pz.ParameterValue).get_sequence())
  # On the kernels, decoding (a few rows) runs the float product on the
  # tiles, a prompt dequantizes them; both as the rows model runs.
  tokens = np.random.default_rng(0).integers(1, 96, (2, 24)).astype(np.int32)
  for length in (1, 24):
    ids = pz.nx.wrap(tokens[:, :length]).tag("batch", "seq")
    fn = jax.jit(lambda m, ids=ids: m(ids).untag(
        "batch", "seq", "vocabulary").data_array)
    on_tiles, in_rows = with_cpu_kernels(tiled_model), with_cpu_kernels(
        rows_model)
    if length == 1:
      assert (f"pzlm_matvec_{fmt}_tiles" in fn.lower(on_tiles).as_text()) == (
          ops.q4_float_tiles())
    want = np.asarray(fn(in_rows))
    np.testing.assert_allclose(np.asarray(fn(on_tiles)), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())
    # And without the kernels (the weights read back from the tiles).
    np.testing.assert_allclose(np.asarray(fn(tiled_model)), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())


def test_int8_activations_run_on_the_same_tiles():
  model = quantize(build_transformer(_config(), seed=0), "q4_0")
  x8 = with_cpu_kernels(model, int8_activations=True)
  before = pz.select(model).at_instances_of(QuantizedLinear).get_sequence()
  after = pz.select(x8).at_instances_of(QuantizedLinear).get_sequence()
  assert all(l.tiled for l in after)
  if ops.q4_float_tiles():  # the same arrays: no second copy
    assert all(a.qs.value.data_array is b.qs.value.data_array
               for a, b in zip(before, after))
