"""Q4_0, Q8_0, Q4_1, Q5_0 and q8_16 weights in tiles of 16 outputs
(`penzai_lm.kernels.tiles`): the layout, and a quantized model's layers
moving into it. The product itself is tested with the other
int8-activation products (`test_int8_activations.py`)."""

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
from penzai_lm.quantization import QuantizedEmbeddingLookup
from penzai_lm.quantization import QuantizedLinear
from penzai_lm.quantization import formats
from penzai_lm.quantization import quantize


@pytest.mark.parametrize("fmt,dtype,p", [("q4_0", np.uint8, 16),
                                         ("q8_0", np.int8, 32),
                                         ("q4_1", np.uint8, 16),
                                         ("q8_16", np.int8, 32)])
def test_the_layout_puts_output_j_in_lane_j(fmt, dtype, p):
  rng = np.random.default_rng(0)
  n, k = 48, 96
  group = 16 if fmt == "q8_16" else 32  # values a scale
  info = np.iinfo(dtype)
  qs = rng.integers(info.min, info.max + 1, (n, k // 32 * p), dtype=dtype)
  scale = rng.standard_normal((n, k // group)).astype(np.float32)
  mins = rng.standard_normal((n, k // group)).astype(np.float32)
  if fmt in ("q4_1", "q8_16"):  # float32 scales and offsets (K-quants')
    rows = (qs, scale, mins)
  else:  # float16 scales, as in the files
    rows = (qs, scale.astype(np.float16).astype(np.float32))
  qs_t, *scales_t = tiles.to_tiles(*rows)
  assert tiles.tile_format(qs_t, *scales_t) == fmt
  assert isinstance(qs_t, np.ndarray)  # numpy in, numpy out
  assert len(scales_t) == len(rows) - 1
  for scale_t in scales_t:
    assert scale_t.dtype == (np.float16 if len(rows) == 2 else np.float32)
    assert scale_t.shape == (3, k // group * 16)
  assert qs_t.shape == (3, 3 * 16 * p)
  for t, b, d, j, i in [(0, 0, 0, 0, 0), (2, 1, 3, 15, 2), (1, 2, 1, 7, 3),
                        (2, 2, p // 4 - 1, 9, 1)]:
    assert qs_t[t, 16 * p * b + 64 * d + 4 * j + i] == qs[16 * t + j,
                                                            p * b + 4 * d + i]
    for scale_t, scale in zip(scales_t, rows[1:]):
      for g in range(32 // group):  # the block's groups
        at = 32 // group * b + g
        assert scale_t[t, 16 * at + j] == scale[16 * t + j, at]
  back = tiles.from_tiles(qs_t, *scales_t)
  assert len(back) == len(rows)
  for got, want in zip(back, rows):
    np.testing.assert_array_equal(got, want)


def test_q5_0_holds_5_bit_values_in_nibbles_and_a_5th_bit_word():
  """Q8_0 rows of values in [-16, 15] (Q5_0 blocks as the loader keeps
  them) -> 20 bytes an output a block: Q4_0's nibbles of value + 16, then
  4 bytes whose bit e of byte i is the 5th bit of value 4 e + i."""
  rng = np.random.default_rng(5)
  n, k = 32, 96
  qs = rng.integers(-16, 16, (n, k), dtype=np.int8)
  scale = rng.standard_normal((n, k // 32)).astype(np.float16).astype(
      np.float32)
  assert tiles.five_bits(qs) and not tiles.five_bits(qs.astype(np.int16))
  qs_t, scale_t = tiles.to_tiles(qs, scale, fmt="q5_0")
  assert qs_t.dtype == np.uint8 and qs_t.shape == (2, 3 * 16 * 20)
  assert tiles.tile_format(qs_t, scale_t) == "q5_0"
  u = qs.astype(np.int32) + 16
  for t, b, d, j, i in [(0, 0, 0, 0, 0), (1, 2, 3, 15, 3), (1, 1, 2, 6, 1)]:
    o, base = 16 * t + j, 320 * b
    byte = qs_t[t, base + 64 * d + 4 * j + i]
    assert byte & 15 == u[o, 32 * b + 4 * d + i] & 15
    assert byte >> 4 == u[o, 32 * b + 16 + 4 * d + i] & 15
    high = qs_t[t, base + 256 + 4 * j + i]
    for e in range(8):
      assert (high >> e) & 1 == u[o, 32 * b + 4 * e + i] >> 4
  for got, want in zip(tiles.from_tiles(qs_t, scale_t), (qs, scale)):
    np.testing.assert_array_equal(got, want)
  # jax arrays tile the same, and rows come back the same from the tiles.
  on_jax = tiles.to_tiles(jax.numpy.asarray(qs), jax.numpy.asarray(scale),
                          fmt="q5_0")
  np.testing.assert_array_equal(np.asarray(on_jax[0]), qs_t)
  ids = jax.numpy.array([0, 17, 31], jax.numpy.int32)
  got_qs, got_scale = tiles.rows(ids, *on_jax)
  np.testing.assert_array_equal(np.asarray(got_qs), qs[[0, 17, 31]])
  np.testing.assert_array_equal(np.asarray(got_scale), scale[[0, 17, 31]])
  qs[3, 40] = 16  # a 6-bit value: not Q5_0
  assert not tiles.five_bits(qs)
  with pytest.raises(ValueError, match=r"in \[-16, 15\]"):
    tiles.to_tiles(qs, scale, fmt="q5_0")


def test_leading_axes_are_kept():
  rng = np.random.default_rng(1)
  qs = rng.integers(0, 256, (2, 3, 32, 64), dtype=np.uint8)
  scale = rng.standard_normal((2, 3, 32, 4)).astype(np.float16).astype(
      np.float32)
  qs_t, scale_t = tiles.to_tiles(qs, scale)
  assert qs_t.shape == (2, 3, 2, 4 * 256)
  np.testing.assert_array_equal(qs_t[1, 2], tiles.to_tiles(qs[1, 2],
                                                           scale[1, 2])[0])
  for got, want in zip(tiles.from_tiles(qs_t, scale_t), (qs, scale)):
    np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not ops.available(),
                    reason="no C++ compiler for the kernels")
@pytest.mark.parametrize("n,k", [(16, 32), (48, 576), (32, 1536)])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_1", "q5_0", "q8_16"])
def test_dequantized_from_tiles_bit_for_bit(n, k, fmt):
  """A prompt's weight, dequantized from the tiles, is the one its rows
  give (`formats.dequantize`; `ops.dequantize` for the 4-bit formats, as
  a prompt in rows dequantizes them)."""
  rng = np.random.default_rng(2)
  scale = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float16).astype(
      np.float32)
  if fmt == "q4_0":
    qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    rows = (qs, scale)
    want = np.asarray(ops.dequantize(qs, scale, -8 * scale))
  elif fmt == "q4_1":
    qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = scale * np.float32(1 / 3)  # no float16 (as Q4_K's products)
    mins = rng.uniform(-0.5, 0, (n, k // 32)).astype(np.float32)
    rows = (qs, scale, mins)
    want = np.asarray(ops.dequantize(qs, scale, mins))
  elif fmt == "q5_0":
    qs = rng.integers(-16, 16, (n, k), dtype=np.int8)
    rows = (qs, scale)
    want = np.asarray(formats.dequantize(qs, scale, None, "q8_0"))
  elif fmt == "q8_16":  # as the kernel in rows dequantizes it
    qs = rng.integers(-32, 32, (n, k), dtype=np.int8)
    scale = rng.uniform(1e-3, 0.1, (n, k // 16)).astype(np.float32)
    rows = (qs, scale, rng.uniform(-1, 0, (n, k // 16)).astype(np.float32))
    want = np.asarray(ops.dequantize(*rows))
  else:
    qs = rng.integers(-128, 128, (n, k), dtype=np.int8)
    rows = (qs, scale)
    want = np.asarray(formats.dequantize(qs, scale, None, "q8_0"))
  got = np.asarray(tiles.dequantize(*tiles.to_tiles(
      *rows, fmt=fmt)))
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="tiles of 16 outputs"):
    tiles.dequantize(np.zeros((1, 255), np.uint8), np.zeros((1, 16),
                                                            np.float16))


def test_scales_a_float16_does_not_hold_are_refused():
  scale = np.full((16, 2), 0.1, np.float32)  # 0.1 is no float16
  assert not tiles.holds(scale)
  assert tiles.holds(scale.astype(np.float16).astype(np.float32))
  with pytest.raises(ValueError, match="not all float16s"):
    tiles.to_tiles(np.zeros((16, 32), np.uint8), scale)


@pytest.mark.parametrize("n,k", [(24, 64), (32, 48), (0, 64)])
def test_shapes_that_do_not_tile_are_refused(n, k):
  assert not tiles.tileable(n, k)
  with pytest.raises(ValueError, match="N % 16 == 0"):
    tiles.to_tiles(np.zeros((n, k // 2), np.uint8),
                   np.zeros((n, max(k // 32, 1)), np.float32))


def _model(fmt):
  """A small quantized model; "q5_0": Q8_0 whose values are clipped to
  [-16, 15], as Q5_0 blocks load; "q8_16": Q8_0 with a scale and an
  offset per group of 16, as K-quants load."""
  config = TransformerConfig(
      family="llama", vocab_size=97, hidden_size=64, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=96,
      max_position_embeddings=256)
  # In rows (cpu_tiles=False), to move them here.
  model = quantize(build_transformer(config, seed=0),
                   "q8_0" if fmt in ("q5_0", "q8_16") else fmt,
                   cpu_tiles=False)
  if fmt == "q5_0":
    return pz.select(model).at_instances_of(QuantizedLinear).apply(
        lambda l: dataclasses.replace(l, qs=dataclasses.replace(
            l.qs, value=pz.nx.nmap(lambda q: q.clip(-16, 15))(l.qs.value))))
  if fmt == "q8_16":
    def groups_of_16(l):
      scale = l.scale.value.untag("quant_groups")
      scale = pz.nx.nmap(lambda s: s.repeat(2) * np.float32(0.75))(
          scale).tag("quant_groups")
      mins = pz.nx.nmap(lambda s: -s * np.arange(1, s.shape[0] + 1))(
          scale.untag("quant_groups")).tag("quant_groups")
      return dataclasses.replace(
          l, format="q8_16",
          scale=dataclasses.replace(l.scale, value=scale),
          mins=pz.ParameterValue(value=mins,
                                 label=l.scale.label.replace(".scale",
                                                             ".mins")))
    return pz.select(model).at_instances_of(QuantizedLinear).apply(
        groups_of_16)
  return model


@pytest.mark.skipif(not ops.available(),
                    reason="no C++ compiler for the kernels")
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_1", "q5_0", "q8_16"])
def test_int8_activations_move_layers_into_tiles(fmt):
  model = _model(fmt)
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
      assert new.qs.label == old.qs.label
      # Q4_0's offsets (-8 scales) are dropped; Q4_1's and q8_16's move.
      assert (new.mins is None) == (fmt not in ("q4_1", "q8_16"))
      assert set(new.qs.value.named_shape) == {"blocks", "quant_tiles",
                                               "quant_tile_bytes"}
      # Read back in rows, the weight is the same.
      scales = [(new.scale, old.scale)] + (
          [(new.mins, old.mins)] if new.mins is not None else [])
      qs, *got = tiles.from_tiles(
          new.qs.value.order_as("blocks", "quant_tiles",
                                "quant_tile_bytes").data_array,
          *(a.value.order_as("blocks", "quant_tiles",
                             "quant_tile_scales").data_array
            for a, _ in scales))
      np.testing.assert_array_equal(qs, old.qs.value.order_as(
          "blocks", "quant_out", "quant_in").data_array)
      for g, (_, want) in zip(got, scales):
        np.testing.assert_array_equal(g, want.value.order_as(
            "blocks", "quant_out", "quant_groups").data_array)
  tokens = pz.nx.wrap(np.random.default_rng(0).integers(
      1, 97, (2, 3)).astype(np.int32)).tag("batch", "seq")
  fn = jax.jit(lambda m: m(tokens).untag("batch", "seq", "vocabulary")
               .data_array)
  assert f"pzlm_matvec_{fmt}_x8_tiles" in fn.lower(x8).as_text()
  # Against the same products in rows: only the float sums' order moves.
  in_rows = pz.select(model).at_instances_of(QuantizedLinear).apply(
      lambda l: dataclasses.replace(l, use_cpu_kernel=True,
                                    int8_activations=True))
  want, got = np.asarray(fn(in_rows)), np.asarray(fn(x8))
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=1e-4 * np.abs(want).max())
  # A prompt (more rows than a decode step) runs on the tiles too, with
  # int8 activations, where the int8 dots have VNNI (without AMX; in rows,
  # and on the tiles without VNNI, prompts run in float).
  long = pz.nx.wrap(np.random.default_rng(1).integers(
      1, 97, (2, 24)).astype(np.int32)).tag("batch", "seq")
  prompt = jax.jit(lambda m: m(long).untag("batch", "seq", "vocabulary")
                   .data_array)
  if ops.int8_gemm_isa() != "amx":
    on_tiles = f"pzlm_matvec_{fmt}_x8_tiles" in prompt.lower(x8).as_text()
    assert on_tiles == ops.int8_tile_prompts(), ops.int8_dot_isa()
  in_float = np.asarray(prompt(in_rows))
  np.testing.assert_allclose(np.asarray(prompt(x8)), in_float, rtol=0,
                             atol=5e-2 * np.abs(in_float).max())
  # Going on the kernels again keeps the tiles as they are.
  again = with_cpu_kernels(x8, int8_activations=True)
  assert [l.tiled for l in pz.select(again).at_instances_of(
      QuantizedLinear).get_sequence()] == [l.tiled for l in after]


@pytest.mark.skipif(not ops.available(),
                    reason="no C++ compiler for the kernels")
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_1"])
def test_a_tied_table_moves_once_for_its_lookup_and_unembedding(fmt):
  config = TransformerConfig(
      family="llama", vocab_size=96, hidden_size=64, num_layers=1,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=96,
      max_position_embeddings=64, tie_embeddings=True)
  model = quantize(build_transformer(config, seed=0), fmt, cpu_tiles=False)
  x8 = with_cpu_kernels(model, int8_activations=True)
  lookup, = pz.select(x8).at_instances_of(
      QuantizedEmbeddingLookup).get_sequence()
  unembed, = [l for l in pz.select(x8).at_instances_of(
      QuantizedLinear).get_sequence() if l.qs.label == lookup.qs.label]
  assert lookup.tiled and unembed.tiled
  # One copy: both hold the very same tiles.
  assert lookup.qs.value.data_array is unembed.qs.value.data_array
  assert lookup.scale.value.data_array is unembed.scale.value.data_array
  if fmt == "q4_1":
    assert lookup.mins.value.data_array is unembed.mins.value.data_array
  # The lookup's embeddings are the rows' exactly.
  ids = pz.nx.wrap(np.array([[0, 17, 95, 16]], np.int32)).tag("batch", "seq")
  old, = pz.select(model).at_instances_of(
      QuantizedEmbeddingLookup).get_sequence()
  np.testing.assert_array_equal(
      np.asarray(lookup(ids).untag("batch", "seq", "embedding").data_array),
      np.asarray(old(ids).untag("batch", "seq", "embedding").data_array))


@pytest.mark.skipif(not ops.available(),
                    reason="no C++ compiler for the kernels")
def test_a_layer_whose_scales_left_float16_stays_in_rows():
  layer = pz.select(_model("q4_0")).at_instances_of(
      QuantizedLinear).get_sequence()[0]
  edited = dataclasses.replace(layer, scale=pz.ParameterValue(
      value=layer.scale.value * 1.0001, label=layer.scale.label))
  assert layer.on_cpu_kernels(True).tiled
  moved = edited.on_cpu_kernels(True)
  assert moved.int8_activations and not moved.tiled


@pytest.mark.skipif(not ops.available(),
                    reason="no C++ compiler for the kernels")
def test_donate_deletes_the_rows_that_moved():
  config = TransformerConfig(
      family="llama", vocab_size=96, hidden_size=64, num_layers=1,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=96,
      max_position_embeddings=64, tie_embeddings=True)
  model = quantize(build_transformer(config, seed=0), "q4_0",
                   cpu_tiles=False)
  kept = with_cpu_kernels(model, int8_activations=True)
  layers = pz.select(model).at_instances_of(QuantizedLinear).get_sequence()
  x8 = with_cpu_kernels(model, int8_activations=True, donate=True)
  assert all(l.qs.value.data_array.is_deleted()
             and l.mins.value.data_array.is_deleted() for l in layers)
  tokens = pz.nx.wrap(np.array([[3, 50, 95]], np.int32)).tag("batch", "seq")
  fn = jax.jit(lambda m: m(tokens).untag("batch", "seq", "vocabulary")
               .data_array)
  np.testing.assert_array_equal(np.asarray(fn(x8)), np.asarray(fn(kept)))
  with pytest.raises(RuntimeError, match="deleted"):
    fn(model)
  with pytest.raises(ValueError, match="int8_activations=True too"):
    with_cpu_kernels(kept, donate=True)
