"""Checkpoint readers: GGUF files and Hugging Face directories -> one form.

Every reader returns a :class:`Checkpoint` in Hugging Face's canonical form:
tensor names, shapes and value conventions exactly as the matching transformers
model's ``state_dict()`` (numpy float32 or bfloat16), plus a complete
``config.json``-like dict.

>>> ckpt = read_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")
>>> ckpt.architecture, ckpt.config["num_hidden_layers"]
('llama', 30)

`open_checkpoint` checks the same file the same way but reads no tensor data:
its :class:`LazyCheckpoint` reads one tensor at a time (what
``penzai_lm.load`` streams from, to keep host memory at the size of the
weights).

The supported architectures are declared once, as
:class:`ArchitectureSpec` s in :mod:`penzai_lm.checkpoints.specs`
(:data:`SPECS`); the readers interpret them. Every reader also takes a
``specs`` sequence, to read an architecture declared elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from penzai_lm.checkpoints.checkpoint import Checkpoint
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.checkpoint import CheckpointFileNotFoundError
from penzai_lm.checkpoints.checkpoint import LazyCheckpoint
from penzai_lm.checkpoints.gguf_reader import SUPPORTED_GGUF_ARCHITECTURES
from penzai_lm.checkpoints.gguf_reader import open_gguf
from penzai_lm.checkpoints.gguf_reader import read_gguf
from penzai_lm.checkpoints.gguf_tensors import BlockDecoder
from penzai_lm.checkpoints.hf_reader import SUPPORTED_HF_CLASSES
from penzai_lm.checkpoints.hf_reader import open_hf_dir
from penzai_lm.checkpoints.hf_reader import read_hf_dir
from penzai_lm.checkpoints.layout import ARCHITECTURE_CLASSES
from penzai_lm.checkpoints.layout import GUARANTEED_CONFIG_KEYS
from penzai_lm.checkpoints.layout import SUPPORTED_ARCHITECTURES
from penzai_lm.checkpoints.layout import expected_tensor_shapes
from penzai_lm.checkpoints.layout import normalize_config
from penzai_lm.checkpoints.layout import validate
from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.specs import SPECS
from penzai_lm.model_paths import refuse_special


def read_checkpoint(
    path: str | os.PathLike,
    dtype=np.float32,
    *,
    specs: Sequence[ArchitectureSpec] = SPECS,
) -> Checkpoint:
  """Reads a GGUF file or a Hugging Face model directory, whichever it is.

  Args:
    path: A ``.gguf`` file or a Hugging Face model directory.
    dtype: float32 (default) or bfloat16.
    specs: The architectures to recognize (default: the built-in ones).
  """
  p = Path(path).expanduser()
  refuse_special(p)  # A FIFO would block the first read forever.
  if p.is_dir():
    return read_hf_dir(p, dtype=dtype, specs=specs)
  return read_gguf(p, dtype=dtype, specs=specs)


def open_checkpoint(
    path: str | os.PathLike,
    *,
    specs: Sequence[ArchitectureSpec] = SPECS,
    decode_blocks: BlockDecoder | None = None,
) -> LazyCheckpoint:
  """Checks a GGUF file or a Hugging Face directory; reads no tensor data.

  Every check `read_checkpoint` makes before reading tensor data runs here
  (and raises the same errors); ``.read(name, dtype)`` of the result then
  reads one tensor, with the values `read_checkpoint` would give it.

  Args:
    path: A ``.gguf`` file or a Hugging Face model directory.
    specs: The architectures to recognize (default: the built-in ones).
    decode_blocks: For GGUF files, a faster decoder of some quantized block
      types (`BlockDecoder`: the same values as gguf-py's).
  """
  p = Path(path).expanduser()
  refuse_special(p)  # A FIFO would block the first read forever.
  if p.is_dir():
    return open_hf_dir(p, specs=specs)
  return open_gguf(p, specs=specs, decode_blocks=decode_blocks)


__all__ = [
    "ARCHITECTURE_CLASSES",
    "ArchitectureSpec",
    "BlockDecoder",
    "Checkpoint",
    "CheckpointError",
    "CheckpointFileNotFoundError",
    "GUARANTEED_CONFIG_KEYS",
    "LazyCheckpoint",
    "SPECS",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "SUPPORTED_HF_CLASSES",
    "expected_tensor_shapes",
    "normalize_config",
    "open_checkpoint",
    "open_gguf",
    "open_hf_dir",
    "read_checkpoint",
    "read_gguf",
    "read_hf_dir",
    "validate",
]
