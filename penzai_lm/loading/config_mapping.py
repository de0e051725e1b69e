"""Maps a checkpoint's Hugging Face config to a `TransformerConfig`.

The sizes every architecture spells the same way (vocabulary, widths, layer
and head counts, special tokens) are read here; the family name, the feature
fields and the family's options come from its adapter
(`penzai_lm.loading.families`). Options the model does not implement (RoPE
scaling other than Llama 3's, bidirectional attention, ...) raise a
`CheckpointError` (a `ValueError`) that names the checkpoint's config file and
the option, rather than loading a model that computes something else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import jax.numpy as jnp

from penzai_lm.checkpoints import Checkpoint
from penzai_lm.checkpoints import CheckpointError
from penzai_lm.checkpoints import LazyCheckpoint
from penzai_lm.loading.families import ADAPTERS
from penzai_lm.loading.families import FamilyAdapter
from penzai_lm.loading.families import adapter_for
from penzai_lm.model import TransformerConfig


def _eos_ids(config: dict[str, Any]) -> tuple[int, ...]:
  eos = config.get("eos_token_id")
  if eos is None:
    return ()
  return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _size_fields(c: dict[str, Any]) -> dict[str, Any]:
  """Fields read the same way for every architecture (normalized configs)."""
  heads = c["num_attention_heads"]
  hidden = c["hidden_size"]
  return dict(
      vocab_size=c["vocab_size"],
      hidden_size=hidden,
      num_layers=c["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=c.get("num_key_value_heads") or heads,
      head_dim=c.get("head_dim") or hidden // heads,
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      max_position_embeddings=c["max_position_embeddings"],
      bos_token_id=c.get("bos_token_id"),
      eos_token_ids=_eos_ids(c),
      pad_token_id=c.get("pad_token_id"),
  )


def config_from_checkpoint(
    checkpoint: Checkpoint | LazyCheckpoint,
    *,
    dtype=jnp.float32,
    use_layer_stack: bool = True,
    adapters: Mapping[str, FamilyAdapter] = ADAPTERS,
) -> TransformerConfig:
  """The `TransformerConfig` of a checkpoint.

  Args:
    checkpoint: A checkpoint in canonical (Hugging Face) form, read or
      opened (only its architecture and config are used).
    dtype: Dtype of parameters and activations.
    use_layer_stack: Whether the model scans over a layer stack.
    adapters: Architecture name -> family adapter (default: the built-in
      ones).

  Returns:
    The configuration, with every feature field set by the family adapter.

  Raises:
    ValueError: for an architecture without an adapter.
    CheckpointError (a ValueError): an option the model does not implement,
      or a config value it cannot take; the message names the config file.
  """
  arch, c = checkpoint.architecture, checkpoint.config
  adapter = adapter_for(arch, adapters)
  try:
    fields = {**_size_fields(c), **adapter.config_fields(arch, c)}
    return TransformerConfig(
        parameter_dtype=dtype,
        activation_dtype=dtype,
        use_layer_stack=use_layer_stack,
        **fields,
    )
  except (ValueError, KeyError, TypeError) as e:
    # The readers check every value a model needs; what still fails here is
    # an option the model lacks (or a value it cannot take): say where.
    if isinstance(e, CheckpointError):
      raise
    if isinstance(e, KeyError):
      problem = f"lacks key {e.args[0] if e.args else e!r}"
    else:
      problem = str(e)
    raise CheckpointError(f"{_config_file(checkpoint)}: {problem}") from e


def _config_file(checkpoint: Checkpoint | LazyCheckpoint) -> str:
  """Where a checkpoint's config came from: a directory's config.json, or
  a GGUF file's metadata."""
  source = Path(checkpoint.source)
  if source.is_dir():
    return str(source / "config.json")
  if checkpoint.gguf_reader is not None or source.suffix == ".gguf":
    return f"the metadata of {source}"
  return f"the config of {checkpoint.source}"
