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
    ],
)
def test_unsupported_options_are_named(arch, config, message):
  with pytest.raises(ValueError, match=message):
    config_from_checkpoint(_checkpoint(arch, **config))
