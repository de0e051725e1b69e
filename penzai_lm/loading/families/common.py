"""Helpers shared by the family adapters.

A `FamilyAdapter` maps one checkpoint architecture onto penzai_lm: its
canonical (Hugging Face) config onto `TransformerConfig` fields, and its
tensors onto parameter labels. This module also holds what several families
share: option checks, the head layouts, and the tensor mapping of the
Llama-like decoders (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3).

Hugging Face stores projections as (out, in), and so does GGUF; penzai_lm
keeps that order (every projection's output axes first, its input axes
last), so loading copies no transposes and the CPU kernels read each
output's weights as one contiguous run (they decode faster than in the
input-major order). Named axes make the order invisible to everything else.
Head axes follow
`penzai_lm.model.TransformerConfig.head_axes`: query head h = group * per_group + q, as
in Hugging Face's ``repeat_kv``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from penzai_lm.model import RopeScaling
from penzai_lm.model import TransformerConfig

# One named array to bind: (data, axis names).
Tensor = tuple[np.ndarray, tuple[str, ...]]
# A checkpoint's tensors, by Hugging Face name.
Tensors = Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class FamilyAdapter:
  """How one checkpoint architecture maps onto a `TransformerLM`.

  Attributes:
    config_fields: ``(architecture, hf_config) -> dict`` of `TransformerConfig`
      keyword arguments: ``family``, every feature field (``norm_kind``,
      ``position_embedding``, ``mlp_kind``, the biases, ``qk_norm``,
      ``post_norms``, ``embedding_scale``, soft-caps) and the options that the
      generic sizes (`penzai_lm.loading.config_mapping`) do not cover.
      Options the model does not implement raise `unsupported`. ``hf_config``
      is normalized (`penzai_lm.checkpoints.normalize_config`).
    global_tensors: ``(config, tensors) -> {label: Tensor}`` for the
      parameters outside the blocks (embeddings, final norm, output head).
    layer_tensors: ``(config, tensors, layer) -> {label: Tensor}`` for one
      block; labels are relative to the block (``attention/query.weights``).

  When loading, ``tensors`` reads a tensor when it is looked up (look each
  up once): vectors come as float32, matrices in the parameter dtype
  (`penzai_lm.loading.parameters`). Arithmetic belongs on vectors (a norm
  offset); matrices are only rearranged (reshape, transpose, slice), so that
  a bfloat16 load equals casting the float32 one.
  """

  config_fields: Callable[[str, dict[str, Any]], dict[str, Any]]
  global_tensors: Callable[[TransformerConfig, Tensors], dict[str, Tensor]]
  layer_tensors: Callable[[TransformerConfig, Tensors, int], dict[str, Tensor]]


def unsupported(architecture: str, what: str) -> ValueError:
  """The error for a checkpoint option the model does not implement."""
  return ValueError(
      f"This {architecture} checkpoint uses {what}, which penzai_lm does not"
      " implement yet, so it cannot be loaded faithfully."
  )


def require_one_of(
    arch: str, c: dict[str, Any], key: str, allowed: tuple[str, ...]
) -> None:
  """Raises `unsupported` unless option ``key`` of ``c`` is in ``allowed``.

  An absent key counts as ``allowed[0]`` (the default).
  """
  value = c.get(key, allowed[0])
  if value not in allowed:
    raise unsupported(arch, f"{key}={value!r}")


def rope_scaling(arch: str, config: dict[str, Any]) -> RopeScaling | None:
  """The Llama 3 RoPE scaling of a config, or None; other kinds raise."""
  scaling = config.get("rope_scaling")
  if not scaling or scaling.get("rope_type", "default") == "default":
    return None
  if scaling.get("rope_type") != "llama3":
    raise unsupported(arch, f"RoPE scaling of type {scaling.get('rope_type')!r}")
  return RopeScaling(
      factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position_embeddings=int(
          scaling["original_max_position_embeddings"]
      ),
  )


def head_layout(
    config: TransformerConfig, for_queries: bool
) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """Names and sizes of the head axes of queries (or of keys and values)."""
  common, query_only = config.head_axes
  names = (*common, *(query_only if for_queries else {}))
  sizes = tuple({**common, **query_only}[n] for n in names)
  return names, sizes


def query_like(config, w, bias, for_queries) -> dict[str, Tensor]:
  """(heads*head_dim, in) -> (*head axes, projection, embedding)."""
  names, sizes = head_layout(config, for_queries)
  w = w.reshape(*sizes, config.head_dim, w.shape[-1])
  out = {"weights": (w, (*names, "projection", "embedding"))}
  if bias is not None:
    out["bias"] = (bias.reshape(*sizes, config.head_dim), (*names, "projection"))
  return out


def output_projection(config, w) -> Tensor:
  """(embedding, heads*head_dim) -> (embedding, *head axes, projection)."""
  names, sizes = head_layout(config, True)
  w = w.reshape(w.shape[0], *sizes, config.head_dim)
  return w, ("embedding", *names, "projection")


def llama_like_layer(
    config: TransformerConfig, t: Tensors, layer: int, norm_offset: float = 0.0
) -> dict[str, Tensor]:
  """Tensors of one ``model.layers.{layer}`` block of a Llama-like decoder.

  The layout follows the config's features: ``qkv_bias``,
  ``attention_output_bias``, ``mlp_bias``, ``qk_norm`` and ``post_norms``
  (with post norms, HF's ``post_attention_layernorm`` is the post-attention
  norm and ``pre_feedforward_layernorm`` the pre-MLP one; without, the
  former is the pre-MLP norm).

  Args:
    config: The model's configuration (RMSNorms and a gated MLP).
    t: The checkpoint's tensors.
    layer: Block index.
    norm_offset: Added to every RMSNorm scale (Gemma's norms compute
      ``x * (1 + w)``, penzai's ``x * w``).

  Returns:
    Tensors keyed by parameter label relative to the block.
  """
  if config.norm_kind != "rms" or config.mlp_kind != "gated":
    raise ValueError(
        "The Llama-like layout has RMSNorms and a gated MLP; this config has"
        f" norm_kind={config.norm_kind!r}, mlp_kind={config.mlp_kind!r}."
    )
  p = f"model.layers.{layer}."
  a, m = f"{p}self_attn.", f"{p}mlp."
  params = {}
  for name, hf, queries in (
      ("query", "q", True), ("key", "k", False), ("value", "v", False)
  ):
    bias = t[f"{a}{hf}_proj.bias"] if config.qkv_bias else None
    parts = query_like(config, t[f"{a}{hf}_proj.weight"], bias, queries)
    params[f"attention/{name}.weights"] = parts["weights"]
    if "bias" in parts:
      params[f"attention/{name}.bias"] = parts["bias"]
  params["attention/output.weights"] = output_projection(
      config, t[f"{a}o_proj.weight"]
  )
  if config.attention_output_bias:
    params["attention/output.bias"] = (t[f"{a}o_proj.bias"], ("embedding",))

  def norm(hf_name, axis="embedding"):
    return t[hf_name] + norm_offset, (axis,)

  # Our norm -> HF norm.
  norms = {"pre_attention_norm": f"{p}input_layernorm"}
  if config.post_norms:
    norms["post_attention_norm"] = f"{p}post_attention_layernorm"
    norms["pre_ffw_norm"] = f"{p}pre_feedforward_layernorm"
    norms["post_ffw_norm"] = f"{p}post_feedforward_layernorm"
  else:
    norms["pre_ffw_norm"] = f"{p}post_attention_layernorm"
  for mine, hf in norms.items():
    params[f"{mine}/scale.weights"] = norm(f"{hf}.weight")
  if config.qk_norm:
    for mine, hf in (("query_norm", "q_norm"), ("key_norm", "k_norm")):
      params[f"attention/{mine}/scale.weights"] = norm(
          f"{a}{hf}.weight", "projection"
      )
  for mine, hf, axes in (
      ("gating_linear", "gate_proj", ("neurons", "embedding")),
      ("value_linear", "up_proj", ("neurons", "embedding")),
      ("out_linear", "down_proj", ("embedding", "neurons")),
  ):
    params[f"mlp/{mine}.weights"] = (t[f"{m}{hf}.weight"], axes)
    if config.mlp_bias:
      params[f"mlp/{mine}.bias"] = (t[f"{m}{hf}.bias"], axes[:1])
  return params


def llama_like_globals(
    config: TransformerConfig, t: Tensors, norm_offset: float = 0.0
) -> dict[str, Tensor]:
  """Embeddings, final norm and (untied) output head of a Llama-like model."""
  params = {
      "embedder.embeddings": (
          t["model.embed_tokens.weight"], ("vocabulary", "embedding")
      ),
      "final_norm/scale.weights": (
          t["model.norm.weight"] + norm_offset, ("embedding",)
      ),
  }
  if not config.tie_embeddings:
    params["lm_head.weights"] = (
        t["lm_head.weight"], ("vocabulary", "embedding")
    )
  return params
