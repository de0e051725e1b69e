"""The CPU kernels against numpy, for every weight format and awkward
shapes (K and N off the tile sizes, rows past the per-pass maximum)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.kernels import ops
from penzai_lm.quantization import formats

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason="no C++ compiler for the kernels")

SHAPES = [(1, 576, 1536), (3, 40, 70), (8, 513, 33), (17, 96, 130),
          (5, 1, 9)]
# One pass over 6 rows, many outputs; past 8 rows, passes of 4 rows over
# each chunk of 64 outputs, several chunks in a thread's tile, and a last
# tile that ends inside a group of 4 outputs.
SHAPES += [(6, 64, 1030), (10, 64, 1030)]
# One pass over 7 rows, 2 or 3 outputs side by side, tiles ending inside
# such a group.
SHAPES += [(7, 96, 71)]


def _x(rows, k, seed=0):
  return np.random.default_rng(seed).standard_normal((rows, k), np.float32)


@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("out_major", [False, True])
def test_dense_matches_numpy(rows, k, n, dtype, out_major):
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((n, k) if out_major else (k, n),
                                      np.float32)).astype(dtype)
  x = _x(rows, k)
  w64 = np.asarray(w.astype(jnp.float32), np.float64)
  want = x.astype(np.float64) @ (w64.T if out_major else w64)
  got = np.asarray(jax.jit(ops.dense, static_argnames="out_major")(
      x, w, out_major=out_major))
  assert got.dtype == np.float32 and got.shape == (rows, n)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("rows,k,n", SHAPES + [(2, 33, 5), (1, 1000, 70)])
def test_bfloat16_rows_against_bfloat16_weights(rows, k, n):
  """A bfloat16 model's decode: bfloat16 rows into the product as they are
  (``vdpbf16ps`` where the CPU has AVX-512 BF16), against float64 on the
  same values, K past and inside the 32-value steps."""
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.standard_normal((n, k), np.float32)).astype("bfloat16")
  x = jnp.asarray(_x(rows, k)).astype("bfloat16")
  want = (np.asarray(x.astype(jnp.float32), np.float64)
          @ np.asarray(w.astype(jnp.float32), np.float64).T)
  got = np.asarray(jax.jit(ops.dense, static_argnames="out_major")(
      x, w, out_major=True))
  assert got.dtype == np.float32 and got.shape == (rows, n)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("rows,k,n,block", [
    (1, 576, 1536, 32), (9, 64, 40, 32), (2, 96, 7, 96), (18, 33, 5, 33),
    (8, 64, 41, 32)])
def test_q8_matches_numpy(rows, k, n, block):
  rng = np.random.default_rng(2)
  qs = rng.integers(-128, 128, (n, k), dtype=np.int8)
  scale = rng.uniform(1e-3, 1e-1, (n, k // block)).astype(np.float32)
  x = _x(rows, k)
  w = (qs.astype(np.float64).reshape(n, k // block, block)
       * scale[..., None]).reshape(n, k)
  got = np.asarray(jax.jit(ops.q8)(x, qs, scale))
  np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("rows,k,n", [(1, 576, 1536), (7, 64, 33),
                                      (20, 544, 3), (6, 64, 1030)])
@pytest.mark.parametrize("q4_0", [False, True])
def test_q4_matches_numpy(rows, k, n, q4_0):
  """Offsets of their own (q4_1), or Q4_0's -8 scales derived by the
  kernel (``mins=None``)."""
  rng = np.random.default_rng(3)
  qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
  scale = rng.uniform(1e-3, 1e-1, (n, k // 32)).astype(np.float32)
  mins = rng.uniform(-1, 0, (n, k // 32)).astype(np.float32)
  if q4_0:
    mins = -8 * scale
  # ggml's order: byte j of a block holds value j (low) and j + 16 (high).
  blocks = qs.reshape(n, k // 32, 16)
  nibbles = np.concatenate([blocks & 15, blocks >> 4], -1).astype(np.float64)
  w = (nibbles * scale[..., None] + mins[..., None]).reshape(n, k)
  x = _x(rows, k)
  got = np.asarray(jax.jit(ops.q4)(x, qs, scale, None if q4_0 else mins))
  np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1", "q8_16",
                                 "q8_block64"])
@pytest.mark.parametrize("n,k", [(70, 96), (33, 544), (1, 32)])
def test_dequantize_equals_the_formats_bit_for_bit(fmt, n, k):
  """The prompts' float weights (`dequantize.cc`) against
  `formats.dequantize` (bit for bit where XLA fuses the multiply-add as
  the kernel does), including K off the 16- and 32-value steps."""
  rng = np.random.default_rng(5)
  if fmt in ("q8_16", "q8_block64"):
    group = 16 if fmt == "q8_16" else 64
    k = k // group * group or group
    qs = rng.integers(-128, 128, (n, k), dtype=np.int8)
    scale = rng.uniform(1e-3, 1e-1, (n, k // group)).astype(np.float32)
    mins = (rng.uniform(-1, 1, (n, k // 16)).astype(np.float32)
            if fmt == "q8_16" else None)
    layout = "q8_16" if fmt == "q8_16" else "q8_0"
  else:
    w = rng.standard_normal((n, k)).astype(np.float32)
    q = formats.quantize(w, fmt)
    qs, scale, mins, layout = q.qs, q.scale, q.mins, fmt
  want = np.asarray(formats.dequantize(qs, scale, mins, layout))
  got = np.asarray(jax.jit(ops.dequantize)(qs, scale, mins))
  assert got.shape == (n, k) and got.dtype == np.float32
  if mins is None or fmt in formats.FOUR_BIT:
    np.testing.assert_array_equal(got, want)
  else:  # q * scale + min: either side may fuse it into one rounding
    terms = (np.abs(qs.astype(np.float64)).reshape(n, k // 16, 16)
             * scale[..., None] + np.abs(mins)[..., None]).reshape(n, k)
    assert (np.abs(got - want) <= 2.0**-23 * terms).all()


def _products(rng, k, n):
  """Each out-major product the kernels have, as fn(x) -> f32[R, N]."""
  w = rng.standard_normal((n, k)).astype(np.float32)
  out = {}
  for dtype in ("float32", "bfloat16", "float16"):
    wd = jnp.asarray(w).astype(dtype)
    out[dtype] = lambda x, wd=wd: ops.dense(x, wd, out_major=True)
  wb = jnp.asarray(w).astype("bfloat16")
  out["bfloat16 rows"] = lambda x: ops.dense(x.astype(jnp.bfloat16), wb,
                                             out_major=True)
  for fmt in ("int8", "q8_0", "q4_0", "q4_1"):
    q = formats.quantize(w, fmt)
    for x8 in (False, True):
      if fmt.startswith("q4"):
        fn = lambda x, q=q, x8=x8: ops.q4(x, q.qs, q.scale, q.mins,
                                          int8_activations=x8)
      else:
        fn = lambda x, q=q, x8=x8: ops.q8(x, q.qs, q.scale,
                                          int8_activations=x8)
      out[fmt + (" x8" if x8 else "")] = fn
  groups = k // 16
  qs = rng.integers(-128, 128, (n, k), dtype=np.int8)
  scale = rng.uniform(1e-3, 1e-1, (n, groups)).astype(np.float32)
  mins = rng.uniform(-1e-1, 1e-1, (n, groups)).astype(np.float32)
  for x8 in (False, True):
    out["q8_16" + (" x8" if x8 else "")] = (
        lambda x, x8=x8: ops.q8_16(x, qs, scale, mins, int8_activations=x8))
  return out


@pytest.mark.parametrize("k,n", [(576, 1030), (96, 71)])
def test_a_row_is_the_same_alone_and_in_a_batch(k, n):
  """Bit for bit: a row's products do not depend on the rows beside it.
  The kernels take one pass over up to 8 rows (one output at a time to 6
  rows, 2 or 3 side by side at 7 and 8 but for Q4_0, whose sums take two
  chains), and passes in blocks of outputs past that (Q4_0: passes of up
  to 8 rows) (matvec.cc, matvec_x8.cc); each output's sum runs in the same
  order either way. bfloat16 rows are the exception between up to 4 rows
  (vdpbf16ps) and 5 to 8 (widened to float32, a faster product there):
  each side is checked on its own."""
  rng = np.random.default_rng(7)
  x = _x(12, k, seed=3)
  for name, fn in _products(rng, k, n).items():
    product = jax.jit(fn)
    together = np.asarray(product(x))
    first4, last4 = np.asarray(product(x[:4])), np.asarray(product(x[4:8]))
    for rows in ([2], [1, 2], [0, 1, 2, 3], [3, 0], [5, 6], [3, 0, 7],
                 [7, 4, 5], [0, 1, 2, 3, 4], [7, 6, 5, 4, 3, 2],
                 [1, 2, 3, 4, 5, 6, 7], [9, 3, 11, 0, 8, 1], [10],
                 list(range(8, -1, -1))):
      alone = np.asarray(product(x[rows]))
      if name != "bfloat16 rows" or len(rows) > 4:
        np.testing.assert_array_equal(alone, together[rows], err_msg=name)
      elif max(rows) < 4:
        np.testing.assert_array_equal(alone, first4[rows], err_msg=name)
      elif 4 <= min(rows) and max(rows) < 8:  # Rows 4 to 7, 4-row side too.
        np.testing.assert_array_equal(
            alone, last4[[r - 4 for r in rows]], err_msg=name)


def test_bad_shapes_are_errors_not_garbage():
  x = _x(2, 64)
  with pytest.raises(Exception, match="w must be"):
    jax.jit(ops.dense, static_argnames="out_major")(
        x, np.zeros((63, 8), np.float32), out_major=False).block_until_ready()
  with pytest.raises(Exception, match="q4"):
    jax.jit(ops.q4)(_x(1, 48), np.zeros((4, 24), np.uint8),
                    np.zeros((4, 1), np.float32),
                    np.zeros((4, 1), np.float32)).block_until_ready()
  with pytest.raises(Exception, match="q4_0: K % 32 == 0"):
    jax.jit(ops.q4)(_x(1, 64), np.zeros((4, 32), np.uint8),
                    np.zeros((4, 1), np.float32), None).block_until_ready()
  with pytest.raises(ValueError, match="need their mins"):
    ops.dequantize(np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.float32),
                   None)
  with pytest.raises(Exception, match="dequantize q4"):
    jax.jit(ops.dequantize)(np.zeros((4, 24), np.uint8),
                            np.zeros((4, 1), np.float32),
                            np.zeros((4, 1), np.float32)).block_until_ready()


def test_bfloat16_product_has_no_float32_weight_copy():
  """The point of the kernels: the compiled decode product reads bf16
  weights as they are (XLA's own dot converts them to f32 first)."""
  w = jnp.zeros((576, 1536), jnp.bfloat16)
  x = jnp.zeros((1, 576), jnp.float32)
  hlo = jax.jit(ops.dense, static_argnames="out_major").lower(
      x, w, out_major=False).compile().as_text()
  assert "f32[576,1536]" not in hlo
  xla_hlo = jax.jit(lambda x, w: x @ w.astype(jnp.float32)).lower(
      x, w).compile().as_text()
  assert "f32[576,1536]" in xla_hlo  # what the kernels avoid


def test_after_copies_the_value_once_the_other_is_ready():
  value = np.random.default_rng(1).standard_normal((7, 3), np.float32)
  value[0, 0] = -0.0
  got = np.asarray(jax.jit(ops.after)(_x(2, 5), value))
  assert got.dtype == value.dtype
  assert got.tobytes() == value.tobytes()  # bit for bit, -0.0 included
  ints = np.arange(12, dtype=np.int8).reshape(3, 4)
  assert np.array_equal(jax.jit(ops.after)(_x(1, 1), ints), ints)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_split_equals_slices(dtype):
  x = jnp.arange(5 * 3 * 4).reshape(5, 3, 4).astype(dtype)
  parts = jax.jit(ops.split)(x)
  assert len(parts) == 5
  for i, part in enumerate(parts):
    assert part.dtype == x.dtype
    assert np.asarray(part).tobytes() == np.asarray(x[i]).tobytes()
  assert not ops.split(jnp.zeros((0, 3)))
  with pytest.raises(ValueError, match="leading axis"):
    ops.split(jnp.zeros(()))
