"""Quantizers against gguf-py's (llama.cpp's reference), bit for bit."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.quantization import formats

GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1}


def _weight(seed=0, shape=(48, 256)):
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(shape).astype(np.float32)
  w[0, :32] = 0  # an all-zero block
  w[1, :32] = 0.5  # a constant block
  return w


@pytest.mark.parametrize("fmt", sorted(GGML))
def test_quantizers_match_llama_cpp_reference(fmt):
  w = _weight()
  ours = np.asarray(formats.quantize(w, fmt).dequantize())
  theirs = gguf.quants.dequantize(gguf.quants.quantize(w, GGML[fmt]),
                                  GGML[fmt])
  np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("fmt", sorted(GGML))
def test_requantizing_gguf_blocks_gives_them_back_exactly(fmt):
  """What load(..., quantize="keep") relies on."""
  w = _weight(1)
  raw = gguf.quants.quantize(w, GGML[fmt])
  dequantized = gguf.quants.dequantize(raw, GGML[fmt])
  again = formats.quantize(dequantized, fmt)
  np.testing.assert_array_equal(np.asarray(again.dequantize()), dequantized)
  # The stored scales are the file's float16 scales.
  d = raw.reshape(w.shape[0], -1, raw.shape[-1] // (w.shape[1] // 32))
  file_scales = d[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
  np.testing.assert_array_equal(np.asarray(again.scale), file_scales)


def test_int8_is_per_channel_and_within_half_a_step():
  w = _weight(2, (16, 100))
  q = formats.quantize(w, "int8")
  assert q.scale.shape == (16, 1) and q.qs.shape == (16, 100)
  err = np.abs(np.asarray(q.dequantize()) - w)
  assert np.all(err <= np.asarray(q.scale) / 2 + 1e-7)
  assert q.nbytes == 16 * 100 + 16 * 4


def test_bad_format_and_block_size_are_clear_errors():
  with pytest.raises(ValueError, match="unknown weight format 'q5_0'"):
    formats.quantize(np.zeros((2, 64), np.float32), "q5_0")
  with pytest.raises(ValueError, match="blocks of 32.*contracts 40.*int8"):
    formats.quantize(np.zeros((2, 40), np.float32), "q4_1")


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_the_device_quantizer_computes_the_host_formulas(fmt):
  """What a weight on a GPU is quantized with (`formats.quantize` sends
  weights on accelerators to this compiled program), run here on the CPU:
  bit for bit the numpy quantizer."""
  w = _weight(3, (40, 128)) * 3
  w[2, 32:64] = np.linspace(-1, 1, 32)  # exact halves, ties
  host = formats.quantize(w, fmt)
  device = formats._quantize_on_device(jnp.asarray(w), fmt)  # pylint: disable=protected-access
  for got, want in zip(device, (host.qs, host.scale, host.mins)):
    if want is None:
      assert got is None
    else:
      assert got.dtype == want.dtype and got.shape == want.shape
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not formats.on_accelerator(jnp.asarray(w))
  assert not formats.on_accelerator(w)


def test_q4_0_offsets_are_derived_from_the_scales():
  """A q4_0 weight means ``mins = -8 * scale`` wherever it is used: its
  ``mins`` array is not read (the CPU kernels take ``mins=None``), so a
  different one changes nothing."""
  w = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
  q = formats.quantize(w, "q4_0")
  np.testing.assert_array_equal(np.asarray(q.mins), -8 * np.asarray(q.scale))
  other = formats.QuantizedWeight(q.qs, q.scale, q.mins + 1.0, "q4_0")
  np.testing.assert_array_equal(np.asarray(other.dequantize()),
                                np.asarray(q.dequantize()))
