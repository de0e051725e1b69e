"""The family registry: adapters set explicit features; options are checked."""

import pytest

from penzai_lm.checkpoints import Checkpoint
from penzai_lm.checkpoints import SUPPORTED_ARCHITECTURES
from penzai_lm.checkpoints import normalize_config
from penzai_lm.loading import config_from_checkpoint
from penzai_lm.loading.families import ADAPTERS
from penzai_lm.loading.families import adapter_for
from penzai_lm.model.config import PRESET_FEATURES


def _checkpoint(arch, **config):
  return Checkpoint(
      architecture=arch, config=normalize_config(arch, config), tensors={},
      source="<test>",
  )


def test_registry_covers_the_checkpoint_architectures():
  assert sorted(ADAPTERS) == sorted(SUPPORTED_ARCHITECTURES)
  with pytest.raises(ValueError, match="Unsupported architecture 'bert'"):
    adapter_for("bert")


@pytest.mark.parametrize("arch", sorted(ADAPTERS))
def test_adapters_set_every_feature_explicitly(arch):
  c = normalize_config(arch, {})
  fields = ADAPTERS[arch].config_fields(arch, c)
  assert isinstance(fields["family"], str)
  assert set(PRESET_FEATURES) <= set(fields)


def test_loaded_configs_have_their_features():
  gpt2 = config_from_checkpoint(_checkpoint("gpt2", n_positions=96))
  assert gpt2.max_cache_len == 96
  assert (gpt2.norm_kind, gpt2.mlp_kind, gpt2.mlp_bias) == ("layer", "plain", True)
  assert gpt2.tie_embeddings
  qwen2 = config_from_checkpoint(_checkpoint("qwen2"))
  assert qwen2.max_cache_len is None
  assert qwen2.qkv_bias and not qwen2.attention_output_bias
  gemma = config_from_checkpoint(
      _checkpoint("gemma3", hidden_size=64, final_logit_softcapping=30.0)
  )
  assert gemma.qk_norm and gemma.post_norms and gemma.embedding_scale == 8.0
  assert gemma.final_logit_softcap == 30.0 and gemma.attn_logit_softcap is None
  gemma2 = config_from_checkpoint(_checkpoint("gemma2", num_hidden_layers=5))
  assert gemma2.post_norms and not gemma2.qk_norm
  assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
  assert gemma2.layer_types == ("local", "global", "local", "global", "local")
  assert gemma2.local_rope_base is None and gemma2.query_pre_attn_scalar == 256
  qwen3 = config_from_checkpoint(_checkpoint("qwen3"))
  assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 128
  phi3 = config_from_checkpoint(_checkpoint("phi3", sliding_window=2047))
  assert phi3.sliding_window == 2047 and phi3.layer_types is None
  assert phi3.head_dim == 96 and not phi3.qkv_bias
  llama = config_from_checkpoint(
      _checkpoint("llama", attention_bias=True, mlp_bias=True)
  )
  assert llama.qkv_bias and llama.attention_output_bias and llama.mlp_bias


@pytest.mark.parametrize(
    "arch,config,message",
    [
        ("qwen2", dict(use_sliding_window=True), "use_sliding_window=True"),
        ("gemma3", dict(use_bidirectional_attention=True), "bidirectional"),
        ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        ("llama", dict(hidden_act="relu"), "hidden_act='relu'"),
        ("llama", dict(rope_scaling=dict(rope_type="yarn", factor=2.0)),
         "RoPE scaling of type 'yarn'"),
        ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "layer-index"),
        ("qwen3", dict(use_sliding_window=True, sliding_window=8),
         "use_sliding_window=True"),
        ("gemma2", dict(use_bidirectional_attention=True), "bidirectional"),
        ("phi3", dict(rope_scaling=dict(
            rope_type="longrope", short_factor=[1.0] * 48,
            long_factor=[2.0] * 48, original_max_position_embeddings=4096)),
         "RoPE scaling of type 'longrope'"),
        ("phi3", dict(partial_rotary_factor=0.75), "partial_rotary_factor"),
    ],
)
def test_unsupported_options_are_named(arch, config, message):
  with pytest.raises(ValueError, match=message):
    config_from_checkpoint(_checkpoint(arch, **config))


@pytest.mark.parametrize("arch,cls", [
    ("qwen3", "Qwen3Config"), ("phi3", "Phi3Config"),
    ("gemma2", "Gemma2Config"),
])
def test_new_families_normalize_like_transformers(arch, cls):
  transformers = pytest.importorskip("transformers")
  hf = getattr(transformers, cls)(num_hidden_layers=5).to_dict()
  ours = normalize_config(arch, {"num_hidden_layers": 5})
  for key, value in hf.items():
    if key == "rope_parameters":  # Phi-3 adds partial_rotary_factor=1.0.
      assert {k: ours[key][k] for k in ("rope_type", "rope_theta")} == {
          k: value[k] for k in ("rope_type", "rope_theta")
      }
    elif key in ("layer_types", "head_dim", "sliding_window",
               "num_key_value_heads", "attn_logit_softcapping",
               "final_logit_softcapping", "query_pre_attn_scalar",
               "attention_bias", "tie_word_embeddings", "eos_token_id"):
      assert ours[key] == value, key
