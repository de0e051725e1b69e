"""The canonical checkpoint containers shared by every reader.

`Checkpoint` holds every tensor in memory (what `read_checkpoint` returns);
`LazyCheckpoint` has been checked the same way but reads each tensor only
when asked (what `open_checkpoint` returns, and what `penzai_lm.load`
streams from). Both give the same values.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

CORRUPT_HINT = "the file is truncated or corrupt; re-download it"


class CheckpointError(ValueError):
  """A checkpoint file or directory cannot be read (corrupt, incomplete...).

  Every error the readers raise about a file's contents is one of these; the
  message says what is wrong, where (file, tensor or key) and how to fix it.
  """


class CheckpointFileNotFoundError(CheckpointError, FileNotFoundError):
  """A file the checkpoint needs is missing (config, weights, a shard).

  Both a :class:`CheckpointError` (so a ``ValueError``, like every reader
  error) and a ``FileNotFoundError`` (what callers caught before).
  """


@dataclasses.dataclass(kw_only=True)
class Checkpoint:
  """Weights and config of a causal LM in Hugging Face's canonical form.

  Attributes:
    architecture: HF model family: "llama", "mistral", "qwen2", "gemma3" or
      "gpt2".
    config: HF ``config.json`` keys for that family, complete with defaults
      (see :func:`penzai_lm.checkpoints.layout.normalize_config`).
    tensors: HF ``state_dict()`` names, shapes and value conventions, as numpy
      arrays of the requested dtype (float32 or ml_dtypes.bfloat16). Tied
      embeddings have no ``lm_head.weight``.
    source: The path the checkpoint was read from.
    gguf_reader: The open ``gguf.GGUFReader`` (GGUF sources only), so that the
      tokenizer can reuse it without re-opening the file.
  """

  architecture: str
  config: dict[str, Any]
  tensors: dict[str, np.ndarray] = dataclasses.field(repr=False)
  source: str
  gguf_reader: Any = dataclasses.field(default=None, repr=False)

  @property
  def num_parameters(self) -> int:
    return sum(int(t.size) for t in self.tensors.values())

  @property
  def dtype(self) -> np.dtype | None:
    dtypes = {np.dtype(t.dtype) for t in self.tensors.values()}
    return dtypes.pop() if len(dtypes) == 1 else None

  def __repr__(self) -> str:
    return (
        f"Checkpoint(architecture={self.architecture!r}, "
        f"source={self.source!r}, tensors={len(self.tensors)}, "
        f"parameters={self.num_parameters:,}, dtype={self.dtype})"
    )


@dataclasses.dataclass(kw_only=True)
class LazyCheckpoint:
  """A checked checkpoint whose tensors are read one at a time, on request.

  The readers' ``open_*`` functions check everything they can without
  reading tensor data, exactly as far as `read_checkpoint` does before it
  reads (headers against the files, config values, layer count, every
  tensor's shape); `read` then reads one tensor.

  Attributes:
    architecture, config, source, gguf_reader: As `Checkpoint`'s.
    shapes: HF ``state_dict`` name -> shape of every tensor that
      `Checkpoint.tensors` holds, in the same order.
    reader: ``(name, dtype) -> array``, the reader's own: a new array of
      one tensor (``dtype`` resolved by `read`).
  """

  architecture: str
  config: dict[str, Any]
  shapes: dict[str, tuple[int, ...]] = dataclasses.field(repr=False)
  source: str
  reader: Callable[[str, np.dtype], np.ndarray] = dataclasses.field(
      repr=False
  )
  gguf_reader: Any = dataclasses.field(default=None, repr=False)

  @property
  def num_parameters(self) -> int:
    return sum(math.prod(s) for s in self.shapes.values())

  def read(self, name: str, dtype=np.float32) -> np.ndarray:
    """Tensor ``name`` as a new array, checked for NaN/inf.

    Its values are those that ``read_checkpoint(source, dtype)`` holds:
    in bfloat16, the float32 values rounded to nearest even (a bfloat16
    file's tensors are returned as stored).

    Args:
      name: A key of `shapes`.
      dtype: float32 (default) or bfloat16.

    Raises:
      KeyError: an unknown name.
      CheckpointError: unreadable data or NaN/inf values (named by file and
        tensor).
    """
    if name not in self.shapes:
      raise KeyError(f"{self.source} has no tensor {name!r}")
    return self.reader(name, resolve_dtype(dtype))

  def materialize(self, dtype=np.float32) -> Checkpoint:
    """Every tensor read into a `Checkpoint`."""
    dtype = resolve_dtype(dtype)
    return Checkpoint(
        architecture=self.architecture,
        config=self.config,
        tensors={n: self.reader(n, dtype) for n in self.shapes},
        source=self.source,
        gguf_reader=self.gguf_reader,
    )

  def __repr__(self) -> str:
    return (
        f"LazyCheckpoint(architecture={self.architecture!r}, "
        f"source={self.source!r}, tensors={len(self.shapes)}, "
        f"parameters={self.num_parameters:,})"
    )


def resolve_dtype(dtype) -> np.dtype:
  """Accepts float32 / bfloat16 in any common spelling; returns a np.dtype."""
  if isinstance(dtype, str) and dtype.lower() in ("bf16", "bfloat16"):
    return np.dtype(ml_dtypes.bfloat16)
  if isinstance(dtype, str) and dtype.lower() in ("f32", "fp32", "float32"):
    return np.dtype(np.float32)
  try:
    d = np.dtype(dtype)
  except TypeError as e:
    raise ValueError(
        f"Unsupported dtype {dtype!r}; use float32 or bfloat16."
    ) from e
  if d == np.dtype(np.float32) or d == np.dtype(ml_dtypes.bfloat16):
    return d
  raise ValueError(f"Unsupported dtype {dtype!r}; use float32 or bfloat16.")


def to_dtype(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """Casts (round to nearest even for bf16) without copying if already right."""
  if array.dtype == dtype:
    return array
  return array.astype(dtype)


def check_path_exists(path: str | os.PathLike, what: str) -> Path:
  p = Path(path).expanduser()
  if not p.exists():
    raise CheckpointFileNotFoundError(f"{what} not found: {p}")
  return p
