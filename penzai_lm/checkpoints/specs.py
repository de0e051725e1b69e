"""The supported architectures, each declared once, as an `ArchitectureSpec`.

This module is the one place that names architectures for the checkpoint
readers. Each spec (types in :mod:`~penzai_lm.checkpoints.spec_types`) says,
as frozen data, how its Hugging Face directories are recognized and cleaned
up, how its config is completed, which tensors it has, and how its GGUF files
map onto that. The readers (``hf_reader``, ``gguf_*``, ``config_normalization``,
``layout``) interpret the fields and hold no architecture names;
``architectures`` derives the lookup tables (``ARCHITECTURE_CLASSES``, ...)
from :data:`SPECS`.

Adding an architecture (Qwen3, below, is a Qwen2 with per-head q/k norms):

1. Declare its spec here and append it to :data:`SPECS` (often a
   ``dataclasses.replace`` of a close relative). Every reader then knows it.
2. Give it a loading adapter, keyed by the spec's name, in
   ``penzai_lm/loading/families/registry.py`` (reusing an existing adapter
   when its features fit, or writing one in ``families/``).
3. Test it: a tiny random transformers model read and loaded, its logits
   compared with transformers' (``tests/loading/test_hf_parity.py``).

A spec can also be used without editing this module: every reader takes a
``specs`` sequence (default :data:`SPECS`), and ``penzai_lm.loading.load``
takes ``specs`` and ``adapters``; see ``tests/checkpoints/test_specs.py``.
A layout or config rule that no field describes needs a new field (or rule
type) in ``spec_types`` and its interpretation in the reader.
"""

from __future__ import annotations

from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.spec_types import Conv1DLayout
from penzai_lm.checkpoints.spec_types import DecoderLayout
from penzai_lm.checkpoints.spec_types import GGUFQueryScale
from penzai_lm.checkpoints.spec_types import GGUFSpec
from penzai_lm.checkpoints.spec_types import HFSpec
from penzai_lm.checkpoints.spec_types import MetadataField
from penzai_lm.checkpoints.spec_types import MultimodalSpec
from penzai_lm.checkpoints.spec_types import RopeSpec
from penzai_lm.checkpoints.spec_types import SlidingFromLayer
from penzai_lm.checkpoints.spec_types import SlidingPeriodic

# Gemma 3 facts not stored in its GGUF files (llama.cpp hard-codes them too).
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer (5, 11, 17, ...) is global

# llama.cpp block tensor kinds of a Llama-style decoder -> HF module paths.
_LLAMA_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Gemma's sandwich norms (gemma2, gemma3) on top of the Llama names.
_GEMMA_GGUF_BLOCK = {
    **_LLAMA_GGUF_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Metadata both Gemma GGUF architectures may carry.
_GEMMA_GGUF_METADATA = (
    MetadataField("attention.sliding_window", "sliding_window", int),
    MetadataField("final_logit_softcapping", "final_logit_softcapping", float),
    MetadataField("attn_logit_softcapping", "attn_logit_softcapping", float),
)

# llama.cpp's converter permutes q/k rows only for the llama architecture
# (which is also what it writes for MistralForCausalLM); qwen2, qwen3, gemma2,
# gemma3 and phi3 keep HF's rotate-half rows, as transformers' GGUF loader
# assumes (it un-permutes for "llama" only).

# Defaults below are those of the transformers 5.x config classes.

LLAMA = ArchitectureSpec(
    name="llama",
    hf=HFSpec(classes=("LlamaForCausalLM",), model_types=("llama",)),
    config_defaults=dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
        hidden_act="silu", max_position_embeddings=2048,
        initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
        pad_token_id=None, bos_token_id=1, eos_token_id=2, pretraining_tp=1,
        tie_word_embeddings=False, attention_bias=False,
        attention_dropout=0.0, mlp_bias=False, head_dim=None,
    ),
    rope=RopeSpec(theta=10000.0),
    layout=DecoderLayout(
        qkv_bias="attention_bias", output_bias="attention_bias",
        mlp_bias="mlp_bias",
    ),
    gguf=GGUFSpec(
        architecture="llama",
        block_names=_LLAMA_GGUF_BLOCK,
        unpermute_qk=True,
        extra_tensors=("rope_freqs.weight",),
        bias_flags={
            "attention_bias": "blk.0.attn_q.bias",
            "mlp_bias": "blk.0.ffn_gate.bias",
        },
        head_dim_keys=("attention.key_length", "rope.dimension_count"),
        fixed_config={"hidden_act": "silu"},
    ),
)

# No gguf part: llama.cpp's converter writes MistralForCausalLM as "llama"
# (q/k permuted, no sliding window in that format), read by LLAMA's spec.
MISTRAL = ArchitectureSpec(
    name="mistral",
    hf=HFSpec(classes=("MistralForCausalLM",), model_types=("mistral",)),
    config_defaults=dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=None, hidden_act="silu", max_position_embeddings=4096 * 32,
        initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
        pad_token_id=None, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, sliding_window=4096, attention_dropout=0.0,
    ),
    rope=RopeSpec(theta=10000.0),
    layout=DecoderLayout(),
)

QWEN2 = ArchitectureSpec(
    name="qwen2",
    hf=HFSpec(classes=("Qwen2ForCausalLM",), model_types=("qwen2",)),
    config_defaults=dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        hidden_act="silu", max_position_embeddings=32768,
        initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
        tie_word_embeddings=False, use_sliding_window=False,
        sliding_window=4096, max_window_layers=28, layer_types=None,
        attention_dropout=0.0, pad_token_id=None, bos_token_id=None,
        eos_token_id=None,
    ),
    rope=RopeSpec(theta=10000.0),
    sliding_layers=SlidingFromLayer(),
    layout=DecoderLayout(qkv_bias=True),
    gguf=GGUFSpec(
        architecture="qwen2",
        block_names=_LLAMA_GGUF_BLOCK,
        head_dim_keys=("attention.key_length", "rope.dimension_count"),
        fixed_config={"hidden_act": "silu"},
    ),
)

# Qwen3: Qwen2's config (no sliding window by default), no biases unless
# attention_bias, per-head q/k RMSNorms, head_dim 128 by default.
QWEN3 = ArchitectureSpec(
    name="qwen3",
    hf=HFSpec(classes=("Qwen3ForCausalLM",), model_types=("qwen3",)),
    config_defaults={
        **QWEN2.config_defaults, "head_dim": 128, "attention_bias": False,
        "sliding_window": None,
    },
    rope=RopeSpec(theta=10000.0),
    sliding_layers=SlidingFromLayer(),
    layout=DecoderLayout(
        qkv_bias="attention_bias", output_bias="attention_bias", qk_norm=True
    ),
    gguf=GGUFSpec(
        architecture="qwen3",
        block_names={
            **_LLAMA_GGUF_BLOCK,
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
        },
        bias_flags={"attention_bias": "blk.0.attn_q.bias"},
        head_dim_keys=("attention.key_length", "rope.dimension_count"),
        fixed_config={"hidden_act": "silu"},
    ),
)

# Phi-3 (mini, small, medium): a Llama with fused q/k/v and gate/up
# projections, no biases; every layer slides when sliding_window is set.
PHI3 = ArchitectureSpec(
    name="phi3",
    hf=HFSpec(classes=("Phi3ForCausalLM",), model_types=("phi3",)),
    config_defaults=dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
        head_dim=None, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        hidden_act="silu", max_position_embeddings=4096,
        original_max_position_embeddings=4096, initializer_range=0.02,
        rms_norm_eps=1e-5, use_cache=True, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=32000, pad_token_id=32000,
        sliding_window=None,
    ),
    rope=RopeSpec(theta=10000.0),
    layout=DecoderLayout(fused_qkv=True, fused_gate_up=True),
    gguf=GGUFSpec(
        architecture="phi3",
        block_names={
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_up": "mlp.gate_up_proj",  # gate, then up
            "ffn_down": "mlp.down_proj",
        },
        fixed_config={"hidden_act": "silu"},
        optional_metadata=(
            # llama.cpp writes 0 for "no window".
            MetadataField(
                "attention.sliding_window", "sliding_window",
                lambda v: int(v) or None,
            ),
            MetadataField(
                "rope.scaling.original_context_length",
                "original_max_position_embeddings", int,
            ),
        ),
        refused_tensors={
            name: "LongRoPE (the 128k-context Phi-3 models' rope_scaling with"
            " long_factor / short_factor), which is not supported"
            for name in (
                "rope_factors_long.weight", "rope_factors_short.weight"
            )
        },
    ),
)

# Gemma 2: Gemma 3's block without q/k norms; sliding and global layers
# alternate (even layers slide), one RoPE base, soft-capped attention and
# final logits.
GEMMA2 = ArchitectureSpec(
    name="gemma2",
    hf=HFSpec(classes=("Gemma2ForCausalLM",), model_types=("gemma2",)),
    config_defaults=dict(
        vocab_size=256_000, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=8192, initializer_range=0.02,
        rms_norm_eps=1e-6, use_cache=True, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
        attention_dropout=0.0, query_pre_attn_scalar=256, sliding_window=4096,
        layer_types=None, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0, use_bidirectional_attention=None,
    ),
    rope=RopeSpec(theta=10000.0),
    sliding_layers=SlidingPeriodic(period=2),
    layout=DecoderLayout(
        qkv_bias="attention_bias", output_bias="attention_bias",
        sandwich_norms=True,
    ),
    gguf=GGUFSpec(
        architecture="gemma2",
        block_names=_GEMMA_GGUF_BLOCK,
        # Gemma2RMSNorm computes x * (1 + w); llama.cpp stores 1 + w.
        norm_offset=1.0,
        bias_flags={"attention_bias": "blk.0.attn_q.bias"},
        default_head_dim=256,
        fixed_config={
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window_pattern": 2,  # llama.cpp: even layers slide
        },
        optional_metadata=_GEMMA_GGUF_METADATA,
        # llama.cpp: 1/sqrt(head_dim), except Gemma 2 27B (46 layers), which
        # uses 1/sqrt(hidden_size / num_heads) (its query_pre_attn_scalar 144).
        query_scale=GGUFQueryScale(hidden_per_head_layer_counts=(46,)),
    ),
)

GEMMA3 = ArchitectureSpec(
    name="gemma3",
    hf=HFSpec(
        classes=("Gemma3ForCausalLM",),
        model_types=("gemma3_text",),
        # Gemma3ForConditionalGeneration: transformers 4.x saves
        # language_model.model.* / language_model.lm_head.*, 5.x saves
        # model.language_model.* / lm_head.*, next to the vision tower.
        dropped_tensors=(r"^(model\.)?(vision_tower|multi_modal_projector)\.",),
        tensor_renames=(
            (r"^language_model\.model\.", "model."),
            (r"^language_model\.lm_head\.", "lm_head."),
            (r"^model\.language_model\.", "model."),
        ),
        multimodal=MultimodalSpec(
            classes=("Gemma3ForConditionalGeneration",),
            model_type="gemma3",
            # The wrapper's text_config defaults to the 4B model's vocabulary;
            # the wrapper ties embeddings by default.
            text_defaults={"vocab_size": 262_208, "tie_word_embeddings": True},
        ),
    ),
    config_defaults=dict(
        vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131_072, initializer_range=0.02,
        rms_norm_eps=1e-6, use_cache=True, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
        attention_dropout=0.0, query_pre_attn_scalar=256, sliding_window=4096,
        layer_types=None, final_logit_softcapping=None,
        attn_logit_softcapping=None, use_bidirectional_attention=False,
    ),
    rope=RopeSpec(theta=1_000_000.0, local_theta=GEMMA3_ROPE_LOCAL_BASE_FREQ),
    sliding_layers=SlidingPeriodic(period=GEMMA3_SLIDING_WINDOW_PATTERN),
    layout=DecoderLayout(
        qkv_bias="attention_bias", output_bias="attention_bias",
        qk_norm=True, sandwich_norms=True,
    ),
    gguf=GGUFSpec(
        architecture="gemma3",
        block_names={
            **_GEMMA_GGUF_BLOCK,
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
        },
        # Gemma3RMSNorm computes x * (1 + w); llama.cpp stores 1 + w.
        norm_offset=1.0,
        bias_flags={"attention_bias": "blk.0.attn_q.bias"},
        default_head_dim=256,
        fixed_config={
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_local_base_freq": GEMMA3_ROPE_LOCAL_BASE_FREQ,
            "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN,
        },
        optional_metadata=_GEMMA_GGUF_METADATA,
        # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers), which
        # uses 1/sqrt(hidden_size / num_heads).
        query_scale=GGUFQueryScale(hidden_per_head_layer_counts=(62,)),
    ),
)

GPT2 = ArchitectureSpec(
    name="gpt2",
    hf=HFSpec(
        classes=("GPT2LMHeadModel",),
        model_types=("gpt2",),
        # The causal-mask buffers older checkpoints carry.
        dropped_tensors=(r"(^|\.)attn\.(bias|masked_bias)$",),
        # GPT2Model checkpoints lack the "transformer." prefix.
        tensor_renames=((r"^(?!transformer\.|lm_head\.)", "transformer."),),
    ),
    config_defaults=dict(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        n_inner=None, activation_function="gelu_new", resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, layer_norm_epsilon=1e-5,
        initializer_range=0.02, summary_type="cls_index",
        summary_use_proj=True, summary_activation=None,
        summary_proj_to_labels=True, summary_first_dropout=0.1,
        scale_attn_weights=True, use_cache=True, bos_token_id=50256,
        eos_token_id=50256, pad_token_id=None,
        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        add_cross_attention=False, tie_word_embeddings=True,
    ),
    # HF's attribute_map aliases, handy for generic code.
    config_aliases=dict(
        hidden_size="n_embd", num_attention_heads="n_head",
        num_hidden_layers="n_layer", max_position_embeddings="n_positions",
    ),
    layout=Conv1DLayout(mlp_ratio=4),
)

# Every supported architecture, in the order error messages list them.
SPECS: tuple[ArchitectureSpec, ...] = (
    LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3, GPT2,
)
