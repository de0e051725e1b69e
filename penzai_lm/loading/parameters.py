"""Turns canonical (Hugging Face) tensors into the model's parameters.

Hugging Face stores projections as (out, in). penzai_lm stores every weight
with its input axes first and its output axes last, so the compiled matmuls
read weights in place, without a transpose. Head axes follow
`penzai_lm.model.build.head_axes`: query head h = group * per_group + q, as
in Hugging Face's ``repeat_kv``.
"""

from __future__ import annotations

import numpy as np
from penzai import pz

from penzai_lm.checkpoints import Checkpoint
from penzai_lm.model import TransformerConfig
from penzai_lm.model.build import head_axes

# One named array to bind: (data, axis names).
Tensor = tuple[np.ndarray, tuple[str, ...]]


def _head_layout(config: TransformerConfig, for_queries: bool):
  common, query_only = head_axes(config)
  names = (*common, *(query_only if for_queries else {}))
  sizes = tuple({**common, **query_only}[n] for n in names)
  return names, sizes


def _query_like(config, w, bias, for_queries) -> dict[str, Tensor]:
  """(heads*head_dim, in) -> (embedding, *head axes, projection)."""
  names, sizes = _head_layout(config, for_queries)
  w = w.reshape(*sizes, config.head_dim, w.shape[-1])
  out = {"weights": (np.moveaxis(w, -1, 0), ("embedding", *names, "projection"))}
  if bias is not None:
    out["bias"] = (bias.reshape(*sizes, config.head_dim), (*names, "projection"))
  return out


def _output(config, w) -> Tensor:
  """(embedding, heads*head_dim) -> (*head axes, projection, embedding)."""
  names, sizes = _head_layout(config, True)
  w = w.reshape(w.shape[0], *sizes, config.head_dim)
  return np.moveaxis(w, 0, -1), (*names, "projection", "embedding")


def _norm(w, offset=0.0) -> Tensor:
  return w + offset, ("embedding",)


def _llama_like_layer(config, t, p) -> dict[str, Tensor]:
  """Tensors of one llama/mistral/qwen2/gemma3 layer, keyed by param label."""
  gemma = config.family == "gemma3"
  offset = 1.0 if gemma else 0.0  # Gemma's RMSNorm computes x * (1 + w).
  a = f"{p}self_attn."
  params = {}
  for name, hf, queries in (("query", "q", True), ("key", "k", False), ("value", "v", False)):
    parts = _query_like(
        config, t[f"{a}{hf}_proj.weight"], t.get(f"{a}{hf}_proj.bias"), queries
    )
    params[f"attention/{name}.weights"] = parts["weights"]
    if "bias" in parts:
      params[f"attention/{name}.bias"] = parts["bias"]
  params["attention/output.weights"] = _output(config, t[f"{a}o_proj.weight"])
  params["pre_attention_norm/scale.weights"] = _norm(t[f"{p}input_layernorm.weight"], offset)
  if gemma:
    params["attention/query_norm/scale.weights"] = (t[f"{a}q_norm.weight"] + 1.0, ("projection",))
    params["attention/key_norm/scale.weights"] = (t[f"{a}k_norm.weight"] + 1.0, ("projection",))
    params["post_attention_norm/scale.weights"] = _norm(t[f"{p}post_attention_layernorm.weight"], 1.0)
    params["pre_ffw_norm/scale.weights"] = _norm(t[f"{p}pre_feedforward_layernorm.weight"], 1.0)
    params["post_ffw_norm/scale.weights"] = _norm(t[f"{p}post_feedforward_layernorm.weight"], 1.0)
  else:
    params["pre_ffw_norm/scale.weights"] = _norm(t[f"{p}post_attention_layernorm.weight"])
  params["mlp/gating_linear.weights"] = (t[f"{p}mlp.gate_proj.weight"].T, ("embedding", "neurons"))
  params["mlp/value_linear.weights"] = (t[f"{p}mlp.up_proj.weight"].T, ("embedding", "neurons"))
  params["mlp/out_linear.weights"] = (t[f"{p}mlp.down_proj.weight"].T, ("neurons", "embedding"))
  return params


def _gpt2_layer(config, t, p) -> dict[str, Tensor]:
  """Tensors of one GPT-2 layer (Conv1D weights are already (in, out))."""
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


def _global_tensors(config, t) -> dict[str, Tensor]:
  if config.family == "gpt2":
    return {
        "embedder.embeddings": (t["transformer.wte.weight"], ("vocabulary", "embedding")),
        "position_embedder.embeddings": (t["transformer.wpe.weight"], ("positions", "embedding")),
        "final_norm/scale.weights": (t["transformer.ln_f.weight"], ("embedding",)),
        "final_norm/shift.bias": (t["transformer.ln_f.bias"], ("embedding",)),
    }
  offset = 1.0 if config.family == "gemma3" else 0.0
  params = {
      "embedder.embeddings": (t["model.embed_tokens.weight"], ("vocabulary", "embedding")),
      "final_norm/scale.weights": _norm(t["model.norm.weight"], offset),
  }
  if not config.tie_embeddings:
    params["lm_head.weights"] = (t["lm_head.weight"].T, ("embedding", "vocabulary"))
  return params


def parameters_from_checkpoint(
    checkpoint: Checkpoint, config: TransformerConfig, name: str = "transformer"
) -> list[pz.Parameter]:
  """Parameters for a model built by ``build_transformer(config)``.

  Args:
    checkpoint: The checkpoint, in canonical (Hugging Face) form.
    config: The configuration derived from it.
    name: The model's parameter label prefix.

  Returns:
    Parameters to bind with ``pz.bind_variables``.
  """
  t = checkpoint.tensors
  dtype = np.dtype(config.parameter_dtype)
  if config.family == "gpt2":
    layers = [_gpt2_layer(config, t, f"transformer.h.{i}.") for i in range(config.num_layers)]
  else:
    layers = [_llama_like_layer(config, t, f"model.layers.{i}.") for i in range(config.num_layers)]

  def make(label, data, axes):
    data = np.ascontiguousarray(np.asarray(data).astype(dtype))
    return pz.Parameter(value=pz.nx.wrap(data).tag(*axes), label=f"{name}/{label}")

  params = [make(k, *v) for k, v in _global_tensors(config, t).items()]
  if config.use_layer_stack:
    for key, (_, axes) in layers[0].items():
      stacked = np.stack([layer[key][0] for layer in layers])
      params.append(make(f"blocks/{key}", stacked, ("blocks", *axes)))
  else:
    for i, layer in enumerate(layers):
      params.extend(make(f"block_{i}/{k}", *v) for k, v in layer.items())
  return params
