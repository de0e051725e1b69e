"""Tiny random Hugging Face models: penzai_lm's logits equal transformers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from penzai_lm.loading import load_model  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import hf_logits  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import logits  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import save_perturbed  # pylint: disable=g-import-not-at-top
from penzai_lm.model import KVCachingTransformerLM  # pylint: disable=g-import-not-at-top

_COMMON = dict(
    vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
    num_attention_heads=4, max_position_embeddings=128,
)


def _configs():
  t = transformers
  return {
      "llama_gqa_headdim": t.LlamaConfig(
          **_COMMON, num_key_value_heads=2, head_dim=12, rope_theta=5e4,
          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=16),
      ),
      "llama_tied_mqa": t.LlamaConfig(
          **_COMMON, num_key_value_heads=1, tie_word_embeddings=True,
      ),
      "mistral_window": t.MistralConfig(
          **_COMMON, num_key_value_heads=2, sliding_window=5,
      ),
      "qwen2_bias": t.Qwen2Config(
          **_COMMON, num_key_value_heads=2, tie_word_embeddings=False,
      ),
      "gemma3": t.Gemma3TextConfig(
          **_COMMON, num_key_value_heads=1, head_dim=16, sliding_window=5,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
          query_pre_attn_scalar=16, rope_local_base_freq=1e4,
          final_logit_softcapping=None, attn_logit_softcapping=None,
      ),
      "gpt2": t.GPT2Config(
          vocab_size=101, n_embd=32, n_layer=3, n_head=4, n_positions=64,
      ),
  }


_CLASSES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


@pytest.fixture(scope="module", params=sorted(_configs()))
def hf_dir(request, tmp_path_factory):
  config = _configs()[request.param]
  cls = getattr(transformers, _CLASSES[request.param.split("_")[0]])
  path = tmp_path_factory.mktemp(request.param)
  return request.param, path, save_perturbed(cls, config, path)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_logits_match_transformers(hf_dir, stacked):
  name, path, hf_model = hf_dir
  model = load_model(path, use_layer_stack=stacked)
  ids = list(np.random.RandomState(1).randint(0, 101, size=12))
  got = logits(pz.freeze_params(model), pz.nx.wrap(jnp.array(ids)).tag("seq"))
  np.testing.assert_allclose(
      np.asarray(got.unwrap("seq", "vocabulary")), hf_logits(hf_model, ids),
      atol=1e-4, err_msg=name,
  )


def test_cached_logits_match_transformers(hf_dir):
  _, path, hf_model = hf_dir
  model = load_model(path)
  ids = list(np.random.RandomState(2).randint(0, 101, size=10))
  cached = KVCachingTransformerLM.from_uncached(model, 16, {"batch": 1})
  stateless, state = pz.unbind_state_vars(pz.freeze_params(cached), freeze=True)
  step = jax.jit(lambda s, t: stateless.stateless_call(s, t))
  outs = []
  for chunk in (ids[:6], *[[i] for i in ids[6:]]):
    out, state = step(state, pz.nx.wrap(jnp.array([chunk])).tag("batch", "seq"))
    outs.append(np.asarray(out.unwrap("batch", "seq", "vocabulary"))[0])
  np.testing.assert_allclose(
      np.concatenate(outs), hf_logits(hf_model, ids), atol=1e-4
  )


def test_bfloat16_load_is_close_to_float32(hf_dir):
  name, path, hf_model = hf_dir
  if name != "llama_gqa_headdim":
    pytest.skip("one architecture is enough")
  model = load_model(path, dtype="bfloat16")
  _, params = pz.unbind_params(model)
  assert {p.value.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
  ids = list(range(1, 12))
  got = logits(pz.freeze_params(model), pz.nx.wrap(jnp.array(ids)).tag("seq"))
  assert got.dtype == jnp.bfloat16
  expected = hf_logits(hf_model, ids)
  got = np.asarray(got.unwrap("seq", "vocabulary"), np.float32)
  assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()


def test_bad_dtype_and_missing_path_are_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    load_model("smollm2-135m-instruct", dtype="int8")
  with pytest.raises((ValueError, FileNotFoundError), match="nope"):
    load_model(tmp_path / "nope.gguf")
