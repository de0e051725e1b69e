"""GGUF blocks decoded to float32 by `gguf_blocks.cc` at load
(`penzai_lm.kernels.gguf_blocks`): bit for bit gguf-py's values."""

import gguf
import numpy as np
import pytest

from tests.checkpoints.checkpoint_test_utils import real_model_path
from penzai_lm.checkpoints import open_checkpoint
from penzai_lm.checkpoints import gguf_tensors
from penzai_lm.kernels import ops
from penzai_lm.kernels.gguf_blocks import TYPES
from penzai_lm.kernels.gguf_blocks import block_decoder

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason="no C++ compiler for the kernels")

# Byte offsets of each type's float16 fields in a block (scale, min).
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,),
           "Q4_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(name, rows, cols, seed=0):
  """Random bytes with finite float16 fields (random bytes would make some
  NaN or inf, which the loader refuses anyway)."""
  block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
  rng = np.random.default_rng(seed)
  raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
  for offset in _HALVES[name]:
    halves = (rng.standard_normal(len(raw)) * 0.05).astype(np.float16)
    raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
  return raw.reshape(rows, -1)


def _gguf_py(name, raw, rows, cols):
  return getattr(gguf.quants, name).dequantize_rows(raw).reshape(rows, cols)


def test_every_type_it_decodes_has_a_case():
  assert set(TYPES) == set(_HALVES)
  for name, number in TYPES.items():
    assert gguf.GGMLQuantizationType[name] == number


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("rows,cols", [(1, 256), (7, 512), (64, 1536)])
def test_values_are_gguf_pys_bit_for_bit(name, rows, cols):
  decode = block_decoder()
  raw = _random_blocks(name, rows, cols)
  out = np.full((rows, cols), np.nan, np.float32)
  assert decode(TYPES[name], raw, out)
  want = _gguf_py(name, raw, rows, cols)
  np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_quantized_weights_decode_to_gguf_pys_values(name):
  """Blocks gguf-py quantized from float weights (real scales and mins:
  Q4_1's ``d * q + m`` differs from a fused multiply-add in the last bit of
  many values)."""
  w = np.random.default_rng(3).standard_normal((48, 320)).astype(np.float32)
  raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])
  out = np.empty_like(w)
  assert block_decoder()(TYPES[name], np.ascontiguousarray(raw), out)
  want = _gguf_py(name, raw, *w.shape)
  np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("ggml_type", [0, 1, 7, 13])  # F32 F16 Q5_1 Q5_K
def test_other_types_are_left_to_gguf_py(ggml_type):
  out = np.full((2, 32), 7.0, np.float32)
  assert not block_decoder()(ggml_type, np.zeros((2, 64), np.uint8), out)
  assert (out == 7.0).all()


def test_wrong_sizes_and_dtypes_are_refused():
  decode = block_decoder()
  raw = _random_blocks("Q4_1", 2, 64)  # 4 blocks of 20 bytes: 128 values
  with pytest.raises(ValueError, match="do not make 96 values"):
    decode(TYPES["Q4_1"], raw, np.empty((2, 48), np.float32))
  with pytest.raises(ValueError, match="do not make"):
    decode(TYPES["Q4_1"], raw[:, :35].copy(), np.empty((2, 48), np.float32))
  with pytest.raises(ValueError, match="float32 out"):
    decode(TYPES["Q4_1"], raw, np.empty((2, 64), np.float64))
  with pytest.raises(ValueError, match="C-contiguous"):
    decode(TYPES["Q4_1"], raw, np.empty((64, 2), np.float32).T)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_real_files_read_the_same_with_the_kernel(model):
  """Every tensor of the real files (Q4_1 and Q8_0; Q5_0, Q4_K, Q6_K and
  Q8_0). bfloat16 reads (the decoder's rows then go through a float32
  scratch buffer) are compared in tests/loading/test_streaming.py."""
  path = real_model_path(model)
  plain = open_checkpoint(path)
  fast = open_checkpoint(path, decode_blocks=block_decoder())
  for name in plain.shapes:
    got, want = fast.read(name), plain.read(name)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                  err_msg=name)
