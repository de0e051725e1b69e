"""Adapters of the Llama-like families: Llama 2/3 (SmolLM2), Mistral, Qwen2.

All three: RMSNorm, RoPE (Llama 3 scaling allowed), a gated SiLU MLP and
grouped-query attention; they share `common.llama_like_layer`. Llama may have
q/k/v/o biases (``attention_bias``) and MLP biases (``mlp_bias``), Qwen2 has
q/k/v biases, Mistral attends inside a sliding window.
"""

from __future__ import annotations

from typing import Any

from penzai_lm.loading.families.common import FamilyAdapter
from penzai_lm.loading.families.common import llama_like_globals
from penzai_lm.loading.families.common import llama_like_layer
from penzai_lm.loading.families.common import require_one_of
from penzai_lm.loading.families.common import rope_scaling
from penzai_lm.loading.families.common import unsupported


def llama_shared_fields(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  """Fields every Llama-like checkpoint maps the same way (Qwen3 and Phi-3
  too); the caller adds the biases and sets its own ``family``."""
  require_one_of(arch, c, "hidden_act", ("silu",))
  return dict(
      family="llama",
      norm_kind="rms",
      position_embedding="rope",
      mlp_kind="gated",
      qk_norm=False,
      post_norms=False,
      embedding_scale=None,
      mlp_hidden_size=c["intermediate_size"],
      activation="silu",
      norm_eps=float(c["rms_norm_eps"]),
      rope_base=float(c["rope_theta"]),
      rope_scaling=rope_scaling(arch, c),
  )


def _llama(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  bias = bool(c.get("attention_bias"))
  return dict(
      llama_shared_fields(arch, c), qkv_bias=bias, attention_output_bias=bias,
      mlp_bias=bool(c.get("mlp_bias")),
  )


def _mistral(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  return dict(
      llama_shared_fields(arch, c), qkv_bias=False, attention_output_bias=False,
      mlp_bias=False, sliding_window=c.get("sliding_window"),
  )


def _qwen2(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  if c.get("use_sliding_window"):
    raise unsupported(arch, "sliding-window layers (use_sliding_window=True)")
  return dict(
      llama_shared_fields(arch, c), qkv_bias=True, attention_output_bias=False,
      mlp_bias=False,
  )


LLAMA = FamilyAdapter(_llama, llama_like_globals, llama_like_layer)
MISTRAL = FamilyAdapter(_mistral, llama_like_globals, llama_like_layer)
QWEN2 = FamilyAdapter(_qwen2, llama_like_globals, llama_like_layer)
