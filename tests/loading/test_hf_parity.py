"""Tiny random Hugging Face models: penzai_lm's logits equal transformers'.

One model per supported architecture at least (Llama, Mistral, Qwen2 and
Qwen2.5, Qwen3, Phi-3, Gemma 2, Gemma 3, GPT-2): logits on the stacked and
per-layer layouts, cached logits, and greedy generation against
transformers' ``generate``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import penzai_lm  # pylint: disable=g-import-not-at-top
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
      # Mistral 7B v0.3 / Nemo style: no window, explicit head_dim.
      "mistral_nowindow_headdim": t.MistralConfig(
          **_COMMON, num_key_value_heads=2, sliding_window=None, head_dim=12,
          rope_theta=1e6,
      ),
      "qwen2_bias": t.Qwen2Config(
          **_COMMON, num_key_value_heads=2, tie_word_embeddings=False,
      ),
      # Qwen2.5 (0.5B-3B style): qwen2 architecture, tied embeddings, a large
      # RoPE base, a window configured but switched off.
      "qwen2_5": t.Qwen2Config(
          **_COMMON, num_key_value_heads=2, tie_word_embeddings=True,
          rope_theta=1e6, use_sliding_window=False, sliding_window=32,
          max_window_layers=2, bos_token_id=99, eos_token_id=100,
      ),
      "qwen3": t.Qwen3Config(
          **_COMMON, num_key_value_heads=2, head_dim=12, rope_theta=5e4,
          tie_word_embeddings=False,
      ),
      "qwen3_tied_bias": t.Qwen3Config(
          **_COMMON, num_key_value_heads=1, head_dim=8, attention_bias=True,
          tie_word_embeddings=True,
      ),
      # Phi-3 mini style (every layer in a sliding window), fused qkv and
      # gate_up projections.
      "phi3": t.Phi3Config(
          **_COMMON, num_key_value_heads=2, sliding_window=6,
          pad_token_id=0, bos_token_id=1, eos_token_id=2,
      ),
      # Gemma 2: alternating sliding/global layers (default layer_types), both
      # soft-caps small enough to matter, query_pre_attn_scalar != head_dim.
      "gemma2": t.Gemma2Config(
          **_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=5,
          query_pre_attn_scalar=12, attn_logit_softcapping=0.5,
          final_logit_softcapping=3.0,
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
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM", "gpt2": "GPT2LMHeadModel",
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


GREEDY_CASES = ("llama_gqa_headdim", "mistral_window", "qwen2_5", "qwen3",
                "phi3", "gemma2", "gemma3", "gpt2")


def test_greedy_generation_matches_transformers(hf_dir):
  """Cached greedy decoding: `penzai_lm.generate` on the cached model
  (`KVCachingTransformerLM.from_uncached`) gives transformers' tokens."""
  name, path, hf_model = hf_dir
  if name not in GREEDY_CASES:
    pytest.skip("one case per architecture (the logit tests cover the rest)")
  model = load_model(path)
  prompt = [int(i) for i in np.random.RandomState(4).randint(3, 99, size=7)]
  new = 6
  cached = KVCachingTransformerLM.from_uncached(
      model, len(prompt) + new, {"batch": 1}
  )
  got = penzai_lm.generate(
      cached, prompt, max_new_tokens=new, temperature=0.0, stop_tokens=[]
  )
  with torch.no_grad():
    expected = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
        eos_token_id=None, pad_token_id=0,
        generation_config=transformers.GenerationConfig(),
    )[0, len(prompt):].tolist()
  assert len(expected) == new, name
  assert list(got.tokens[0]) == expected, name


def test_min_new_tokens_matches_transformers(hf_dir):
  """``min_new_tokens`` holds the stop token back as HF's
  ``MinNewTokensLengthLogitsProcessor`` does: the same greedy tokens."""
  name, path, hf_model = hf_dir
  if name != "llama_gqa_headdim":
    pytest.skip("one architecture is enough")
  model = load_model(path)
  prompt = [int(i) for i in np.random.RandomState(5).randint(3, 99, size=6)]
  free = penzai_lm.generate(model, prompt, max_new_tokens=12,
                            temperature=0.0, stop_tokens=[]).tokens[0]
  # The model would stop at its first token that differs from the first.
  first = next(i for i, t in enumerate(free) if t not in free[:1])
  stop = free[first]
  got = penzai_lm.generate(model, prompt, max_new_tokens=12, min_new_tokens=6,
                           temperature=0.0, stop_tokens=[stop]).tokens[0]
  with torch.no_grad():
    expected = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=6,
        do_sample=False, eos_token_id=stop, pad_token_id=0,
        generation_config=transformers.GenerationConfig(),
    )[0, len(prompt):].tolist()
  assert list(got) == expected
  assert stop not in got[:6] and got[:first] == free[:first]


def test_bfloat16_load_is_close_to_float32(hf_dir):
  name, path, hf_model = hf_dir
  if name != "llama_gqa_headdim":
    pytest.skip("one architecture is enough")
  model = load_model(path, dtype="bfloat16")
  params = pz.select(model).at_instances_of(pz.ParameterValue).get_sequence()
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
