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
from penzai_lm.loading.families.gemma3 import GEMMA3
from penzai_lm.loading.families.gemma3 import gemma_shared_fields
from penzai_lm.loading.families.gemma3 import optional_float


def _config(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  return dict(gemma_shared_fields(arch, c), family="gemma2", qk_norm=False,
              attn_logit_softcap=optional_float(
                  c.get("attn_logit_softcapping")))


# The tensors are named as Gemma 3's, without q/k norms (the feature is off).
GEMMA2 = FamilyAdapter(_config, GEMMA3.global_tensors, GEMMA3.layer_tensors)
