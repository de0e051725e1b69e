"""load(..., quantize="keep"): a GGUF file's own blocks, every layer's
types, stacked and per layer, dequantizing to the float load bit for bit."""

import collections
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from penzai import pz

import penzai_lm
from penzai_lm.checkpoints import expected_tensor_shapes
from penzai_lm.checkpoints import normalize_config
from penzai_lm.quantization import QuantizedLinear
from tests.checkpoints.checkpoint_test_utils import write_gguf

_CONFIG = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96,
    num_attention_heads=4, max_position_embeddings=256, rope_theta=1e4,
    bos_token_id=1, eos_token_id=2, num_hidden_layers=2,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5)
# HF projection -> its type in layers 0 and 1 (llama.cpp's mixes give
# some layers more bits).
_TYPES = {
    "q_proj": (Q.Q5_0, Q.Q8_0), "k_proj": (Q.Q4_0, Q.Q4_1),
    "v_proj": (Q.Q8_0, Q.Q8_0), "o_proj": (Q.Q4_1, Q.Q5_1),
    "gate_proj": (Q.Q5_1, Q.Q5_1), "up_proj": (Q.F16, Q.F16),
    "down_proj": (Q.Q4_0, Q.Q4_0),
}
# Our layer -> its layout in a layer stack.
_STACKED = {
    "attention/query": "q8_0", "attention/key": "q4_1",
    "attention/value": "q8_0", "attention/output": "q8_16",
    "mlp/gating_linear": "q8_16", "mlp/out_linear": "q4_0",
    "embedder/decode": "q8_0",
}


def _qtype(name, arr):
  if arr.ndim == 1:
    return Q.F32
  if name == "model.embed_tokens.weight":
    return Q.Q8_0
  layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
  return next(t[layer] for k, t in _TYPES.items() if k in name)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
  """A llama GGUF whose projections mix types from layer to layer (q/k
  rows permuted as llama.cpp writes them)."""
  c = normalize_config("llama", _CONFIG)
  rng = np.random.default_rng(0)
  sd = {n: rng.standard_normal(s).astype(np.float32) * 0.5
        for n, s in expected_tensor_shapes("llama", c).items()}
  sd.pop("lm_head.weight", None)
  path = tmp_path_factory.mktemp("keep") / "mixed.gguf"
  return write_gguf(path, "llama", sd, _CONFIG, _qtype)


def _kept_layers(model) -> dict[str, QuantizedLinear]:
  return {l.qs.label.removesuffix(".qs"): l for l in
          pz.select(model).at_instances_of(QuantizedLinear).get_sequence()}


def _assert_dequantizes_to(kept, floats):
  """Every kept layer dequantizes to the float model's weight exactly."""
  params = {p.label: p.value for p in pz.select(floats).at_instances_of(
      pz.ParameterValue).get_sequence()}
  for base, layer in _kept_layers(kept).items():
    label = (f"{base}.weights" if f"{base}.weights" in params
             else base.removesuffix("/decode") + ".embeddings")
    want = params[label]
    axes = [a for a, _ in layer.out_axes] + [a for a, _ in layer.in_axes]
    stack = [a for a in want.named_axes if a not in axes]
    for i in range(want.named_shape[stack[0]] if stack else 1):
      one = (layer if not stack else pz.select(layer).at_instances_of(
          pz.nx.NamedArray).apply(lambda a: a[{stack[0]: i}]))  # noqa: B023
      got = one.dequantized().order_as(*axes).data_array
      ref = (want[{stack[0]: i}] if stack else want).order_as(*axes)
      np.testing.assert_array_equal(np.asarray(got),
                                    np.asarray(ref.data_array),
                                    err_msg=f"{base} layer {i}")


def test_keep_repacks_each_layers_blocks_exactly(mixed_gguf):
  floats = penzai_lm.load_model(mixed_gguf)
  kept = penzai_lm.load_model(mixed_gguf, quantize="keep")
  layers = _kept_layers(kept)
  assert {base.removeprefix("transformer/").removeprefix("blocks/"): l.format
          for base, l in layers.items()} == _STACKED
  # F16 up projections stay float.
  assert pz.select(kept).at_instances_of(pz.nn.Linear).where(
      lambda l: l.in_axis_names).count() == 1
  _assert_dequantizes_to(kept, floats)

  per_layer = penzai_lm.load_model(mixed_gguf, quantize="keep",
                                   use_layer_stack=False)
  formats = {base: l.format for base, l in _kept_layers(per_layer).items()}
  assert formats["transformer/block_0/attention/key"] == "q4_0"
  assert formats["transformer/block_1/attention/key"] == "q4_1"
  assert formats["transformer/block_0/attention/output"] == "q4_1"
  assert formats["transformer/block_1/attention/output"] == "q8_16"
  _assert_dequantizes_to(per_layer, penzai_lm.load_model(
      mixed_gguf, use_layer_stack=False))


def test_kept_model_generates_what_the_float_model_does(mixed_gguf):
  floats = penzai_lm.load_model(mixed_gguf)
  kept = penzai_lm.load_model(mixed_gguf, quantize="keep")
  tokens = pz.nx.wrap(np.array([[1, 5, 9, 33, 7, 60]], np.int32)).tag(
      "batch", "seq")
  want = np.asarray(floats(tokens).data_array)
  got = np.asarray(kept(tokens).data_array)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  prompts = [[1, 5, 9, 33], [1, 70, 2, 8]]
  settings = dict(max_new_tokens=8, temperature=0.0, stop_tokens=[])
  a = penzai_lm.generate(floats, prompts, **settings)
  b = penzai_lm.generate(kept, prompts, **settings)  # decodes in the kernels
  np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))


def test_keep_with_bfloat16_activations(mixed_gguf):
  kept32 = _kept_layers(penzai_lm.load_model(mixed_gguf, quantize="keep"))
  model = penzai_lm.load_model(mixed_gguf, quantize="keep", dtype="bfloat16")
  for base, layer in _kept_layers(model).items():
    np.testing.assert_array_equal(np.asarray(layer.qs.value.data_array),
                                  np.asarray(kept32[base].qs.value.data_array))
  result = penzai_lm.generate(model, [[1, 5, 9, 33]], max_new_tokens=4,
                              temperature=0.0, stop_tokens=[])
  assert np.asarray(result.tokens).shape == (1, 4)


@pytest.mark.slow
def test_gemma3_q4_k_m_keeps_its_k_quants():
  """The real Gemma 3 270M Q4_K_M file: Q4_K, Q6_K, Q5_0 and Q8_0."""
  from tests.checkpoints.checkpoint_test_utils import real_model_path  # pylint: disable=g-import-not-at-top
  path = real_model_path("gemma3-270m")
  kept, tokenizer = penzai_lm.load(path, quantize="keep")
  layouts = collections.Counter(
      l.format for l in _kept_layers(kept).values())
  # ffn_down mixes Q4_K and Q6_K: q8_16; attn_output (Q4_K): q4_1; the
  # rest (Q5_0, Q8_0) q8_0.
  assert layouts == {"q8_0": 6, "q4_1": 1, "q8_16": 1}
  floats = penzai_lm.load_model(path)
  _assert_dequantizes_to(kept, floats)
  ids = tokenizer.encode("The capital of France is")
  settings = dict(max_new_tokens=12, temperature=0.0, stop_tokens=[])
  np.testing.assert_array_equal(
      np.asarray(penzai_lm.generate(kept, [ids], **settings).tokens),
      np.asarray(penzai_lm.generate(floats, [ids], **settings).tokens))


def test_keep_reads_no_float_weight_it_replaces(mixed_gguf):
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from penzai_lm.checkpoints import open_checkpoint  # pylint: disable=g-import-not-at-top
  from penzai_lm.loading import config_from_checkpoint  # pylint: disable=g-import-not-at-top
  from penzai_lm.loading.parameters import stream_parameters  # pylint: disable=g-import-not-at-top
  from penzai_lm.quantization import kept_tensor_names  # pylint: disable=g-import-not-at-top

  checkpoint = open_checkpoint(mixed_gguf)
  read = []
  recording = dataclasses.replace(checkpoint, reader=lambda name, dtype: (
      read.append(name), checkpoint.reader(name, dtype))[1])
  skipped = kept_tensor_names(checkpoint)
  # Every quantized projection and the quantized tied table; F16 up
  # projections and the norms are read.
  assert "model.layers.1.self_attn.q_proj.weight" in skipped
  assert "model.embed_tokens.weight" in skipped
  assert "model.layers.0.mlp.up_proj.weight" not in skipped
  params = stream_parameters(recording, config_from_checkpoint(checkpoint),
                             shape_only=skipped)
  assert read and not set(read) & skipped
  unread = [p for p in params if isinstance(p, pz.ParameterValue)]
  assert unread and all(isinstance(p.value.data_array, jax.ShapeDtypeStruct)
                        for p in unread)


def test_unfrozen_keep_shares_the_tied_tables_variables(mixed_gguf):
  model = penzai_lm.load_model(mixed_gguf, quantize="keep", freeze=False)
  (lookup,) = pz.select(model).at_instances_of(
      penzai_lm.quantization.QuantizedEmbeddingLookup).get_sequence()
  decode = _kept_layers(model)["transformer/embedder/decode"]
  assert isinstance(decode.qs, pz.Parameter) and lookup.qs is decode.qs
  frozen = pz.freeze_params(model)
  result = penzai_lm.generate(frozen, [[1, 5, 9]], max_new_tokens=3,
                              temperature=0.0, stop_tokens=[])
  assert np.asarray(result.tokens).shape == (1, 3)


def test_keep_of_a_checkpoint_that_is_not_gguf_is_a_clear_error(tmp_path):
  from penzai_lm.quantization import kept_weights  # pylint: disable=g-import-not-at-top

  class NotGguf:
    source, gguf_reader = str(tmp_path / "model"), None

  with pytest.raises(ValueError, match="not an opened GGUF checkpoint"):
    kept_weights(NotGguf(), 2)
