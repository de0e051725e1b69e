"""Q4_0 and Q4_1 prompt products with float activations on weights in tiles
of 16 outputs (`tiles.float_gemm`, `gemm_float.cc`), and the quantized
layers that put a prompt's products on it (`ops.float_gemm`)."""

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
from penzai_lm.quantization import formats
from penzai_lm.quantization import quantize

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason="no C++ compiler for the kernels")


def _weight(fmt, n, k, seed=0):
  w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
  q = formats.quantize(w, fmt)
  return q, tiles.to_tiles(q.qs, q.scale, *([q.mins] if fmt == "q4_1" else []))


# Panels of 48 outputs and a last one of 16 or 32; K in one piece or in
# several (up to 256 values each); rows in passes of 8 and a remainder, and
# in chunks of 256.
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("n,k,rows", [(16, 32, 1), (48, 64, 17), (80, 96, 9),
                                      (576, 576, 128), (1536, 576, 33),
                                      (576, 1536, 20), (32, 1056, 300)])
def test_the_product_is_the_dequantized_weights_product(fmt, n, k, rows):
  q, arrays = _weight(fmt, n, k)
  x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
  w = np.asarray(formats.dequantize(q.qs, q.scale, q.mins, fmt), np.float64)
  # The weights the GEMM multiplies are exactly the dequantized ones.
  np.testing.assert_array_equal(np.asarray(tiles.dequantize(*arrays)),
                                w.astype(np.float32))
  want = x.astype(np.float64) @ w.T
  got = np.asarray(jax.jit(tiles.float_gemm)(x, *arrays))
  # K float32 multiply-adds in a chain: a few roundings of the largest.
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=4e-6 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_a_row_gets_the_same_sums_in_any_batch(fmt):
  _, arrays = _weight(fmt, 112, 576)
  x = np.random.default_rng(2).standard_normal((300, 576)).astype(np.float32)
  gemm = jax.jit(tiles.float_gemm)
  batch = np.asarray(gemm(x, *arrays))
  for r in (0, 7, 8, 255, 256, 299):
    for start in (r, max(0, r - 3)):
      alone = np.asarray(gemm(x[start:r + 1], *arrays))[-1]
      np.testing.assert_array_equal(alone, batch[r])


def test_other_formats_and_shapes_are_refused():
  _, q8 = _weight("q8_0", 32, 64)
  with pytest.raises(ValueError, match="tiles.float_gemm takes"):
    tiles.float_gemm(np.zeros((20, 64), np.float32), *q8)
  _, q4 = _weight("q4_0", 32, 64)
  with pytest.raises(ValueError, match=r"tiles.float_gemm: x \(20, 32\)"):
    tiles.float_gemm(np.zeros((20, 32), np.float32), *q4)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_a_prompt_runs_on_the_gemm_where_the_build_has_it(fmt):
  config = TransformerConfig(
      family="llama", vocab_size=96, hidden_size=64, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=96,
      max_position_embeddings=64, tie_embeddings=True)
  float_model = build_transformer(config, seed=0)
  tiled = with_cpu_kernels(quantize(float_model, fmt))
  in_rows = with_cpu_kernels(quantize(float_model, fmt, cpu_tiles=False))
  assert all(l.tiled == ops.q4_float_tiles() for l in pz.select(tiled)
             .at_instances_of(QuantizedLinear).get_sequence())
  ids = pz.nx.wrap(np.random.default_rng(0).integers(
      1, 96, (2, 24)).astype(np.int32)).tag("batch", "seq")
  fn = jax.jit(lambda m: m(ids).untag("batch", "seq",
                                      "vocabulary").data_array)
  # 48 rows: more than a decode step's, a prompt's products.
  hlo = fn.lower(tiled).as_text()
  assert (f"pzlm_gemm_{fmt}_tiles" in hlo) == (
      ops.q4_float_tiles() and ops.float_gemm())
  want = np.asarray(fn(in_rows))  # XLA's GEMM on the dequantized rows
  np.testing.assert_allclose(np.asarray(fn(tiled)), want, rtol=0,
                             atol=1e-5 * np.abs(want).max())
