"""Per-architecture tables of the canonical (Hugging Face) layout.

For each supported architecture: its Hugging Face causal-LM class, the
``model_type`` HF writes into ``config.json``, and the defaults of its
transformers 5.x config class. Also the "unsupported architecture" check shared
by the readers.
"""

from __future__ import annotations

from typing import Any

# Canonical architecture name (HF ``model_type`` family) -> HF causal-LM class.
ARCHITECTURE_CLASSES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURE_CLASSES)

# The ``model_type`` HF writes into config.json for each architecture.
MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "gemma3": "gemma3_text",
    "gpt2": "gpt2",
}

# Defaults of the transformers 5.x config classes (LlamaConfig, MistralConfig,
# Qwen2Config, Gemma3TextConfig, GPT2Config). ``None`` entries that depend on
# other fields are derived in
# :func:`~penzai_lm.checkpoints.config_normalization.normalize_config`.
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        hidden_act="silu",
        max_position_embeddings=2048,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        pretraining_tp=1,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        mlp_bias=False,
        head_dim=None,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=4096 * 32,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        sliding_window=4096,
        attention_dropout=0.0,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        hidden_act="silu",
        max_position_embeddings=32768,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
        layer_types=None,
        attention_dropout=0.0,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "gemma3": dict(
        vocab_size=262_208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131_072,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        layer_types=None,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        use_bidirectional_attention=False,
    ),
    "gpt2": dict(
        vocab_size=50257,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_inner=None,
        activation_function="gelu_new",
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        layer_norm_epsilon=1e-5,
        initializer_range=0.02,
        summary_type="cls_index",
        summary_use_proj=True,
        summary_activation=None,
        summary_proj_to_labels=True,
        summary_first_dropout=0.1,
        scale_attn_weights=True,
        use_cache=True,
        bos_token_id=50256,
        eos_token_id=50256,
        pad_token_id=None,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        add_cross_attention=False,
        tie_word_embeddings=True,
    ),
}


def unsupported_architecture_message(what: str, supported: str) -> str:
  """The error message for an architecture outside ``supported``."""
  return f"Unsupported architecture {what}. Supported: {supported}."


def check_architecture(architecture: str) -> None:
  """Raises ValueError for an architecture not in SUPPORTED_ARCHITECTURES."""
  if architecture not in ARCHITECTURE_CLASSES:
    raise ValueError(
        unsupported_architecture_message(
            repr(architecture), ", ".join(SUPPORTED_ARCHITECTURES)
        )
    )
