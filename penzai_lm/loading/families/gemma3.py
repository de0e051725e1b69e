"""Adapter of Gemma 3 text models.

Gemma 3 is Llama-like (`common.llama_like_layer`) plus per-head query/key
norms, norms after attention and after the MLP, embeddings scaled by
sqrt(hidden_size), a GeGLU MLP, and local sliding-window layers interleaved
with global ones, each kind with its own RoPE base, and optionally soft-capped
final logits. Its RMSNorms compute ``x * (1 + w)``: the loader adds 1 to
every norm scale.
"""

from __future__ import annotations

from typing import Any

from penzai_lm.loading.families.common import FamilyAdapter
from penzai_lm.loading.families.common import llama_like_globals
from penzai_lm.loading.families.common import llama_like_layer
from penzai_lm.loading.families.common import require_one_of
from penzai_lm.loading.families.common import rope_scaling
from penzai_lm.loading.families.common import unsupported

_NORM_OFFSET = 1.0
# HF layer_types entry -> `TransformerConfig.layer_types` entry.
LAYER_KINDS = {"sliding_attention": "local", "full_attention": "global"}


def optional_float(value) -> float | None:
  return None if value is None else float(value)


def gemma_shared_fields(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  """The feature fields Gemma 2 and Gemma 3 share (GeGLU, pre and post
  norms, scaled embeddings, sliding and global layers)."""
  if c.get("use_bidirectional_attention"):
    raise unsupported(arch, "bidirectional attention")
  require_one_of(
      arch, c, "hidden_activation", ("gelu_pytorch_tanh", "gelu_new")
  )
  bias = bool(c.get("attention_bias"))
  return dict(
      norm_kind="rms",
      position_embedding="rope",
      mlp_kind="gated",
      qkv_bias=bias,
      attention_output_bias=bias,
      mlp_bias=False,
      post_norms=True,
      embedding_scale=float(c["hidden_size"]) ** 0.5,
      final_logit_softcap=optional_float(c.get("final_logit_softcapping")),
      mlp_hidden_size=c["intermediate_size"],
      activation="gelu_tanh",
      norm_eps=float(c["rms_norm_eps"]),
      rope_base=float(c["rope_theta"]),
      rope_scaling=rope_scaling(arch, c),
      sliding_window=c["sliding_window"],
      layer_types=tuple(LAYER_KINDS[t] for t in c["layer_types"]),
      query_pre_attn_scalar=float(c["query_pre_attn_scalar"]),
  )


def _config(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  if c.get("attn_logit_softcapping") is not None:
    # transformers' Gemma 3 stores this option but never applies it, so it is
    # unclear what such a checkpoint expects.
    raise unsupported(
        arch, f"attn_logit_softcapping={c['attn_logit_softcapping']}"
    )
  return dict(gemma_shared_fields(arch, c), family="gemma3", qk_norm=True,
              local_rope_base=float(c["rope_local_base_freq"]))


def _globals(config, t):
  return llama_like_globals(config, t, _NORM_OFFSET)


def _layer(config, t, layer):
  return llama_like_layer(config, t, layer, _NORM_OFFSET)


GEMMA3 = FamilyAdapter(_config, _globals, _layer)
