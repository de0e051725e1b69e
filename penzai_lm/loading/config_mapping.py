"""Maps a checkpoint's Hugging Face config to a `TransformerConfig`.

Options the model does not implement (attention soft-capping, output biases
on Llama, RoPE scaling other than Llama 3's, ...) raise a `ValueError` that
names the option, rather than loading a model that computes something else.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from penzai_lm.checkpoints import Checkpoint
from penzai_lm.model import RopeScaling
from penzai_lm.model import TransformerConfig


def _unsupported(architecture: str, what: str) -> ValueError:
  return ValueError(
      f"This {architecture} checkpoint uses {what}, which penzai_lm does not"
      " implement yet, so it cannot be loaded faithfully."
  )


def _require_one_of(
    arch: str, c: dict[str, Any], key: str, allowed: tuple[str, ...]
) -> None:
  """Raises `_unsupported` unless option ``key`` of ``c`` is in ``allowed``.

  An absent key counts as ``allowed[0]`` (the default).
  """
  value = c.get(key, allowed[0])
  if value not in allowed:
    raise _unsupported(arch, f"{key}={value!r}")


def _eos_ids(config: dict[str, Any]) -> tuple[int, ...]:
  eos = config.get("eos_token_id")
  if eos is None:
    return ()
  return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _rope_scaling(arch: str, config: dict[str, Any]) -> RopeScaling | None:
  scaling = config.get("rope_scaling")
  if not scaling or scaling.get("rope_type", "default") == "default":
    return None
  if scaling.get("rope_type") != "llama3":
    raise _unsupported(arch, f"RoPE scaling of type {scaling.get('rope_type')!r}")
  return RopeScaling(
      factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position_embeddings=int(
          scaling["original_max_position_embeddings"]
      ),
  )


def _llama_family(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  _require_one_of(arch, c, "hidden_act", ("silu",))
  if c.get("mlp_bias"):
    raise _unsupported(arch, "MLP biases (mlp_bias=True)")
  if arch == "llama" and c.get("attention_bias"):
    raise _unsupported(arch, "an output projection bias (attention_bias=True)")
  sliding_window = None
  if arch == "mistral":
    sliding_window = c.get("sliding_window")
  if arch == "qwen2" and c.get("use_sliding_window"):
    raise _unsupported(arch, "sliding-window layers (use_sliding_window=True)")
  return dict(
      family="llama",
      mlp_hidden_size=c["intermediate_size"],
      activation="silu",
      norm_eps=float(c["rms_norm_eps"]),
      rope_base=float(c["rope_theta"]),
      rope_scaling=_rope_scaling(arch, c),
      sliding_window=sliding_window,
      qkv_bias=arch == "qwen2",
  )


def _gemma3(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    if c.get(key) is not None:
      raise _unsupported(arch, f"{key}={c[key]}")
  if c.get("use_bidirectional_attention"):
    raise _unsupported(arch, "bidirectional attention")
  _require_one_of(
      arch, c, "hidden_activation", ("gelu_pytorch_tanh", "gelu_new")
  )
  kinds = {"sliding_attention": "local", "full_attention": "global"}
  return dict(
      family="gemma3",
      mlp_hidden_size=c["intermediate_size"],
      activation="gelu_tanh",
      norm_eps=float(c["rms_norm_eps"]),
      rope_base=float(c["rope_theta"]),
      rope_scaling=_rope_scaling(arch, c),
      local_rope_base=float(c["rope_local_base_freq"]),
      sliding_window=c["sliding_window"],
      layer_types=tuple(kinds[t] for t in c["layer_types"]),
      query_pre_attn_scalar=float(c["query_pre_attn_scalar"]),
  )


def _gpt2(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  _require_one_of(
      arch, c, "activation_function", ("gelu_new", "gelu_pytorch_tanh")
  )
  if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn"):
    raise _unsupported(arch, "layer-index attention scaling")
  hidden = c["n_embd"]
  return dict(
      family="gpt2",
      mlp_hidden_size=c.get("n_inner") or 4 * hidden,
      activation="gelu_tanh",
      norm_eps=float(c["layer_norm_epsilon"]),
  )


_FAMILY_FIELDS = {
    "llama": _llama_family, "mistral": _llama_family, "qwen2": _llama_family,
    "gemma3": _gemma3, "gpt2": _gpt2,
}


def config_from_checkpoint(
    checkpoint: Checkpoint, *, dtype=jnp.float32, use_layer_stack: bool = True
) -> TransformerConfig:
  """The `TransformerConfig` of a checkpoint.

  Args:
    checkpoint: A checkpoint in canonical (Hugging Face) form.
    dtype: Dtype of parameters and activations.
    use_layer_stack: Whether the model scans over a layer stack.

  Returns:
    The configuration.
  """
  arch, c = checkpoint.architecture, checkpoint.config
  if arch not in _FAMILY_FIELDS:
    raise ValueError(
        f"Unsupported architecture {arch!r}; supported:"
        f" {sorted(_FAMILY_FIELDS)}."
    )
  fields = _FAMILY_FIELDS[arch](arch, c)
  heads = c["num_attention_heads"]
  hidden = c["hidden_size"]
  return TransformerConfig(
      vocab_size=c["vocab_size"],
      hidden_size=hidden,
      num_layers=c["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=c.get("num_key_value_heads") or heads,
      head_dim=c.get("head_dim") or hidden // heads,
      tie_embeddings=bool(c.get("tie_word_embeddings", arch == "gpt2")),
      max_position_embeddings=c["max_position_embeddings"],
      parameter_dtype=dtype,
      activation_dtype=dtype,
      use_layer_stack=use_layer_stack,
      bos_token_id=c.get("bos_token_id"),
      eos_token_ids=_eos_ids(c),
      pad_token_id=c.get("pad_token_id"),
      **fields,
  )
