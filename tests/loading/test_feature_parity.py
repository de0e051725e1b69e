"""Feature combinations of tiny random HF models against transformers.

These cover what the checkpoints in test_hf_parity.py do not: Llama with
attention and MLP biases, Gemma 3 with final-logit soft-capping and attention
biases, GPT-2 with an untied head and unscaled attention logits. (Attention
soft-capping is checked against the numpy reference in
tests/model/test_features.py: transformers' Gemma 3 ignores that option.)
"""

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.model import KVCachingTransformerLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from penzai_lm.loading import load_model  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import hf_logits  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import logits  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import save_perturbed  # pylint: disable=g-import-not-at-top

_COMMON = dict(
    vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=128,
)


def _hf_models():
  t = transformers
  return {
      "llama_biases": (t.LlamaForCausalLM, t.LlamaConfig(
          **_COMMON, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
      )),
      "gemma3_softcap": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(
          **_COMMON, num_key_value_heads=2, head_dim=8, sliding_window=4,
          layer_types=["sliding_attention", "full_attention"],
          query_pre_attn_scalar=8, attention_bias=True,
          final_logit_softcapping=2.0,
      )),
      "gpt2_untied_unscaled": (t.GPT2LMHeadModel, t.GPT2Config(
          vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=16,
          tie_word_embeddings=False, scale_attn_weights=False,
      )),
  }


@pytest.fixture(scope="module", params=sorted(_hf_models()))
def hf_dir(request, tmp_path_factory):
  cls, config = _hf_models()[request.param]
  path = tmp_path_factory.mktemp(request.param)
  return request.param, path, save_perturbed(cls, config, path)


def test_feature_parity_with_transformers(hf_dir):
  name, path, hf_model = hf_dir
  model = load_model(path)
  ids = list(np.random.RandomState(3).randint(0, 101, size=12))
  got = logits(pz.freeze_params(model), pz.nx.wrap(jnp.array(ids)).tag("seq"))
  expected = hf_logits(hf_model, ids)
  np.testing.assert_allclose(
      np.asarray(got.unwrap("seq", "vocabulary")), expected, atol=1e-4,
      err_msg=name,
  )
  if name == "gemma3_softcap":
    assert np.abs(expected).max() < 2.0
    cached = KVCachingTransformerLM.from_uncached(model, 12, {"batch": 1})
    out = cached(pz.nx.wrap(jnp.array([ids])).tag("batch", "seq"))
    np.testing.assert_allclose(
        np.asarray(out.unwrap("batch", "seq", "vocabulary"))[0], expected,
        atol=1e-4,
    )
