"""GGUF metadata -> a Hugging Face config dict.

Reads the ``general.*``, ``<arch>.*`` and ``tokenizer.ggml.*`` special-token
keys llama.cpp writes, and fills what the file does not carry with the
architecture's documented defaults (those of llama.cpp, which wrote the file,
and of transformers' own GGUF loader).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.config_normalization import normalize_config

# Gemma 3 facts not stored in its GGUF files (llama.cpp hard-codes them too).
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer (5, 11, 17, ...) is global

_MISSING = object()


def field(reader, key: str, default: Any = _MISSING) -> Any:
  """The value of metadata ``key`` as a Python scalar, str or list.

  Args:
    reader: An open ``gguf.GGUFReader``.
    key: The metadata key.
    default: Returned when the key is absent; without it the key is required.

  Raises:
    CheckpointError: a required key is absent.
  """
  f = reader.fields.get(key)
  if f is None:
    if default is _MISSING:
      raise CheckpointError(
          f"GGUF file {getattr(reader, 'path', '?')} lacks required metadata"
          f" key {key!r}"
      )
    return default
  value = f.contents()
  if isinstance(value, np.generic):
    value = value.item()
  return value


def read_gguf_architecture(reader) -> str:
  """The file's ``general.architecture``; CheckpointError if absent."""
  arch = field(reader, "general.architecture", None)
  if arch is None:
    raise CheckpointError(
        "GGUF file has no general.architecture key; " + CORRUPT_HINT
    )
  return str(arch)


def llama3_rope_scaling(
    factors: np.ndarray, theta: float, head_dim: int
) -> dict[str, Any]:
  """Recovers HF ``rope_scaling`` (rope_type llama3) from ``rope_freqs``.

  llama.cpp stores Llama 3.1+'s frequency correction as a tensor of per-pair
  factors computed from (factor, low_freq_factor, high_freq_factor,
  original_max_position_embeddings); the parameters are recovered by matching
  against the usual values.
  """
  factors = np.asarray(factors, dtype=np.float64).reshape(-1)
  factor = float(factors.max())
  freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))

  def compute(low, high, old):
    low_wl, high_wl = old / low, old / high
    out = []
    for f in freqs:
      wl = 2 * math.pi / f
      if wl < high_wl:
        out.append(1.0)
      elif wl > low_wl:
        out.append(factor)
      else:
        smooth = (old / wl - low) / (high - low)
        out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out)

  for old in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
    for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
      if len(factors) == len(freqs) and np.allclose(
          compute(low, high, old), factors, rtol=1e-4, atol=1e-5
      ):
        return {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": old,
        }
  raise CheckpointError(
      "GGUF llama file has a rope_freqs tensor whose values do not match Llama"
      " 3 style RoPE scaling; this frequency scaling is not supported"
  )


def _rope_scaling_from_metadata(reader, arch: str) -> dict[str, Any] | None:
  kind = field(reader, f"{arch}.rope.scaling.type", None)
  if kind in (None, "none"):
    return None
  factor = field(reader, f"{arch}.rope.scaling.factor", None)
  if factor is None:
    return None
  factor = float(factor)
  if kind == "linear":
    return {"rope_type": "linear", "factor": factor}
  if kind == "yarn":
    out = {"rope_type": "yarn", "factor": factor}
    orig = field(reader, f"{arch}.rope.scaling.original_context_length", None)
    if orig is not None:
      out["original_max_position_embeddings"] = int(orig)
    return out
  raise CheckpointError(
      f"GGUF file uses RoPE scaling type {kind!r}, which is not supported"
      " (supported: none, linear, yarn)"
  )


def _head_geometry(reader, arch: str, hidden: int) -> tuple[int, int, int]:
  """(num_attention_heads, num_key_value_heads, head_dim) from metadata."""
  p = arch + "."
  heads = field(reader, p + "attention.head_count")
  kv_heads = field(reader, p + "attention.head_count_kv", heads)
  if isinstance(heads, list) or isinstance(kv_heads, list):
    raise CheckpointError(
        "GGUF file has per-layer head counts, which are not supported"
    )
  heads, kv_heads = int(heads), int(kv_heads)
  head_dim = field(reader, p + "attention.key_length", None)
  if head_dim is None and arch == "llama":
    head_dim = field(reader, p + "rope.dimension_count", None)
  if head_dim is None:
    head_dim = hidden // heads if arch == "llama" else 256
  return heads, kv_heads, int(head_dim)


def _common_fields(
    reader, arch: str, gguf_names: set[str], vocab: int
) -> dict[str, Any]:
  """Config fields llama and gemma3 files spell the same way."""
  p = arch + "."
  hidden = int(field(reader, p + "embedding_length"))
  heads, kv_heads, head_dim = _head_geometry(reader, arch, hidden)
  raw: dict[str, Any] = {
      "vocab_size": vocab,
      "hidden_size": hidden,
      "intermediate_size": int(field(reader, p + "feed_forward_length")),
      "num_hidden_layers": int(field(reader, p + "block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "rms_norm_eps": float(
          field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)
      ),
      "tie_word_embeddings": "output.weight" not in gguf_names,
  }
  ctx = field(reader, p + "context_length", None)
  if ctx is not None:
    raw["max_position_embeddings"] = int(ctx)
  for key, hf_key in (
      ("bos_token_id", "bos_token_id"),
      ("eos_token_id", "eos_token_id"),
      ("padding_token_id", "pad_token_id"),
  ):
    v = field(reader, "tokenizer.ggml." + key, None)
    if v is not None:
      raw[hf_key] = int(v)
  return raw


def _add_gemma3_fields(
    raw: dict[str, Any], reader, theta, scaling, gguf_names: set[str]
) -> None:
  """Adds gemma3's RoPE, sliding-window, scaling and soft-capping fields."""
  p = "gemma3."
  layers = raw["num_hidden_layers"]
  raw["rope_theta"] = float(theta) if theta is not None else 1_000_000.0
  raw["rope_local_base_freq"] = GEMMA3_ROPE_LOCAL_BASE_FREQ
  if scaling is not None:
    raw["rope_scaling"] = scaling
  raw["sliding_window_pattern"] = GEMMA3_SLIDING_WINDOW_PATTERN
  window = field(reader, p + "attention.sliding_window", None)
  if window is not None:
    raw["sliding_window"] = int(window)
  # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers), which uses
  # 1/sqrt(hidden_size / num_heads). For every other size this equals
  # transformers' default of 256.
  if layers == 62:
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    raw["query_pre_attn_scalar"] = hidden // heads
  else:
    raw["query_pre_attn_scalar"] = raw["head_dim"]
  raw["attention_bias"] = "blk.0.attn_q.bias" in gguf_names
  raw["hidden_activation"] = "gelu_pytorch_tanh"
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    v = field(reader, p + key, None)
    if v is not None:
      raw[key] = float(v)


def config_from_gguf(reader, arch: str, gguf_names: set[str], vocab: int) -> dict:
  """The normalized HF config of a llama or gemma3 GGUF file.

  Args:
    reader: The open ``gguf.GGUFReader``.
    arch: "llama" or "gemma3".
    gguf_names: Names of the file's tensors (biases and tied embeddings are
      detected from them).
    vocab: Vocabulary size (rows of ``token_embd.weight``).

  Returns:
    The config, normalized by
    :func:`~penzai_lm.checkpoints.config_normalization.normalize_config`.
  """
  raw = _common_fields(reader, arch, gguf_names, vocab)
  theta = field(reader, arch + ".rope.freq_base", None)
  scaling = _rope_scaling_from_metadata(reader, arch)
  if arch == "llama":
    raw["rope_theta"] = float(theta) if theta is not None else 10000.0
    raw["hidden_act"] = "silu"
    raw["attention_bias"] = "blk.0.attn_q.bias" in gguf_names
    raw["mlp_bias"] = "blk.0.ffn_gate.bias" in gguf_names
    if scaling is not None:
      raw["rope_scaling"] = scaling
  else:  # gemma3
    _add_gemma3_fields(raw, reader, theta, scaling, gguf_names)
  return normalize_config(arch, raw)
