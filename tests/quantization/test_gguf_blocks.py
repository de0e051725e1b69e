"""Every kept llama.cpp type decodes to gguf-py's values, bit for bit, in
every layout that can hold it."""

import gguf
import jax
import numpy as np
import pytest

from penzai_lm.kernels import ops
from penzai_lm.quantization import gguf_blocks

# Byte ranges of each type's float16 fields (random bytes there could be
# NaN or inf; the files' are finite).
_F16_FIELDS = {
    "Q8_0": [(0, 2)], "Q4_0": [(0, 2)], "Q4_1": [(0, 4)], "Q5_0": [(0, 2)],
    "Q5_1": [(0, 4)], "Q4_K": [(0, 4)], "Q5_K": [(0, 4)],
    "Q6_K": [(208, 210)], "Q2_K": [(80, 84)], "Q3_K": [(108, 110)],
}


def _random_blocks(kind, rows, k, seed=0):
  """``[rows, row_bytes]`` of random blocks with finite float16 fields."""
  values, nbytes = gguf_blocks.block_shape(kind)
  rng = np.random.default_rng(seed)
  raw = rng.integers(0, 256, (rows * (k // values), nbytes), dtype=np.uint8)
  for start, stop in _F16_FIELDS[kind]:
    scales = rng.uniform(-0.05, 0.05, (raw.shape[0], (stop - start) // 2))
    raw[:, start:stop] = scales.astype(np.float16).view(np.uint8)
  return raw.reshape(rows, -1)


def _theirs(raw, kind, k):
  return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]
                                ).reshape(raw.shape[0], k)


@pytest.mark.parametrize("kind", sorted(gguf_blocks.KEPT_TYPES))
def test_each_type_decodes_to_gguf_py_values_in_its_layouts(kind):
  k = 512
  raw = _random_blocks(kind, 6, k)
  want = _theirs(raw, kind, k)
  groups = gguf_blocks.decode(raw, kind, k)
  layouts = {gguf_blocks.LAYOUT_OF[kind], "q8_16"}
  for layout in layouts:
    weight = gguf_blocks.to_layout(groups, layout)
    assert weight.format == layout and weight.shape == (6, k)
    got = np.asarray(weight.dequantize())
    # == (not bitwise): -0.0 and 0.0 may differ where an offset is zero.
    np.testing.assert_array_equal(got, want, err_msg=f"{kind} as {layout}")


def test_layers_of_a_stack_share_the_smallest_exact_layout():
  common = gguf_blocks.common_layout
  assert common(["Q8_0", "Q5_0"]) == "q8_0"
  assert common(["Q4_0", "Q4_1", "Q4_K"]) == "q4_1"
  assert common(["Q4_0"]) == "q4_0"
  assert common(["Q4_K", "Q6_K"]) == "q8_16"
  assert common(["Q8_0", "Q4_1"]) == "q8_16"
  groups = gguf_blocks.decode(_random_blocks("Q6_K", 2, 256), "Q6_K", 256)
  with pytest.raises(ValueError, match="groups of 32"):
    gguf_blocks.to_layout(groups, "q4_1")
  groups = gguf_blocks.decode(_random_blocks("Q8_0", 2, 64), "Q8_0", 64)
  with pytest.raises(ValueError, match="values 0..15"):
    gguf_blocks.to_layout(groups, "q4_1")
  with pytest.raises(ValueError, match="take 68 bytes"):
    gguf_blocks.decode(np.zeros((2, 60), np.uint8), "Q8_0", 64)
  # q4_0's offsets are -8 scales by definition; Q4_1's are their own.
  groups = gguf_blocks.decode(_random_blocks("Q4_1", 2, 64), "Q4_1", 64)
  with pytest.raises(ValueError, match="use q4_1"):
    gguf_blocks.to_layout(groups, "q4_0")


@pytest.mark.skipif(not ops.available(), reason="CPU kernels not built")
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_q8_16_kernel_matches_the_dequantized_product(rows):
  k, n = 768, 72
  raw = _random_blocks("Q6_K", n, k, seed=3)
  weight = gguf_blocks.to_layout(gguf_blocks.decode(raw, "Q6_K", k), "q8_16")
  # An offset that is not zero, as Q4_K and Q2_K have.
  weight = type(weight)(weight.qs, weight.scale,
                        weight.mins + 0.01 * np.arange(k // 16, dtype=
                                                       np.float32), "q8_16")
  x = np.random.default_rng(4).standard_normal((rows, k)).astype(np.float32)
  got = jax.jit(ops.q8_16)(x, weight.qs, weight.scale, weight.mins)
  want = x.astype(np.float64) @ np.asarray(weight.dequantize(), np.float64).T
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4,
                             atol=1e-4 * np.abs(want).max())
