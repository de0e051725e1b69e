"""A naive float64 numpy forward pass, independent of penzai_lm's layers.

It reads the parameters of a penzai_lm model by label and recomputes logits
with plain loops over layers and heads, so tests can check the model (and its
sliding-window masks) against code that shares nothing with it but the
parameter values.
"""

import math

import numpy as np
from penzai import pz


def _params(model):
  params = pz.select(pz.freeze_params(model)).at_instances_of(
      pz.ParameterValue).get_sequence()
  return {p.label: p.value for p in params}


def _layer_param(params, name, layer, stacked, *axes):
  if stacked:
    value = params[f"transformer/blocks/{name}"]
    value = value[{"blocks": layer}]
  else:
    value = params[f"transformer/block_{layer}/{name}"]
  return np.asarray(value.unwrap(*axes), np.float64)


def _head_names(config):
  per_group = config.num_heads // config.num_kv_heads
  if per_group == 1:
    return ("heads",), ("heads",)
  if config.num_kv_heads == 1:
    return ("query_heads",), ()
  return ("head_groups", "query_heads"), ("head_groups",)


def _rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def _layer_norm(x, scale, bias, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * scale + bias


def _llama3_scaled(inv, scaling):
  """Llama 3 frequency scaling, written per frequency as in Meta's code."""
  old = scaling.original_max_position_embeddings
  out = []
  for freq in inv:
    wavelen = 2 * math.pi / freq
    if wavelen < old / scaling.high_freq_factor:
      out.append(freq)
    elif wavelen > old / scaling.low_freq_factor:
      out.append(freq / scaling.factor)
    else:
      smooth = (old / wavelen - scaling.low_freq_factor) / (
          scaling.high_freq_factor - scaling.low_freq_factor)
      out.append((1 - smooth) * freq / scaling.factor + smooth * freq)
  return np.array(out)


def _rope(x, positions, base, scaling=None):
  half = x.shape[-1] // 2
  inv = 1.0 / base ** (np.arange(half) * 2 / x.shape[-1])
  if scaling is not None:
    inv = _llama3_scaled(inv, scaling)
  ang = positions[:, None] * inv[None, :]
  cos, sin = np.cos(ang), np.sin(ang)
  a, b = x[..., :half], x[..., half:]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def reference_logits(model, tokens: np.ndarray) -> np.ndarray:
  """Logits of one unpadded sequence ``tokens`` (1-D), shape (len, vocab)."""
  config = model.config
  params = _params(model)
  stacked = config.use_layer_stack
  seq = len(tokens)
  positions = np.arange(seq, dtype=np.float64)
  emb = np.asarray(
      params["transformer/embedder.embeddings"].unwrap("vocabulary", "embedding"),
      np.float64,
  )
  x = emb[tokens]
  if config.embedding_scale is not None:
    x = x * config.embedding_scale
  if config.position_embedding == "learned":
    table = params["transformer/position_embedder.embeddings"]
    x = x + np.asarray(table.unwrap("positions", "embedding"), np.float64)[:seq]
  q_heads, kv_heads = _head_names(config)
  per_group = config.num_heads // config.num_kv_heads
  eps = config.norm_eps

  def norm(name, layer, h):
    scale = _layer_param(params, f"{name}/scale.weights", layer, stacked, "embedding")
    if config.norm_kind == "layer":
      bias = _layer_param(params, f"{name}/shift.bias", layer, stacked, "embedding")
      return _layer_norm(h, scale, bias, eps)
    return _rms(h, scale, eps)

  def proj(name, layer, h, out_axes, bias):
    w = _layer_param(params, f"attention/{name}.weights", layer, stacked,
                     "embedding", *out_axes, "projection")
    w = w.reshape(w.shape[0], -1, config.head_dim)
    out = np.einsum("se,ehp->shp", h, w)
    if bias:
      b = _layer_param(params, f"attention/{name}.bias", layer, stacked,
                       *out_axes, "projection")
      out = out + b.reshape(-1, config.head_dim)
    return out

  for layer, kind in enumerate(config.resolved_layer_types):
    h = norm("pre_attention_norm", layer, x)
    bias = config.qkv_bias
    q = proj("query", layer, h, q_heads, bias)
    k = proj("key", layer, h, kv_heads, bias)
    v = proj("value", layer, h, kv_heads, bias)
    if config.qk_norm:
      qs = _layer_param(params, "attention/query_norm/scale.weights", layer, stacked, "projection")
      ks = _layer_param(params, "attention/key_norm/scale.weights", layer, stacked, "projection")
      q, k = _rms(q, qs, eps), _rms(k, ks, eps)
    if config.position_embedding == "rope":
      base, scaling = config.rope_base, config.rope_scaling
      if kind == "local" and config.local_rope_base is not None:
        base, scaling = config.local_rope_base, None
      q = np.stack([_rope(q[:, i], positions, base, scaling) for i in range(q.shape[1])], 1)
      k = np.stack([_rope(k[:, i], positions, base, scaling) for i in range(k.shape[1])], 1)
    q = q * config.query_scale
    out = np.zeros_like(q)
    for head in range(config.num_heads):
      kv = head // per_group
      for t in range(seq):
        lo = 0 if kind == "global" else max(0, t - config.sliding_window + 1)
        scores = q[t, head] @ k[lo : t + 1, kv].T
        if config.attn_logit_softcap is not None:
          cap = config.attn_logit_softcap
          scores = np.tanh(scores / cap) * cap
        w = np.exp(scores - scores.max())
        w /= w.sum()
        out[t, head] = w @ v[lo : t + 1, kv]
    wo = _layer_param(params, "attention/output.weights", layer, stacked,
                      *q_heads, "projection", "embedding")
    attn = np.einsum("shp,hpe->se", out, wo.reshape(-1, config.head_dim, wo.shape[-1]))
    if config.attention_output_bias:
      attn = attn + _layer_param(params, "attention/output.bias", layer, stacked, "embedding")
    if config.post_norms:
      attn = norm("post_attention_norm", layer, attn)
    x = x + attn

    h = norm("pre_ffw_norm", layer, x)

    def mlp_w(name, *axes):
      return _layer_param(params, f"mlp/{name}.weights", layer, stacked, *axes)

    def mlp_b(name, axis):
      if not config.mlp_bias:
        return 0.0
      return _layer_param(params, f"mlp/{name}.bias", layer, stacked, axis)

    def act(z):
      return z / (1 + np.exp(-z)) if config.activation == "silu" else _gelu_tanh(z)

    if config.mlp_kind == "plain":
      hidden = h @ mlp_w("in_linear", "embedding", "neurons") + mlp_b("in_linear", "neurons")
      out = act(hidden) @ mlp_w("out_linear", "neurons", "embedding")
    else:
      gate = act(h @ mlp_w("gating_linear", "embedding", "neurons")
                 + mlp_b("gating_linear", "neurons"))
      value = (h @ mlp_w("value_linear", "embedding", "neurons")
               + mlp_b("value_linear", "neurons"))
      out = (gate * value) @ mlp_w("out_linear", "neurons", "embedding")
    out = out + mlp_b("out_linear", "embedding")
    if config.post_norms:
      out = norm("post_ffw_norm", layer, out)
    x = x + out

  final = params["transformer/final_norm/scale.weights"].unwrap("embedding")
  if config.norm_kind == "layer":
    shift = params["transformer/final_norm/shift.bias"].unwrap("embedding")
    x = _layer_norm(x, np.asarray(final, np.float64), np.asarray(shift, np.float64), eps)
  else:
    x = _rms(x, np.asarray(final, np.float64), eps)
  if config.tie_embeddings:
    logits = x @ emb.T
  else:
    head = params["transformer/lm_head.weights"].unwrap("embedding", "vocabulary")
    logits = x @ np.asarray(head, np.float64)
  if config.final_logit_softcap is not None:
    cap = config.final_logit_softcap
    logits = np.tanh(logits / cap) * cap
  return logits
