"""The quantized products with int8 activations (`matvec_x8.cc`).

Each is checked two ways: against numpy on the same int8 activations
(`ops.quantize_rows`: integer dot products, so float rounding only), and
against the float product, within the bound that the activations' rounding
allows (|x - q * d| <= d / 2 per value). The library built for this machine
uses its best instructions (`ops.int8_dot_isa`); `test_isa_paths.py` runs
this file again on every other path this CPU can run (AVX-512 without VNNI,
AVX2, portable).
"""

import jax
import numpy as np
import pytest
from penzai import pz

from penzai_lm.kernels import build
from penzai_lm.kernels import ops
from penzai_lm.kernels import tiles
from penzai_lm.kernels import with_cpu_kernels
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer
from penzai_lm.quantization import QuantizedLinear
from penzai_lm.quantization import quantize

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason="no C++ compiler for the kernels")

# (rows, K, N): one block (K = 32: only the half step), a half step at the
# end (96, 544), rows past the 4-row passes, N off the 4-output blocks.
SHAPES = [(1, 576, 1536), (3, 96, 7), (5, 32, 9), (17, 1536, 13),
          (8, 544, 33), (2, 64, 1)]
# Two passes over the rows in each chunk of 64 outputs, several chunks in a
# thread's tile, and a last tile that ends inside a group of 4 outputs.
SHAPES += [(6, 64, 1030)]
# Prompt-sized: on the AMX tiles where ops.int8_gemm_isa() == "amx" (rows
# past the 16-row tiles, N past the 16-output strips, an odd number of
# groups of 32, K = 32: one group).
SHAPES += [(40, 96, 37), (128, 576, 192), (33, 32, 16), (20, 1536, 17)]


def _x(rows, k, seed=0):
  x = np.random.default_rng(seed).standard_normal((rows, k), np.float32)
  x[0, :32] = 0  # an all-zero block: d = 0
  if rows > 1:
    x[1, -32:] *= 1e4  # a block far larger than the rest of its row
  return x


def _q8(n, k, blocks, seed=2):
  rng = np.random.default_rng(seed)
  qs = rng.integers(-128, 128, (n, k), dtype=np.int8)
  qs[0, :5] = -128  # |w| = 128 must not overflow a signed byte
  # float16 scales, as Q8_0's (and tiles') are
  scale = rng.uniform(1e-3, 1e-1, (n, blocks)).astype(np.float16).astype(
      np.float32)
  w = (qs.astype(np.float64).reshape(n, blocks, -1)
       * scale[..., None]).reshape(n, k)
  return qs, scale, w


def _q4(n, k, seed=3, centered=False):
  """4-bit blocks with offsets of their own (q4_1), or ``centered`` ones,
  -8 scales (q4_0)."""
  rng = np.random.default_rng(seed)
  qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
  scale = rng.uniform(1e-3, 1e-1, (n, k // 32)).astype(np.float16).astype(
      np.float32)  # float16 scales, as Q4_0's and Q4_1's (and tiles') are
  mins = rng.uniform(-1, 0, (n, k // 32)).astype(np.float32)
  if centered:
    mins = -8 * scale
  blocks = qs.reshape(n, k // 32, 16)  # ggml's nibble order
  nibbles = np.concatenate([blocks & 15, blocks >> 4], -1).astype(np.float64)
  w = (nibbles * scale[..., None] + mins[..., None]).reshape(n, k)
  return qs, scale, mins, w


def _q8_16(n, k, seed=4):
  """int8 groups of 16 with a scale and an offset each (kept K-quants:
  values up to 6 bits here, and full int8 in the first row)."""
  rng = np.random.default_rng(seed)
  qs = rng.integers(-32, 32, (n, k), dtype=np.int8)
  qs[0] = rng.integers(-128, 128, k, dtype=np.int8)
  scale = rng.uniform(1e-3, 1e-1, (n, k // 16)).astype(np.float32)
  mins = rng.uniform(-1, 1, (n, k // 16)).astype(np.float32)
  w = (qs.astype(np.float64).reshape(n, k // 16, 16) * scale[..., None]
       + mins[..., None]).reshape(n, k)
  return qs, scale, mins, w


def _dequantized_x(x):
  q, d = ops.quantize_rows(x)
  rows, k = x.shape
  return (q.astype(np.float64).reshape(rows, k // 32, 32)
          * d[..., None].astype(np.float64)).reshape(rows, k)


def _step_error(d):
  """The most a rounded activation is off in a block of unrounded scale d:
  half a step, and 127 times the scale's float16 rounding."""
  d16 = d.astype(np.float16).astype(np.float64)
  return d / 2 + 127 * np.abs(d - d16)


def _rounding_bound(x, w):
  """|x8 product - float product| <= sum |w| * step error (+ float
  rounding)."""
  rows, k = x.shape
  d = (np.abs(x.reshape(rows, k // 32, 32)).max(-1) / np.float32(127)
       ).astype(np.float32).astype(np.float64)
  half = np.repeat(_step_error(d), 32, axis=1)
  return half @ np.abs(w).T * (1 + 1e-5) + 1e-5 * np.abs(x) @ np.abs(w).T


def _check(got, x, w):
  """``got`` against numpy on the int8 activations, and the float bound."""
  want = _dequantized_x(x) @ w.T
  scale = np.abs(x) @ np.abs(w).T
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale.max())
  exact = x.astype(np.float64) @ (w.T)
  assert (np.abs(got - exact) <= _rounding_bound(x, w)).all()


def test_prompts_run_on_the_amx_tiles_where_the_cpu_has_them():
  """The native build on a CPU with AMX-INT8 takes prompt-sized products
  to the tiles (gemm_x8.cc); the SHAPES with 17 rows or more test them."""
  flags = set(build._cpu_fingerprint().split())  # pylint: disable=protected-access
  if build.isa() != "native" or not {"amx_int8", "amx_tile"} <= flags:
    pytest.skip("NO AMX HERE: the prompt-sized shapes ran on the row"
                f" products ({ops.int8_dot_isa()}), not on the tiles")
  assert ops.int8_gemm_isa() == "amx"
  assert ops.GEMM_ROWS == 17 and max(r for r, _, _ in SHAPES) >= 128


def test_quantize_rows_follows_q8_0():
  x = _x(3, 96)
  q, d = ops.quantize_rows(x)
  blocks = x.reshape(3, 3, 32)
  exact = np.abs(blocks).max(-1) / np.float32(127)
  # block_q8_0 keeps its scale as a float16; q is rounded with the exact one.
  np.testing.assert_array_equal(d, exact.astype(np.float16).astype(np.float32))
  assert not np.array_equal(d, exact)
  inv = np.where(exact > 0, np.float32(1) / np.where(exact > 0, exact, 1), 0)
  np.testing.assert_array_equal(
      q.reshape(3, 3, 32), np.rint(blocks * inv[..., None].astype(np.float32)))
  assert d[0, 0] == 0 and (q[0, :32] == 0).all()
  assert np.abs(q).max() == 127
  err = np.abs(q.reshape(3, 3, 32) * d[..., None].astype(np.float64) - blocks)
  bound = _step_error(exact.astype(np.float64))
  assert (err <= bound[..., None] * (1 + 1e-6)).all()


@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("per_output", [False, True])
def test_q8_int8_activations(rows, k, n, per_output):
  qs, scale, w = _q8(n, k, 1 if per_output else k // 32)
  x = _x(rows, k)
  got = np.asarray(jax.jit(lambda *a: ops.q8(*a, int8_activations=True))(
      x, qs, scale))
  assert got.shape == (rows, n) and got.dtype == np.float32
  _check(got, x, w)


@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("fmt", ["q4", "q4_0", "q4_0-derived", "q8_16"])
def test_grouped_int8_activations(rows, k, n, fmt):
  """Formats with a scale and an offset per group (q4_1, kept K-quants;
  q4_0, whose offsets the tiles fold into the nibbles, given as mins or,
  "q4_0-derived", derived from the scales with mins=None)."""
  centered = lambda n, k: _q4(n, k, centered=True)  # pylint: disable=unnecessary-lambda-assignment
  make, product = {"q4": (_q4, ops.q4), "q8_16": (_q8_16, ops.q8_16),
                   "q4_0": (centered, ops.q4),
                   "q4_0-derived": (centered, ops.q4)}[fmt]
  qs, scale, mins, w = make(n, k)
  if fmt == "q4_0-derived":
    mins = None
  x = _x(rows, k)
  got = np.asarray(jax.jit(lambda *a: product(*a, int8_activations=True))(
      x, qs, scale, mins))
  assert got.shape == (rows, n) and got.dtype == np.float32
  _check(got, x, w)


# N % 16 == 0 (tiles of 16 outputs): one tile, one block (K = 32), rows
# past the 4-row passes and several chunks of 4 tiles per thread.
TILE_SHAPES = [(1, 576, 1536), (3, 96, 16), (5, 32, 48), (17, 1536, 32),
               (8, 544, 64), (6, 64, 1040), (16, 1536, 576)]


@pytest.mark.parametrize("rows,k,n", TILE_SHAPES)
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_1", "q5_0", "q8_16"])
def test_in_tiles(rows, k, n, fmt):
  """Q4_0, Q8_0, Q4_1, Q5_0 and q8_16 in tiles of 16 outputs
  (`matvec_tiles.cc`): the same product as in rows, up to the order of the
  float sums."""
  if fmt == "q8_16":
    qs, scale, mins, w = _q8_16(n, k)
    weight = (qs, scale, mins)
    in_rows = ops.q8_16(_x(rows, k), qs, scale, mins, int8_activations=True)
  elif fmt in ("q8_0", "q5_0"):
    qs, scale, w = _q8(n, k, k // 32)
    if fmt == "q5_0":  # Q5_0's values, in Q8_0 rows as the loader keeps them
      qs = qs.clip(-16, 15)
      w = qs.astype(np.float64) * np.repeat(scale, 32, axis=1)
    weight = (qs, scale)
    in_rows = ops.q8(_x(rows, k), qs, scale, int8_activations=True)
  else:
    qs, scale, mins, w = _q4(n, k, centered=fmt == "q4_0")
    weight = (qs, scale) if fmt == "q4_0" else (qs, scale, mins)
    in_rows = ops.q4(_x(rows, k), qs, scale,
                     None if fmt == "q4_0" else mins, int8_activations=True)
  x = _x(rows, k)
  got = np.asarray(jax.jit(tiles.product)(
      x, *tiles.to_tiles(*weight, fmt=fmt)))
  assert got.shape == (rows, n) and got.dtype == np.float32
  _check(got, x, w)
  in_rows = np.asarray(in_rows)
  np.testing.assert_allclose(got, in_rows, rtol=0,
                             atol=1e-6 * (np.abs(x) @ np.abs(w).T).max())


def test_non_finite_activations_give_nan_rows():
  qs, scale, _ = _q8(8, 64, 2)
  q4s, s4, m4, _ = _q4(8, 64)
  x = _x(3, 64)
  x[1, 40] = np.inf
  x[2, 3] = np.nan
  g16 = _q8_16(8, 64)[:3]
  for got in (ops.q8(x, qs, scale, int8_activations=True),
              ops.q4(x, q4s, s4, m4, int8_activations=True),
              ops.q8_16(x, *g16, int8_activations=True),
              tiles.product(x, *tiles.to_tiles(*_q4(16, 64)[:2])),
              tiles.product(x, *tiles.to_tiles(*_q4(16, 64)[:3])),
              tiles.product(x, *tiles.to_tiles(*_q8(16, 64, 2)[:2])),
              tiles.product(x, *tiles.to_tiles(
                  _q8(16, 64, 2)[0].clip(-16, 15), _q8(16, 64, 2)[1],
                  fmt="q5_0")),
              tiles.product(x, *tiles.to_tiles(*_q8_16(16, 64)[:3]))):
    got = np.asarray(got)
    assert np.isfinite(got[0]).all() and np.isnan(got[1:]).all()


def test_unsupported_shapes_are_errors():
  with pytest.raises(ValueError, match="K % 32 == 0"):
    ops.q8(_x(1, 48), np.zeros((4, 48), np.int8), np.ones((4, 3), np.float32),
           int8_activations=True)
  with pytest.raises(ValueError, match="K % 32 == 0"):
    ops.q8_16(_x(1, 48), np.zeros((4, 48), np.int8),
              np.ones((4, 3), np.float32), np.ones((4, 3), np.float32),
              int8_activations=True)
  with pytest.raises(ValueError, match="tiles of 16 outputs"):
    tiles.product(_x(1, 64), np.zeros((2, 64 * 8), np.uint8),
                  np.ones((2, 64), np.float16))
  with pytest.raises(ValueError, match="tiles of 16 outputs"):
    tiles.product(_x(1, 64), np.zeros((2, 64 * 8 - 1), np.uint8),
                  np.ones((2, 32), np.float16))
  with pytest.raises(ValueError, match="tiles of 16 outputs"):  # f32 scales
    tiles.product(_x(1, 64), np.zeros((2, 64 * 8), np.uint8),
                  np.ones((2, 32), np.float32))
  with pytest.raises(ValueError, match="float32 scale and mins"):  # Q4_1
    tiles.product(_x(1, 64), np.zeros((2, 64 * 8), np.uint8),
                  np.ones((2, 32), np.float16), np.ones((2, 32), np.float16))
  with pytest.raises(ValueError, match="float32 scale and mins"):  # q8_16
    tiles.product(_x(1, 64), np.zeros((2, 64 * 16), np.int8),
                  np.ones((2, 64), np.float16), np.ones((2, 64), np.float16))
  with pytest.raises(ValueError, match=r"not float32 qs"):
    tiles.product(_x(1, 64), np.zeros((2, 64 * 16), np.float32),
                  np.ones((2, 64), np.float32), np.ones((2, 64), np.float32))
  with pytest.raises(ValueError, match=r"must be \[R, 64\]"):
    tiles.product(_x(1, 32), np.zeros((2, 64 * 16), np.int8),
                  np.ones((2, 32), np.float16))
  with pytest.raises(ValueError, match="not float32"):
    tiles.product(_x(1, 64), np.zeros((2, 64 * 8), np.float32),
                  np.ones((2, 32), np.float16))
  with pytest.raises(ValueError, match="blocks of 32"):
    ops.q8(_x(1, 64), np.zeros((4, 64), np.int8), np.ones((4, 4), np.float32),
           int8_activations=True)


def _small_model():
  config = TransformerConfig(
      family="llama", vocab_size=97, hidden_size=64, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=96,
      max_position_embeddings=256)
  return build_transformer(config, seed=0)


def _logits(model, shape=(2, 3)):
  tokens = pz.nx.wrap(np.random.default_rng(0).integers(
      1, 97, shape).astype(np.int32)).tag("batch", "seq")
  fn = jax.jit(lambda m, t: m(t).untag("batch", "seq", "vocabulary")
               .data_array)
  return np.asarray(fn(model, tokens)), fn.lower(model, tokens).as_text()


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1"])
def test_with_cpu_kernels_int8_activations(fmt):
  q = quantize(_small_model(), fmt)
  plain = with_cpu_kernels(q)
  x8 = with_cpu_kernels(q, int8_activations=True)
  layers = pz.select(x8).at_instances_of(QuantizedLinear).get_sequence()
  assert layers and all(l.int8_activations and l.use_cpu_kernel
                        for l in layers)
  # A model already on the kernels is switched too; plain stays off.
  again = with_cpu_kernels(plain, int8_activations=True)
  assert all(l.int8_activations for l in pz.select(again).at_instances_of(
      QuantizedLinear).get_sequence())
  want, hlo = _logits(plain)  # 6 rows: the kernels
  assert "pzlm_matvec_q" in hlo and "_x8" not in hlo
  got, hlo = _logits(x8)
  assert "_x8" in hlo
  # Activations rounded to ~1/254 of each block's largest value: logits
  # stay within 2% of their range, and are not bit-equal.
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, atol=2e-2 * scale, rtol=0)
  assert not np.array_equal(got, want)
  # A prompt's rows (more than a decode step's) stay on XLA's dot, in
  # float, without int8 activations; with them, on the AMX tiles where the
  # CPU has them (ops.int8_gemm_isa), else on the weights' tiles of 16
  # outputs where they lie in tiles and the int8 dots have VNNI
  # (ops.int8_tile_prompts), else on XLA's dot as well.
  want, hlo = _logits(plain, (2, 24))
  assert "_x8" not in hlo and "pzlm_matvec_q" not in hlo
  got, hlo = _logits(x8, (2, 24))
  tiled_prompts = any(l.tiled for l in layers) and ops.int8_tile_prompts()
  if ops.int8_gemm_isa() == "amx" or tiled_prompts:
    assert "_x8" in hlo
    # No prompt product in float: Q4_0's and Q4_1's tiles included.
    assert "pzlm_matvec_q4_0_tiles" not in hlo
    assert "pzlm_matvec_q4_1_tiles" not in hlo
    assert "pzlm_gemm_q4" not in hlo
    if ops.int8_gemm_isa() != "amx":
      assert "_x8_tiles" in hlo
    # 48 rows of rounded activations through 2 layers: within 5%.
    np.testing.assert_allclose(got, want, atol=5e-2 * np.abs(want).max(),
                               rtol=0)
  else:
    assert "_x8" not in hlo and "pzlm_matvec_q" not in hlo
    np.testing.assert_array_equal(got, want)
