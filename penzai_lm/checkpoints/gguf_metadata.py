"""GGUF metadata -> a Hugging Face config dict.

Reads the ``general.*``, ``<arch>.*`` and ``tokenizer.ggml.*`` special-token
keys llama.cpp writes, and fills what the file does not carry with the
architecture's documented defaults (those of llama.cpp, which wrote the file,
and of transformers' own GGUF loader). What differs between architectures is
read from the spec's :class:`~penzai_lm.checkpoints.spec_types.GGUFSpec`.

Values are checked before they are trusted: numeric keys must hold numbers,
``block_count`` must not exceed the blocks the file has tensors for, and the
config as a whole must make sense (positive sizes, head counts that divide,
finite positive RoPE base, non-negative epsilon...); errors name the metadata
key (:mod:`~penzai_lm.checkpoints.validation`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.config_normalization import normalize_config
from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.spec_types import GGUFSpec
from penzai_lm.checkpoints.validation import METADATA_HINT
from penzai_lm.checkpoints.validation import check_config_values
from penzai_lm.checkpoints.validation import check_layer_count
from penzai_lm.checkpoints.validation import layer_indices

_MISSING = object()

# llama.cpp names block tensors blk.{index}.{kind}.{weight|bias}.
_BLOCK_PREFIX = "blk."


def _where(reader) -> str:
  return f"GGUF file {getattr(reader, 'path', '?')}"


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
          f"{_where(reader)} lacks required metadata key {key!r};"
          f" {METADATA_HINT}"
      )
    return default
  value = f.contents()
  if isinstance(value, np.generic):
    value = value.item()
  return value


def _number(reader, key: str, convert, default: Any = _MISSING) -> Any:
  """Metadata ``key`` converted by ``convert`` (int or float).

  Raises:
    CheckpointError: a required key is absent, or holds a string, list or
      bool, or a value ``convert`` rejects (e.g. int(nan)).
  """
  value = field(reader, key, default)
  if value is None or reader.fields.get(key) is None:
    return value  # absent: the default, unconverted (None stays None)
  try:
    if isinstance(value, (str, bytes, list, bool)):
      raise TypeError(type(value).__name__)
    return convert(value)
  except (TypeError, ValueError, OverflowError):
    raise CheckpointError(
        f"{_where(reader)}: metadata key {key!r} = {str(value)[:100]!r} is not"
        f" {'an integer' if convert is int else 'a number'}; {METADATA_HINT}"
    ) from None


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


def _rope_scaling_from_metadata(reader, prefix: str) -> dict[str, Any] | None:
  kind = field(reader, f"{prefix}rope.scaling.type", None)
  if kind in (None, "none"):
    return None
  factor = _number(reader, f"{prefix}rope.scaling.factor", float, None)
  if factor is None:
    return None
  if kind == "linear":
    return {"rope_type": "linear", "factor": factor}
  if kind == "yarn":
    out = {"rope_type": "yarn", "factor": factor}
    orig = _number(
        reader, f"{prefix}rope.scaling.original_context_length", int, None
    )
    if orig is not None:
      out["original_max_position_embeddings"] = orig
    return out
  raise CheckpointError(
      f"GGUF file uses RoPE scaling type {kind!r}, which is not supported"
      " (supported: none, linear, yarn)"
  )


def _head_geometry(reader, g: GGUFSpec) -> tuple[int, int, int | None]:
  """(num_attention_heads, num_key_value_heads, head_dim) from metadata.

  head_dim is None when the file does not give it and the spec has no
  default: normalization derives it as hidden_size // num_attention_heads,
  once the values are checked (the head count could be 0).
  """
  p = g.architecture + "."
  heads = field(reader, p + "attention.head_count")
  kv_heads = field(reader, p + "attention.head_count_kv", heads)
  if isinstance(heads, list) or isinstance(kv_heads, list):
    raise CheckpointError(
        f"{_where(reader)} has per-layer head counts, which are not supported"
    )
  heads = _number(reader, p + "attention.head_count", int)
  kv_heads = _number(reader, p + "attention.head_count_kv", int, heads)
  head_dim = None
  for key in g.head_dim_keys:
    head_dim = _number(reader, p + key, int, None)
    if head_dim is not None:
      break
  if head_dim is None:
    head_dim = g.default_head_dim
  return heads, kv_heads, head_dim


def _common_fields(
    reader, g: GGUFSpec, gguf_names: set[str], vocab: int
) -> dict[str, Any]:
  """Config fields every architecture's files spell the same way."""
  p = g.architecture + "."
  hidden = _number(reader, p + "embedding_length", int)
  heads, kv_heads, head_dim = _head_geometry(reader, g)
  raw: dict[str, Any] = {
      "vocab_size": vocab,
      "hidden_size": hidden,
      "intermediate_size": _number(reader, p + "feed_forward_length", int),
      "num_hidden_layers": _number(reader, p + "block_count", int),
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "rms_norm_eps": _number(
          reader, p + "attention.layer_norm_rms_epsilon", float, 1e-6
      ),
      "tie_word_embeddings": "output.weight" not in gguf_names,
  }
  ctx = _number(reader, p + "context_length", int, None)
  if ctx is not None:
    raw["max_position_embeddings"] = ctx
  for key, hf_key in (
      ("bos_token_id", "bos_token_id"),
      ("eos_token_id", "eos_token_id"),
      ("padding_token_id", "pad_token_id"),
  ):
    v = _number(reader, "tokenizer.ggml." + key, int, None)
    if v is not None:
      raw[hf_key] = v
  return raw


def _metadata_label(reader, g: GGUFSpec):
  """Config key -> the metadata key it was read from, for error messages."""
  p = g.architecture + "."
  keys = {
      "hidden_size": "embedding_length",
      "intermediate_size": "feed_forward_length",
      "num_hidden_layers": "block_count",
      "num_attention_heads": "attention.head_count",
      "num_key_value_heads": "attention.head_count_kv",
      "rms_norm_eps": "attention.layer_norm_rms_epsilon",
      "max_position_embeddings": "context_length",
      "rope_theta": "rope.freq_base",
      "rope_scaling.factor": "rope.scaling.factor",
      "rope_scaling.original_max_position_embeddings":
          "rope.scaling.original_context_length",
      **{m.config_key: m.key for m in g.optional_metadata},
  }
  present = [k for k in g.head_dim_keys if p + k in reader.fields]
  if present:
    keys["head_dim"] = present[0]

  def label(config_key: str) -> str:
    if config_key == "vocab_size":
      return "vocab_size (the rows of token_embd.weight)"
    if config_key in keys:
      return f"metadata key {p + keys[config_key]!r}"
    return f"derived config key {config_key!r}"

  return label


def _add_spec_fields(
    raw: dict[str, Any], reader, g: GGUFSpec, gguf_names: set[str]
) -> None:
  """Adds the fields the spec says how to find: fixed values, biases, ..."""
  raw.update(g.fixed_config)
  for key, tensor in g.bias_flags.items():
    raw[key] = tensor in gguf_names
  for m in g.optional_metadata:
    v = _number(reader, f"{g.architecture}.{m.key}", m.convert, None)
    if v is not None:
      raw[m.config_key] = v
  if g.query_scale is not None:
    if raw["num_hidden_layers"] in g.query_scale.hidden_per_head_layer_counts:
      hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
      raw["query_pre_attn_scalar"] = hidden // heads
    else:
      hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
      raw["query_pre_attn_scalar"] = raw["head_dim"] or hidden // heads


def config_from_gguf(
    reader, spec: ArchitectureSpec, gguf_names: set[str], vocab: int
) -> dict:
  """The normalized HF config of a GGUF file.

  Args:
    reader: The open ``gguf.GGUFReader``.
    spec: The file's architecture spec (with a ``gguf`` part).
    gguf_names: Names of the file's tensors (biases and tied embeddings are
      detected from them).
    vocab: Vocabulary size (rows of ``token_embd.weight``).

  Returns:
    The config, normalized by
    :func:`~penzai_lm.checkpoints.config_normalization.normalize_config`.
  """
  g = spec.gguf
  blocks_key = g.architecture + ".block_count"
  # Before anything is sized by it: the claimed block count against the
  # blocks the file has tensors for.
  check_layer_count(
      _number(reader, blocks_key, int),
      layer_indices(gguf_names, _BLOCK_PREFIX),
      where=_where(reader), key=blocks_key, prefix=_BLOCK_PREFIX,
      fix=METADATA_HINT,
  )
  raw = _common_fields(reader, g, gguf_names, vocab)
  theta = _number(reader, g.architecture + ".rope.freq_base", float, None)
  if theta is not None:
    raw["rope_theta"] = theta
  elif spec.rope is not None:
    raw["rope_theta"] = spec.rope.theta
  scaling = _rope_scaling_from_metadata(reader, g.architecture + ".")
  if scaling is not None:
    raw["rope_scaling"] = scaling
  label = _metadata_label(reader, g)
  # Checked twice: before the spec's fields are derived from the sizes (they
  # divide by the head count), and after, for the optional metadata.
  check_config_values(
      spec, raw, where=_where(reader), label=label, fix=METADATA_HINT
  )
  _add_spec_fields(raw, reader, g, gguf_names)
  check_config_values(
      spec, raw, where=_where(reader), label=label, fix=METADATA_HINT
  )
  return normalize_config(spec, raw, source=_where(reader))
