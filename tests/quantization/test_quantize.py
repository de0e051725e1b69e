"""Quantized models compute what their dequantized float twins compute."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.generation import Engine
from penzai_lm.kernels import ops
from penzai_lm.kernels import with_cpu_kernels
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer
from penzai_lm.quantization import QuantizedEmbeddingLookup
from penzai_lm.quantization import QuantizedLinear
from penzai_lm.quantization import quantize


def _model(family="llama", stack=True, dtype="float32"):
  config = TransformerConfig(
      family=family, vocab_size=97, hidden_size=64, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=96,
      tie_embeddings=family == "gemma3", use_layer_stack=stack,
      max_position_embeddings=256, parameter_dtype=dtype,
      activation_dtype=dtype)
  return build_transformer(config, seed=0)


def _dequantized_twin(float_model, quantized):
  """The float model with every quantized weight replaced by its
  dequantized values (the same computation, in float)."""
  by_base = {}
  for layer in pz.select(quantized).at_instances_of(
      QuantizedLinear).get_sequence():
    by_base[layer.qs.label.removesuffix(".qs")] = layer

  def weights(param):
    layer = by_base.get(param.label.removesuffix(".weights"))
    if param.label.endswith(".embeddings"):  # The tied table: its lookup
      layer = by_base.get(  # reads the quantized rows too.
          param.label.removesuffix(".embeddings") + "/decode")
    if layer is None:
      return param
    stack = [a for a in layer.qs.value.named_shape
             if a not in ("quant_out", "quant_in")]
    rest = [a for a in param.value.named_shape if a not in stack]
    if stack:
      # Dequantize each stacked layer as the LayerStack would see it.
      data = jnp.stack([
          pz.select(layer).at_instances_of(pz.nx.NamedArray)
          .apply(lambda x: x[{stack[0]: i}])  # noqa: B023
          .dequantized(param.value.dtype).untag(*rest).unwrap()
          for i in range(layer.qs.value.named_shape[stack[0]])])
      value = pz.nx.wrap(data).tag(stack[0], *rest)
    else:
      value = pz.nx.wrap(layer.dequantized(param.value.dtype).untag(
          *rest).unwrap()).tag(*rest)
    return pz.ParameterValue(value=value, label=param.label)

  def decode(layer):
    quantized = by_base[
        layer.table.embeddings.label.removesuffix(".embeddings") + "/decode"]
    return pz.nn.Linear(
        weights=pz.ParameterValue(value=quantized.dequantized(
            layer.table.embeddings.value.dtype), label="w"),
        in_axis_names=tuple(a for a, _ in quantized.in_axes),
        out_axis_names=tuple(a for a, _ in quantized.out_axes))

  twin = pz.select(float_model).at_instances_of(pz.ParameterValue).apply(
      weights)
  return pz.select(twin).at_instances_of(pz.nn.EmbeddingDecode).apply(decode)


def _logits(model, rows, seq):
  tokens = pz.nx.wrap(np.random.default_rng(0).integers(
      1, 97, (rows, seq)).astype(np.int32)).tag("batch", "seq")
  fn = jax.jit(lambda m, t: m(t).untag("batch", "seq", "vocabulary")
               .data_array)
  return np.asarray(fn(model, tokens)), fn.lower(model, tokens).as_text()


@pytest.mark.parametrize("family,fmt", [
    ("llama", "int8"), ("llama", "q8_0"), ("llama", "q4_0"),
    ("llama", "q4_1"), ("gemma3", "q4_1")])  # gemma3: the tied unembedding
def test_quantized_equals_dequantize_then_run(fmt, family):
  model = _model(family)
  q = quantize(model, fmt)
  n_linear = pz.select(model).at_instances_of(pz.nn.Linear).where(
      lambda l: l.in_axis_names).count()
  assert pz.select(q).at_instances_of(QuantizedLinear).count() == (
      n_linear + (family == "gemma3"))
  # A tied table is looked up from its quantized rows: no float copy.
  assert pz.select(q).at_instances_of(pz.nn.EmbeddingLookup).count() == (
      family != "gemma3")
  assert pz.select(q).at_instances_of(QuantizedEmbeddingLookup).count() == (
      family == "gemma3")
  want, _ = _logits(_dequantized_twin(model, q), 2, 9)
  got, _ = _logits(q, 2, 9)  # 18 rows: dequantized inside the program
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)
  if ops.available():
    fast, hlo = _logits(with_cpu_kernels(q), 2, 3)  # 6 rows: kernels
    assert "pzlm_matvec_q" in hlo
    want6, _ = _logits(_dequantized_twin(model, q), 2, 3)
    np.testing.assert_allclose(fast, want6, atol=1e-5 * scale, rtol=0)
    wide, hlo = _logits(with_cpu_kernels(q), 2, 9)  # 18: XLA's GEMM, after
    assert "pzlm_after" in hlo  # the inputs (see the test below)
    np.testing.assert_allclose(wide, want, atol=1e-5 * scale, rtol=0)


@pytest.mark.skipif(not ops.available(), reason="no C++ compiler")
def test_bfloat16_prefill_dequantizes_into_a_bf16_gemm():
  model = _model(dtype="bfloat16")
  q = quantize(model, "q8_0")
  want, _ = _logits(_dequantized_twin(model, q), 2, 9)
  got, hlo = _logits(with_cpu_kernels(q), 2, 9)  # 18 rows: XLA's GEMM
  assert re.search(r"stablehlo.dot_general.*tensor<18x\d+xbf16>.*"
                   r"-> tensor<18x\d+xf32>", hlo)
  want, got = want.astype(np.float32), got.astype(np.float32)
  np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max(),
                             rtol=0)


@pytest.mark.skipif(not ops.available(), reason="no C++ compiler")
@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_prefill_dequantizes_one_layer_at_a_time(fmt):
  """XLA:CPU's scheduler ran every dequantization first, so all layers'
  float weights were alive at once (SmolLM2 int8: 393 MB of temporaries
  per prefill); each layer's now waits for that layer's input."""
  config = TransformerConfig(
      family="llama", vocab_size=97, hidden_size=128, num_layers=8,
      num_heads=4, num_kv_heads=2, head_dim=32, mlp_hidden_size=512,
      max_position_embeddings=256)
  q = quantize(build_transformer(config, seed=0), fmt)
  engine = Engine()
  engine.generate(q, [list(range(1, 40))], max_new_tokens=2,
                  temperature=0.0)
  (_, prefill), = engine.programs.items("prefill")
  per_layer = 4 * 128 * (2 * 128 + 2 * 64 + 3 * 512)  # float32 bytes
  # Every layer at once would be 8 of them.
  assert prefill.memory_analysis().temp_size_in_bytes < 3 * per_layer


def test_per_layer_blocks_and_labels():
  q = quantize(_model(stack=False), "q4_1")
  labels = [l.qs.label for l in pz.select(q).at_instances_of(
      QuantizedLinear).get_sequence()]
  assert "transformer/block_1/attention/query.qs" in labels
  layer = pz.select(q).at_instances_of(QuantizedLinear).get_sequence()[0]
  assert layer.mins is not None and layer.format == "q4_1"
  assert layer.qs.value.data_array.dtype == jnp.uint8


@pytest.mark.skipif(not ops.available(), reason="no C++ compiler")
def test_engine_decodes_quantized_models_on_the_kernels():
  model = _model(stack=False)
  q = quantize(model, "q8_0")
  engine = Engine()
  prompt = [5, 17, 3, 44]
  result = engine.generate(q, [prompt], max_new_tokens=5, temperature=0.0,
                           stop_tokens=[])
  (_, program), = engine.programs.items("decode")
  assert "pzlm_matvec_q8" in program.as_text()
  twin = _dequantized_twin(model, q)
  want = Engine().generate(twin, [prompt], max_new_tokens=5,
                           temperature=0.0, stop_tokens=[])
  assert np.array_equal(np.asarray(result.tokens), np.asarray(want.tokens))


def test_errors():
  with pytest.raises(ValueError, match="unknown weight format"):
    quantize(_model(), "q3")
  with pytest.raises(ValueError, match="no projections to quantize"):
    quantize(pz.nn.Sequential([]), "int8")
  config = TransformerConfig(
      family="llama", vocab_size=97, hidden_size=40, num_layers=1,
      num_heads=2, num_kv_heads=2, head_dim=20, mlp_hidden_size=64,
      max_position_embeddings=64)
  with pytest.raises(ValueError, match="query.weights: q4_0 quantizes"
                     " blocks of 32"):
    quantize(build_transformer(config, seed=0), "q4_0")
