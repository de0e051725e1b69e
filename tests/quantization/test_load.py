"""load(..., quantize=...): the real SmolLM2 GGUF kept in its own blocks,
int8 from a Hugging Face directory, and clear errors."""

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers
from penzai import pz

import penzai_lm
from penzai_lm.fetch import resolve_model_path
from penzai_lm.quantization import QuantizedLinear
from tests.loading.hf_models import save_perturbed


def _layer(model, label):
  (layer,) = [l for l in pz.select(model).at_instances_of(
      QuantizedLinear).get_sequence() if l.qs.label == label]
  return layer


@pytest.mark.slow
def test_keep_gives_the_gguf_files_own_blocks():
  path = resolve_model_path("smollm2-135m-instruct")
  model, tokenizer = penzai_lm.load(path, quantize="keep")
  reader = gguf.GGUFReader(path)
  tensors = {t.name: t for t in reader.tensors}
  # blk.3.ffn_down: Q4_1, 576 outputs x 1536 inputs, 20-byte blocks.
  raw = np.asarray(tensors["blk.3.ffn_down.weight"].data).reshape(576, 48, 20)
  # (On an AVX-512 CPU the Q4_1 blocks lie in the kernels' tiles,
  # `quantize`; `in_rows` gives them back as the file has them.)
  layer = _layer(model, "transformer/blocks/mlp/out_linear.qs").in_rows()
  assert layer.format == "q4_1" and not layer.tiled

  def block(param):  # layer 3 of a stacked quantized array, [N, ...]
    value = param.value[{"blocks": 3}]
    return np.asarray(value.order_as("quant_out", *[
        a for a in value.named_axes if a != "quant_out"]).data_array)

  np.testing.assert_array_equal(
      block(layer.scale), raw[..., 0:2].copy().view(np.float16)[..., 0])
  np.testing.assert_array_equal(
      block(layer.mins), raw[..., 2:4].copy().view(np.float16)[..., 0])
  np.testing.assert_array_equal(block(layer.qs), raw[..., 4:].reshape(576, -1))
  # The tied embedding: Q8_0 blocks of the token table, 34 bytes each.
  raw = np.asarray(tensors["token_embd.weight"].data).reshape(49152, 18, 34)
  decode = _layer(model, "transformer/embedder/decode.qs")
  assert decode.format == "q8_0"
  np.testing.assert_array_equal(
      np.asarray(decode.qs.value.data_array),
      raw[..., 2:].copy().view(np.int8).reshape(49152, -1))
  # And it generates what the float model generates, near enough.
  ids = tokenizer.encode("The capital of France is")
  result = penzai_lm.generate(model, [ids], max_new_tokens=4,
                              temperature=0.0)
  assert "Paris" in tokenizer.decode(list(np.asarray(result.tokens[0])))


def test_int8_from_a_hugging_face_directory(tmp_path):
  config = transformers.LlamaConfig(
      vocab_size=96, hidden_size=64, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=128, tie_word_embeddings=False)
  save_perturbed(transformers.LlamaForCausalLM, config, tmp_path)
  model = penzai_lm.load_model(tmp_path, quantize="int8")
  layers = pz.select(model).at_instances_of(QuantizedLinear).get_sequence()
  assert len(layers) == 8 and {l.format for l in layers} == {"int8"}
  assert pz.select(model).at_instances_of(pz.nn.Linear).where(
      lambda l: l.in_axis_names).count() == 0
  floats = penzai_lm.load_model(tmp_path)
  tokens = pz.nx.wrap(np.array([[1, 5, 9, 33]], np.int32)).tag(
      "batch", "seq")
  got = np.asarray(model(tokens).data_array)
  want = np.asarray(floats(tokens).data_array)
  # int8 per channel: about 0.4% of each weight's range per value.
  assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
  with pytest.raises(ValueError, match="not a GGUF file"):
    penzai_lm.load_model(tmp_path, quantize="keep")


def test_bad_quantize_arguments_fail_before_reading(tmp_path):
  missing = tmp_path / "nothing.gguf"
  with pytest.raises(ValueError, match="quantize must be one of"):
    penzai_lm.load_model(missing, quantize="q4_k")
  with pytest.raises(ValueError, match="rules= needs mesh="):
    penzai_lm.load_model(missing, quantize="int8", rules={"neurons": None})


@pytest.mark.parametrize("fmt,tied,stack,dtype,freeze", [
    ("int8", False, True, "float32", True),
    ("q4_1", True, True, "float32", True),
    ("q8_0", True, False, "bfloat16", True),
    ("int8", True, True, "float32", False),
])
def test_quantized_as_read_equals_quantizing_the_loaded_model(
    tmp_path, fmt, tied, stack, dtype, freeze):
  """load(quantize=fmt) quantizes each weight as it is read (no float
  model in between); the result is quantize(load(...)), bit for bit."""
  config = transformers.LlamaConfig(
      vocab_size=96, hidden_size=64, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=128, tie_word_embeddings=tied)
  save_perturbed(transformers.LlamaForCausalLM, config, tmp_path)
  kwargs = dict(use_layer_stack=stack, dtype=dtype)
  got = penzai_lm.load_model(tmp_path, quantize=fmt, freeze=freeze,
                             **kwargs)
  want = penzai_lm.quantize(penzai_lm.load_model(tmp_path, **kwargs), fmt)
  if not freeze:
    assert pz.select(got).at_instances_of(pz.ParameterValue).count() == 0
    got = pz.freeze_params(got)
  assert (pz.select(got).at_instances_of(QuantizedLinear).count()
          == pz.select(want).at_instances_of(QuantizedLinear).count() > 0)
  got_leaves, got_def = jax.tree_util.tree_flatten(got)
  want_leaves, want_def = jax.tree_util.tree_flatten(want)
  assert got_def == want_def
  for a, b in zip(got_leaves, want_leaves):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
