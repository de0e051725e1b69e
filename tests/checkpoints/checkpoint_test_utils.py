"""Helpers for the checkpoint tests: tiny GGUF writers, real-model paths."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as Q

# HF block tensor name -> GGUF block tensor name (llama.cpp's tensor naming).
LLAMA_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, block_map: dict[str, str]) -> str:
  if hf_name in TOP:
    return TOP[hf_name]
  assert hf_name.startswith("model.layers."), hf_name
  rest = hf_name[len("model.layers.") :]
  layer, rest = rest.split(".", 1)
  module, suffix = rest.rsplit(".", 1)
  return f"blk.{layer}.{block_map[module]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None):
  """Verbatim port of llama.cpp convert_hf_to_gguf.LlamaModel.permute."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (
      w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
      .swapaxes(1, 2)
      .reshape(w.shape)
  )


def quant_roundtrip(w: np.ndarray, qtype) -> np.ndarray:
  """What a tensor looks like after quantizing to qtype and dequantizing."""
  if qtype == Q.F32:
    return w.astype(np.float32)
  return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(
      w.shape
  )


def write_gguf(
    path,
    arch: str,
    hf_tensors: dict[str, np.ndarray],
    config: dict,
    qtype_for=lambda name, arr: Q.F32,
    *,
    extra_tensors: dict[str, np.ndarray] | None = None,
    extra_kv=None,
    skip_kv: tuple[str, ...] = (),
) -> Path:
  """Writes an HF-layout state dict as a llama.cpp-style GGUF file.

  llama: q/k rows permuted like llama.cpp's converter. gemma3: norms stored as
  1 + w. Tensor types come from ``qtype_for(hf_name, array)``.
  """
  w = gguf.GGUFWriter(str(path), arch)
  kv = {
      "block_count": lambda: w.add_block_count(config["num_hidden_layers"]),
      "context_length": lambda: w.add_context_length(
          config["max_position_embeddings"]
      ),
      "embedding_length": lambda: w.add_embedding_length(config["hidden_size"]),
      "feed_forward_length": lambda: w.add_feed_forward_length(
          config["intermediate_size"]
      ),
      "head_count": lambda: w.add_head_count(config["num_attention_heads"]),
      "head_count_kv": lambda: w.add_head_count_kv(
          config["num_key_value_heads"]
      ),
      "freq_base": lambda: w.add_rope_freq_base(config["rope_theta"]),
      "eps": lambda: w.add_layer_norm_rms_eps(config["rms_norm_eps"]),
      "bos": lambda: w.add_bos_token_id(config["bos_token_id"]),
      "eos": lambda: w.add_eos_token_id(config["eos_token_id"]),
      "vocab": lambda: w.add_vocab_size(config["vocab_size"]),
  }
  if arch == "llama":
    kv["rope_dim"] = lambda: w.add_rope_dimension_count(config["head_dim"])
  else:
    kv["key_length"] = lambda: w.add_key_length(config["head_dim"])
    kv["value_length"] = lambda: w.add_value_length(config["head_dim"])
    kv["sliding_window"] = lambda: w.add_sliding_window(config["sliding_window"])
  for k, fn in kv.items():
    if k not in skip_kv:
      fn()
  if extra_kv:
    extra_kv(w)

  block_map = LLAMA_BLOCK if arch == "llama" else GEMMA3_BLOCK
  nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
  for name, arr in hf_tensors.items():
    arr = np.asarray(arr, dtype=np.float32)
    if arch == "llama" and ".self_attn.q_proj." in name:
      arr = llama_cpp_permute(arr, nh, nh)
    elif arch == "llama" and ".self_attn.k_proj." in name:
      arr = llama_cpp_permute(arr, nh, nkv)
    elif arch == "gemma3" and name.endswith("norm.weight"):
      arr = arr + np.float32(1.0)
    qt = qtype_for(name, arr)
    data = gguf.quants.quantize(arr, qt)
    w.add_tensor(gguf_name(name, block_map), data, raw_dtype=qt)
  for name, arr in (extra_tensors or {}).items():
    w.add_tensor(name, np.asarray(arr, np.float32), raw_dtype=Q.F32)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return Path(path)


# ----------------------------------------------------------------------------
# Real models

REAL_FILE_NAMES = {
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
}


def real_model_path(name: str) -> Path:
  """Path of a real GGUF, via penzai_lm.fetch or $PENZAI_LM_GGUF_DIR; else skip."""
  reasons = []
  try:
    from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    reasons.append(f"penzai_lm.fetch unavailable ({e})")
  else:
    try:
      return Path(resolve_model_path(name))
    except Exception as e:  # pylint: disable=broad-except
      reasons.append(f"resolve_model_path({name!r}) failed: {e}")
  d = os.environ.get("PENZAI_LM_GGUF_DIR")
  if d:
    p = Path(d) / REAL_FILE_NAMES[name]
    if p.is_file():
      return p
    reasons.append(f"{p} does not exist")
  else:
    reasons.append("PENZAI_LM_GGUF_DIR not set")
  pytest.skip(f"real model {name!r} not available: " + "; ".join(reasons))
