"""Reads llama.cpp GGUF files into the canonical (Hugging Face) form.

Supported GGUF architectures: those of the specs with a ``gguf`` part
(:mod:`penzai_lm.checkpoints.specs`): ``llama`` (HF ``LlamaForCausalLM``, and
Mistral, which llama.cpp writes as ``llama``), ``qwen2``, ``qwen3``, ``phi3``
(fused ``attn_qkv`` / ``ffn_up`` kept as HF's ``qkv_proj`` / ``gate_up_proj``),
``gemma2`` and ``gemma3``. Tensors are dequantized once with
``gguf.quants.dequantize`` (any type gguf-py knows: F32/F16/BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, K-quants, ...), one tensor and a chunk of rows at a time
(`open_gguf` checks the file and reads tensors on request; `read_gguf` reads
them all), and converted to HF conventions:

* GGUF lists shapes as ``[in, out]``; the numpy arrays are ``(out, in)``, which
  is already HF's ``nn.Linear`` layout.
* llama.cpp permutes the rows of llama q/k projections (and biases) for its
  interleaved-pair RoPE; they are un-permuted here to HF's rotate-half layout
  (only llama: the other architectures are written unpermuted).
* gemma2 and gemma3 files store RMSNorm weights as ``1 + w``; HF's Gemma
  RMSNorms store ``w`` (and compute ``x * (1 + w)``), so 1 is subtracted (in
  float32).
* A missing ``output.weight`` means tied embeddings: no ``lm_head.weight`` and
  ``tie_word_embeddings=True``.

Config fields the file does not carry are filled with the architecture's
documented defaults (those of llama.cpp, which wrote the file, and of
transformers' own GGUF loader).

This module is the entry point; the work is split by concern into
:mod:`~penzai_lm.checkpoints.gguf_file` (opening and checking the file),
:mod:`~penzai_lm.checkpoints.gguf_metadata` (metadata -> config) and
:mod:`~penzai_lm.checkpoints.gguf_tensors` (tensor names and values), whose
public names are re-exported here.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from penzai_lm.checkpoints import layout
from penzai_lm.checkpoints.architectures import spec_for
from penzai_lm.checkpoints.architectures import unsupported_architecture_message
from penzai_lm.checkpoints.checkpoint import Checkpoint
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.checkpoint import LazyCheckpoint
from penzai_lm.checkpoints.checkpoint import check_path_exists
from penzai_lm.checkpoints.checkpoint import resolve_dtype
from penzai_lm.checkpoints.config_normalization import normalize_config
from penzai_lm.checkpoints.gguf_file import GGUF_MAGIC
from penzai_lm.checkpoints.gguf_file import open_checked
from penzai_lm.checkpoints.gguf_file import open_gguf_reader
from penzai_lm.checkpoints.gguf_metadata import config_from_gguf
from penzai_lm.checkpoints.gguf_metadata import llama3_rope_scaling
from penzai_lm.checkpoints.gguf_metadata import read_gguf_architecture
from penzai_lm.checkpoints.gguf_tensors import BlockDecoder
from penzai_lm.checkpoints.gguf_tensors import dequantize
from penzai_lm.checkpoints.gguf_tensors import hf_conventions
from penzai_lm.checkpoints.gguf_tensors import hf_tensor_name
from penzai_lm.checkpoints.gguf_tensors import permute_rows
from penzai_lm.checkpoints.gguf_tensors import read_gguf_tensor
from penzai_lm.checkpoints.gguf_tensors import unpermute_rows
from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.specs import GEMMA3_ROPE_LOCAL_BASE_FREQ
from penzai_lm.checkpoints.specs import GEMMA3_SLIDING_WINDOW_PATTERN
from penzai_lm.checkpoints.specs import SPECS


def _gguf_table(
    specs: Sequence[ArchitectureSpec],
) -> dict[str, ArchitectureSpec]:
  """GGUF ``general.architecture`` -> spec, for the specs that read GGUF."""
  return {s.gguf.architecture: s for s in specs if s.gguf is not None}


SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(_gguf_table(SPECS))


def _open_supported(path: Path, specs: Sequence[ArchitectureSpec]):
  """Opens a GGUF file of a supported architecture; (reader, spec)."""
  if path.is_dir():
    raise CheckpointError(
        f"{path} is a directory, not a GGUF file (use read_hf_dir for Hugging"
        " Face model directories)"
    )
  reader = open_checked(path)
  arch = read_gguf_architecture(reader)
  table = _gguf_table(specs)
  if arch not in table:
    raise CheckpointError(
        unsupported_architecture_message(
            f"{arch!r} in GGUF file {path}",
            "GGUF architectures " + ", ".join(table),
        )
    )
  return reader, table[arch]


def _hf_names(
    spec: ArchitectureSpec, by_name: dict[str, Any], path: Path
) -> tuple[dict[str, str], dict[str, Any]]:
  """GGUF name -> HF name of each tensor, and the tensors HF has no name for.

  The second mapping holds tensors that are not weights but are understood
  (``GGUFSpec.extra_tensors``, e.g. llama's ``rope_freqs.weight``); any other
  unmapped tensor is an error.
  """
  extra_gguf = {}
  unknown = []
  hf_names = {}
  for name in by_name:
    if name in spec.gguf.refused_tensors:
      raise CheckpointError(
          f"GGUF file {path} ({spec.gguf.architecture}) has tensor {name!r}:"
          f" it encodes {spec.gguf.refused_tensors[name]}"
      )
    if name in spec.gguf.extra_tensors:
      extra_gguf[name] = by_name[name]
      continue
    hf = hf_tensor_name(spec, name)
    if hf is None:
      unknown.append(name)
    else:
      hf_names[name] = hf
  if unknown:
    raise CheckpointError(
        f"GGUF file {path} ({spec.gguf.architecture}) has tensors with no"
        " Hugging Face"
        f" counterpart: {', '.join(sorted(unknown))}"
    )
  return hf_names, extra_gguf


def _with_rope_freqs(
    spec: ArchitectureSpec, config: dict, rope_freqs, path: Path
) -> dict:
  """``config`` with the Llama 3 RoPE scaling encoded in ``rope_freqs``."""
  scaling = llama3_rope_scaling(
      dequantize(rope_freqs, path),
      config["rope_theta"],
      config["head_dim"],
  )
  raw = dict(config)
  raw.pop("rope_parameters", None)
  raw["rope_scaling"] = scaling
  return normalize_config(spec, raw, source=f"GGUF file {path}")


def _read_tensor(
    path: Path, spec: ArchitectureSpec, config: dict, tensors: dict,
    decode_blocks: BlockDecoder | None, name: str, dtype: np.dtype,
) -> np.ndarray:
  """HF tensor ``name``; ``tensors`` maps HF names to (GGUF name, tensor)."""
  gname, t = tensors[name]
  unpermute, offset = hf_conventions(
      spec, gname, name, config["num_attention_heads"],
      config["num_key_value_heads"],
  )
  return read_gguf_tensor(
      path, t, dtype, unpermute_heads=unpermute, norm_offset=offset,
      decode_blocks=decode_blocks,
  )


def open_gguf(
    path: str | os.PathLike,
    *,
    specs: Sequence[ArchitectureSpec] = SPECS,
    decode_blocks: BlockDecoder | None = None,
) -> LazyCheckpoint:
  """Checks a GGUF model file; reads no tensor data but ``rope_freqs``.

  The file's layout, metadata, config and tensor shapes are checked as
  `read_gguf` checks them; `LazyCheckpoint.read` then dequantizes one
  tensor at a time.

  Args:
    path: Path to a ``.gguf`` file of an architecture of ``specs``.
    specs: The architectures to recognize (default: the built-in ones).
    decode_blocks: A faster decoder of some block types (`BlockDecoder`:
      the same values as gguf-py's), used by `LazyCheckpoint.read`.

  Returns:
    The checkpoint, with ``gguf_reader`` set to the open reader.

  Raises:
    As `read_gguf`, except for the errors about tensor data.
  """
  # Fail with ImportError up front if gguf-py is missing, rather than as a
  # "corrupt file" error from inside the reader.
  import gguf  # pylint: disable=g-import-not-at-top,unused-import  # noqa: F401

  path = check_path_exists(path, "GGUF file")
  reader, spec = _open_supported(path, specs)
  by_name = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in by_name:
    raise CheckpointError(f"GGUF file {path} has no token_embd.weight tensor")
  vocab = int(by_name["token_embd.weight"].shape[-1])
  config = config_from_gguf(reader, spec, set(by_name), vocab)
  hf_names, extra_gguf = _hf_names(spec, by_name, path)
  if "rope_freqs.weight" in extra_gguf:
    config = _with_rope_freqs(
        spec, config, extra_gguf["rope_freqs.weight"], path
    )

  # Config against the tensors' shapes before the (slow, memory-hungry)
  # dequantization of any tensor.
  shapes = {
      hf: tuple(int(d) for d in reversed(by_name[g].shape.tolist()))
      for g, hf in hf_names.items()
  }
  layout.validate_shapes(spec, config, shapes, str(path))
  tensors = {hf: (g, by_name[g]) for g, hf in hf_names.items()}
  return LazyCheckpoint(
      architecture=spec.name,
      config=config,
      shapes=shapes,
      source=str(path),
      reader=functools.partial(_read_tensor, path, spec, config, tensors,
                               decode_blocks),
      gguf_reader=reader,
  )


def read_gguf(
    path: str | os.PathLike,
    dtype=np.float32,
    *,
    specs: Sequence[ArchitectureSpec] = SPECS,
) -> Checkpoint:
  """Reads a GGUF model file into a canonical :class:`Checkpoint`.

  Args:
    path: Path to a ``.gguf`` file of a supported architecture (those of
      ``specs``).
    dtype: float32 (default) or bfloat16 (``ml_dtypes.bfloat16``, or the
      strings "bfloat16"/"bf16").
    specs: The architectures to recognize (default: the built-in ones).

  Returns:
    The checkpoint, with ``gguf_reader`` set to the open reader.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    CheckpointError (a ValueError): not a GGUF file, truncated or corrupt file
      (tensors misaligned, overlapping or past its end), unsupported
      architecture, nonsensical metadata (named by key), a block count or
      sizes that disagree with the tensors, NaN/inf weights (named by
      tensor).
  """
  dtype = resolve_dtype(dtype)
  lazy = open_gguf(path, specs=specs)
  ckpt = lazy.materialize(dtype)
  layout.validate(ckpt, spec_for(lazy.architecture, specs))
  return ckpt


__all__ = [
    "GEMMA3_ROPE_LOCAL_BASE_FREQ",
    "GEMMA3_SLIDING_WINDOW_PATTERN",
    "GGUF_MAGIC",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "hf_tensor_name",
    "open_gguf",
    "open_gguf_reader",
    "permute_rows",
    "read_gguf",
    "read_gguf_architecture",
    "unpermute_rows",
]
