"""Reads safetensors tensors one at a time, without torch or memory maps.

A tensor is located by its file, its name there, its (checked) header
entry and the file's data offset (`TensorLocation`), and read with
`tensor_io.read_at` into a 64-byte-aligned buffer of its stored dtype
(numpy cannot name bfloat16; ``ml_dtypes.bfloat16`` has the file's byte
layout). Conversion rules, the same as the eager readers always had:

* stored in the wanted dtype (bfloat16 -> bfloat16, float32 -> float32):
  the buffer read is the result, no other copy;
* otherwise float16 and float64 go through float32, then everything is cast
  to the wanted dtype (round to nearest even for bfloat16);
* the result is checked for NaN/inf, named by file and tensor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

import ml_dtypes
import numpy as np

from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.tensor_io import aligned_empty
from penzai_lm.checkpoints.tensor_io import read_at
from penzai_lm.checkpoints.validation import check_finite

SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}
_DIRECT = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


@dataclasses.dataclass(frozen=True)
class TensorLocation:
  """Where one tensor's data is.

  Attributes:
    file: The safetensors file.
    name: The tensor's name in that file.
    entry: Its checked header entry (``dtype``, ``shape``,
      ``data_offsets``).
    base: The file offset of the data section (8 + header length).
  """

  file: Path
  name: str
  entry: dict[str, Any]
  base: int

  @property
  def where(self) -> str:
    return f"{self.file}: tensor {self.name!r}"


def check_float_dtypes(locations: Iterable[TensorLocation]) -> None:
  """Raises unless every tensor is stored as F32, F16, BF16 or F64.

  Header-only, so it runs before any data is read.
  """
  for loc in locations:
    kind = loc.entry["dtype"]
    if kind not in SAFETENSORS_DTYPES:
      raise CheckpointError(
          f"{loc.file}: tensor {loc.name!r} has dtype {kind}; only"
          " floating-point (F32/F16/BF16/F64) weights are supported"
      )


def read_tensor(loc: TensorLocation, dtype: np.dtype) -> np.ndarray:
  """One tensor as a new aligned array of ``dtype`` (rules above).

  Raises:
    CheckpointError: an unreadable file or NaN/inf values.
  """
  stored = np.dtype(SAFETENSORS_DTYPES[loc.entry["dtype"]])
  out = aligned_empty(loc.entry["shape"], stored)
  start, _ = loc.entry["data_offsets"]
  try:
    with open(loc.file, "rb", buffering=0) as f:
      read_at(f, loc.base + start, out, loc.where)
  except OSError as e:
    raise CheckpointError(
        f"Cannot read safetensors file {loc.file}: {type(e).__name__}: {e};"
        f" {CORRUPT_HINT}"
    ) from e
  if stored != dtype:
    if stored not in _DIRECT:
      out = out.astype(np.float32)
    converted = aligned_empty(out.shape, dtype)
    np.copyto(converted, out, casting="unsafe")
    out = converted
  # Checked while the tensor is hot in cache: a NaN weight would otherwise
  # load silently and make every log-probability NaN.
  check_finite(out, loc.where)
  return out
