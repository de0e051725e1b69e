"""Tiny random configurations covering every family and option."""

from penzai_lm.model import RopeScaling
from penzai_lm.model import TransformerConfig

_SMALL = dict(vocab_size=97, hidden_size=32, num_layers=3, mlp_hidden_size=48)

CONFIGS = {
    # Llama 2/3, SmolLM2: grouped-query attention, head_dim != hidden/heads.
    "llama_gqa": TransformerConfig(
        family="llama", num_heads=4, num_kv_heads=2, head_dim=12, **_SMALL
    ),
    # Multi-query attention, tied embeddings, Llama 3 RoPE scaling.
    "llama_mqa_scaled": TransformerConfig(
        family="llama", num_heads=4, num_kv_heads=1, head_dim=8,
        tie_embeddings=True,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8,
        ),
        **_SMALL,
    ),
    # Qwen2: multi-head attention with q/k/v biases.
    "qwen2_bias": TransformerConfig(
        family="llama", num_heads=4, num_kv_heads=4, head_dim=8,
        qkv_bias=True, rope_base=1e6, **_SMALL,
    ),
    # Mistral: every layer attends inside a sliding window.
    "mistral_window": TransformerConfig(
        family="llama", num_heads=4, num_kv_heads=2, head_dim=8,
        sliding_window=4, **_SMALL,
    ),
    # Gemma 3: local and global layers with their own RoPE bases.
    "gemma3": TransformerConfig(
        family="gemma3", vocab_size=97, hidden_size=32, num_layers=4,
        mlp_hidden_size=48, num_heads=4, num_kv_heads=1, head_dim=16,
        activation="gelu_tanh", norm_eps=1e-6, rope_base=1e6,
        local_rope_base=1e4, sliding_window=4,
        layer_types=("local", "local", "global", "local"),
        query_pre_attn_scalar=12, tie_embeddings=True,
    ),
    # Gemma 2: post norms without q/k norms, alternating local and global
    # layers sharing one RoPE base, soft-capped attention and final logits.
    "gemma2": TransformerConfig(
        family="custom", norm_kind="rms", position_embedding="rope",
        mlp_kind="gated", qkv_bias=False, attention_output_bias=False,
        mlp_bias=False, qk_norm=False, post_norms=True,
        embedding_scale=32**0.5, attn_logit_softcap=0.5,
        final_logit_softcap=3.0, num_heads=4, num_kv_heads=2, head_dim=16,
        activation="gelu_tanh", norm_eps=1e-6, sliding_window=4,
        layer_types=("local", "global", "local"), query_pre_attn_scalar=12,
        tie_embeddings=True, **_SMALL,
    ),
    # GPT-2: LayerNorm with bias, learned positions, biases everywhere.
    "gpt2": TransformerConfig(
        family="gpt2", num_heads=4, num_kv_heads=4, head_dim=8,
        activation="gelu_tanh", tie_embeddings=True,
        max_position_embeddings=64, **_SMALL,
    ),
}


def config(name: str, stacked: bool = True) -> TransformerConfig:
  return CONFIGS[name].replace(use_layer_stack=stacked)
