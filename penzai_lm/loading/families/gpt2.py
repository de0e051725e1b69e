"""Adapter of GPT-2.

LayerNorm with bias, learned absolute positions, a plain two-layer GELU MLP,
biases on every projection, multi-head attention. GPT-2's Conv1D weights are
stored (in, out) already, and its q/k/v projections are fused in ``c_attn``.
"""

from __future__ import annotations

from typing import Any

from penzai_lm.loading.families.common import FamilyAdapter
from penzai_lm.loading.families.common import require_one_of
from penzai_lm.loading.families.common import unsupported


def _config(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  require_one_of(
      arch, c, "activation_function", ("gelu_new", "gelu_pytorch_tanh")
  )
  if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn"):
    raise unsupported(arch, "layer-index attention scaling")
  return dict(
      family="gpt2",
      norm_kind="layer",
      position_embedding="learned",
      mlp_kind="plain",
      qkv_bias=True,
      attention_output_bias=True,
      mlp_bias=True,
      qk_norm=False,
      post_norms=False,
      embedding_scale=None,
      mlp_hidden_size=c.get("n_inner") or 4 * c["n_embd"],
      activation="gelu_tanh",
      norm_eps=float(c["layer_norm_epsilon"]),
      tie_embeddings=bool(c.get("tie_word_embeddings", True)),
      # Without scale_attn_weights, attention logits are not scaled at all.
      query_pre_attn_scalar=None if c.get("scale_attn_weights", True) else 1.0,
  )


def _globals(config, t):
  params = {
      "embedder.embeddings": (t["transformer.wte.weight"], ("vocabulary", "embedding")),
      "position_embedder.embeddings": (t["transformer.wpe.weight"], ("positions", "embedding")),
      "final_norm/scale.weights": (t["transformer.ln_f.weight"], ("embedding",)),
      "final_norm/shift.bias": (t["transformer.ln_f.bias"], ("embedding",)),
  }
  if not config.tie_embeddings:
    params["lm_head.weights"] = (t["lm_head.weight"], ("vocabulary", "embedding"))
  return params


def _layer(config, t, layer):
  """Tensors of block ``transformer.h.{layer}``."""
  p = f"transformer.h.{layer}."
  hidden = config.hidden_size
  qkv_w, qkv_b = t[f"{p}attn.c_attn.weight"], t[f"{p}attn.c_attn.bias"]
  params = {}
  heads = (config.num_heads, config.head_dim)
  for i, name in enumerate(("query", "key", "value")):
    w = qkv_w[:, i * hidden : (i + 1) * hidden].reshape(hidden, *heads)
    b = qkv_b[i * hidden : (i + 1) * hidden].reshape(heads)
    params[f"attention/{name}.weights"] = (w, ("embedding", "heads", "projection"))
    params[f"attention/{name}.bias"] = (b, ("heads", "projection"))
  params["attention/output.weights"] = (
      t[f"{p}attn.c_proj.weight"].reshape(*heads, hidden),
      ("heads", "projection", "embedding"),
  )
  params["attention/output.bias"] = (t[f"{p}attn.c_proj.bias"], ("embedding",))
  for mine, hf in (("pre_attention_norm", "ln_1"), ("pre_ffw_norm", "ln_2")):
    params[f"{mine}/scale.weights"] = (t[f"{p}{hf}.weight"], ("embedding",))
    params[f"{mine}/shift.bias"] = (t[f"{p}{hf}.bias"], ("embedding",))
  params["mlp/in_linear.weights"] = (t[f"{p}mlp.c_fc.weight"], ("embedding", "neurons"))
  params["mlp/in_linear.bias"] = (t[f"{p}mlp.c_fc.bias"], ("neurons",))
  params["mlp/out_linear.weights"] = (t[f"{p}mlp.c_proj.weight"], ("neurons", "embedding"))
  params["mlp/out_linear.bias"] = (t[f"{p}mlp.c_proj.bias"], ("embedding",))
  return params


GPT2 = FamilyAdapter(_config, _globals, _layer)
