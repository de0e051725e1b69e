"""Adapter of Gemma 2 models (also the models Gemma Scope's SAEs were trained
on: gemma-2-2b, gemma-2-9b).

Gemma 2 has Gemma 3's block without the query/key norms: norms before and
after attention and the MLP, embeddings scaled by sqrt(hidden_size), a GeGLU
MLP, RMSNorms computing ``x * (1 + w)`` (the loader adds 1 to every scale),
queries scaled by ``query_pre_attn_scalar ** -0.5``. Sliding-window and
global layers alternate (even layers slide), with one RoPE base; attention
logits and final logits are soft-capped (``attn_logit_softcapping``,
``final_logit_softcapping``).
"""

from __future__ import annotations

from typing import Any

from penzai_lm.loading.families.common import FamilyAdapter
from penzai_lm.loading.families.common import require_one_of
from penzai_lm.loading.families.common import rope_scaling
from penzai_lm.loading.families.common import unsupported
from penzai_lm.loading.families.gemma3 import GEMMA3
from penzai_lm.loading.families.gemma3 import LAYER_KINDS
from penzai_lm.loading.families.gemma3 import optional_float


def _config(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  if c.get("use_bidirectional_attention"):
    raise unsupported(arch, "bidirectional attention")
  require_one_of(
      arch, c, "hidden_activation", ("gelu_pytorch_tanh", "gelu_new")
  )
  bias = bool(c.get("attention_bias"))
  return dict(
      family="gemma2",
      norm_kind="rms",
      position_embedding="rope",
      mlp_kind="gated",
      qkv_bias=bias,
      attention_output_bias=bias,
      mlp_bias=False,
      qk_norm=False,
      post_norms=True,
      embedding_scale=float(c["hidden_size"]) ** 0.5,
      attn_logit_softcap=optional_float(c.get("attn_logit_softcapping")),
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


# The tensors are named as Gemma 3's, without q/k norms (the feature is off).
GEMMA2 = FamilyAdapter(_config, GEMMA3.global_tensors, GEMMA3.layer_tensors)
