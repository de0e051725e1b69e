"""Adapter of Qwen3 (dense) models.

Qwen3 is Qwen2 without q/k/v biases (unless ``attention_bias``, which also
biases the output projection) and with a per-head RMSNorm on queries and keys
before RoPE (`common.llama_like_layer` reads ``q_norm`` / ``k_norm``).
"""

from __future__ import annotations

from typing import Any

from penzai_lm.loading.families.common import FamilyAdapter
from penzai_lm.loading.families.common import llama_like_globals
from penzai_lm.loading.families.common import llama_like_layer
from penzai_lm.loading.families.common import unsupported
from penzai_lm.loading.families.llama import llama_shared_fields


def _config(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  if c.get("use_sliding_window"):
    raise unsupported(arch, "sliding-window layers (use_sliding_window=True)")
  bias = bool(c.get("attention_bias"))
  return dict(
      llama_shared_fields(arch, c), family="qwen3", qk_norm=True,
      qkv_bias=bias, attention_output_bias=bias, mlp_bias=False,
  )


QWEN3 = FamilyAdapter(_config, llama_like_globals, llama_like_layer)
