"""Tensor files of the autoencoder formats: safetensors and ``.npz``.

Reading checks what penzai_lm's checkpoint readers check (a header that
matches the file, floating-point tensors only, no NaN or inf), with errors
naming the file and tensor. Every tensor is returned as float32 (bfloat16,
float16 and float64 convert exactly or round once); the caller casts to the
dtype it loads in. Writing produces standard safetensors files (torch's
``safetensors.torch.load_file`` reads them), bfloat16 included.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import struct
import tempfile
import zipfile

import ml_dtypes
import numpy as np

from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.file_checks import check_safetensors_header
from penzai_lm.checkpoints.json_files import parse_json
from penzai_lm.checkpoints.safetensors_io import TensorLocation
from penzai_lm.checkpoints.safetensors_io import check_float_dtypes
from penzai_lm.checkpoints.safetensors_io import read_tensor
from penzai_lm.checkpoints.validation import check_finite
from penzai_lm.sae.formats.errors import SAEFormatError

_CODES = {
    np.dtype(np.float64): "F64", np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
}


def safetensors_locations(path: Path) -> dict[str, TensorLocation]:
  """The checked header of a safetensors file: name -> location.

  Raises:
    SAEFormatError: a file too short for its header, a header that is not
      JSON or does not match the file (truncated data), non-float tensors.
  """
  try:
    size = path.stat().st_size
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise SAEFormatError(
            f"{path} is too short for a safetensors file ({size} bytes);"
            f" {CORRUPT_HINT}")
      (n,) = struct.unpack("<Q", head)
      if n > size - 8:
        raise SAEFormatError(
            f"{path}: the safetensors header claims {n} bytes but the file"
            f" has {size}; {CORRUPT_HINT}")
      header = parse_json(f.read(n), f"the safetensors header of {path}")
    entries = check_safetensors_header(str(path), header, 8 + n, size)
  except SAEFormatError:
    raise
  except CheckpointError as e:
    raise SAEFormatError(str(e)) from e
  locations = {name: TensorLocation(path, name, entry, 8 + n)
               for name, entry in entries.items()}
  try:
    check_float_dtypes(locations.values())
  except CheckpointError as e:
    raise SAEFormatError(str(e)) from e
  return locations


def read_safetensors(path: Path, names=None) -> dict[str, np.ndarray]:
  """Tensors of a safetensors file (all, or ``names`` that exist) as
  float32 arrays, checked (see the module docstring)."""
  locations = safetensors_locations(path)
  out = {}
  for name, loc in locations.items():
    if names is not None and name not in names:
      continue
    try:
      out[name] = read_tensor(loc, np.dtype(np.float32))
    except SAEFormatError:
      raise
    except CheckpointError as e:
      raise SAEFormatError(str(e)) from e
  return out


def read_npz(path: Path) -> dict[str, np.ndarray]:
  """Arrays of a numpy ``.npz`` file as float32, checked."""
  try:
    with np.load(path, allow_pickle=False) as data:
      raw = {key: data[key] for key in data.files}
  except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
    raise SAEFormatError(
        f"{path} is not a readable .npz file ({type(e).__name__}: {e});"
        f" {CORRUPT_HINT}") from e
  out = {}
  for key, value in raw.items():
    if value.dtype.kind != "f" and value.dtype != ml_dtypes.bfloat16:
      raise SAEFormatError(
          f"{path}: array {key!r} has dtype {value.dtype}; only floating-point"
          " weights are supported (the file is not an autoencoder's"
          " parameters).")
    value = np.asarray(value, np.float32)
    try:
      check_finite(value, f"{path}: array {key!r}")
    except CheckpointError as e:
      raise SAEFormatError(str(e)) from e
    out[key] = value
  return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
  """Writes ``tensors`` (float64/32/16 or bfloat16 arrays) to ``path``
  atomically (a temporary file renamed over it)."""
  header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
  arrays, offset = [], 0
  for name in sorted(tensors):
    array = np.ascontiguousarray(tensors[name])
    code = _CODES.get(array.dtype)
    if code is None:
      raise TypeError(f"tensor {name!r} has dtype {array.dtype}; only"
                      f" float64/32/16 and bfloat16 can be written.")
    header[name] = {"dtype": code, "shape": list(array.shape),
                    "data_offsets": [offset, offset + array.nbytes]}
    arrays.append(array)
    offset += array.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # Data starts 8-byte aligned.
  path = Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(struct.pack("<Q", len(blob)))
      f.write(blob)
      for array in arrays:
        f.write(array.tobytes())
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from others.
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise
