"""Adapter of Phi-3 models (HF ``model_type`` "phi3": Phi-3 and Phi-3.5 mini / medium).

Phi-3 is a Llama (RMSNorm, RoPE, SwiGLU, no biases) whose checkpoints fuse
the query/key/value projections into ``self_attn.qkv_proj`` (queries, keys,
values stacked on the output axis) and the gate/up projections into
``mlp.gate_up_proj`` (gate first). They are split here into the Llama names
and mapped by `common.llama_like_layer`. When ``sliding_window`` is set,
every layer attends inside it (as Mistral's).

Only plain RoPE (or Llama 3 scaling) over the whole head is implemented:
LongRoPE (the 128k-context models) and ``partial_rotary_factor`` < 1 raise.
"""

from __future__ import annotations

from typing import Any

from penzai_lm.loading.families.common import FamilyAdapter
from penzai_lm.loading.families.common import Tensors
from penzai_lm.loading.families.common import llama_like_globals
from penzai_lm.loading.families.common import llama_like_layer
from penzai_lm.loading.families.common import unsupported
from penzai_lm.loading.families.llama import llama_shared_fields


def _config(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  rope = c.get("rope_parameters") or {}
  partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
  if partial is not None and float(partial) != 1.0:
    raise unsupported(arch, f"partial_rotary_factor={partial}")
  return dict(
      llama_shared_fields(arch, c), family="phi3", qkv_bias=False,
      attention_output_bias=False, mlp_bias=False,
      sliding_window=c.get("sliding_window"),
  )


def _split_layer(config, t: Tensors, layer: int) -> dict[str, Any]:
  """Layer ``layer``'s tensors under Llama names (q/k/v, gate/up split)."""
  p = f"model.layers.{layer}."
  a, m = f"{p}self_attn.", f"{p}mlp."
  q_rows = config.num_heads * config.head_dim
  kv_rows = config.num_kv_heads * config.head_dim
  qkv = t[f"{a}qkv_proj.weight"]
  gate_up = t[f"{m}gate_up_proj.weight"]
  inter = gate_up.shape[0] // 2
  names = (
      "input_layernorm.weight", "post_attention_layernorm.weight",
      "self_attn.o_proj.weight", "mlp.down_proj.weight",
  )
  return {
      **{p + n: t[p + n] for n in names},
      f"{a}q_proj.weight": qkv[:q_rows],
      f"{a}k_proj.weight": qkv[q_rows:q_rows + kv_rows],
      f"{a}v_proj.weight": qkv[q_rows + kv_rows:],
      f"{m}gate_proj.weight": gate_up[:inter],
      f"{m}up_proj.weight": gate_up[inter:],
  }


def _layer(config, t, layer):
  return llama_like_layer(config, _split_layer(config, t, layer), layer)


PHI3 = FamilyAdapter(_config, llama_like_globals, _layer)
