"""Tensor files of the autoencoder formats: safetensors and ``.npz``.

Reading checks what penzai_lm's checkpoint readers check (a header that
matches the file, floating-point tensors only, no NaN or inf), with errors
naming the file and tensor; only regular files are opened
(`penzai_lm.file_access`), each once. Every tensor is returned as float32 (bfloat16,
float16 and float64 convert exactly or round once); the caller casts to the
dtype it loads in. Writing produces standard safetensors files (torch's
``safetensors.torch.load_file`` reads them), bfloat16 included.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import struct
import zipfile

import ml_dtypes
import numpy as np

from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.file_checks import check_safetensors_header
from penzai_lm.checkpoints.json_files import parse_json
from penzai_lm.checkpoints.safetensors_io import SAFETENSORS_DTYPES
from penzai_lm.checkpoints.safetensors_io import TensorLocation
from penzai_lm.checkpoints.safetensors_io import check_float_dtypes
from penzai_lm.checkpoints.tensor_io import aligned_empty
from penzai_lm.checkpoints.tensor_io import read_at
from penzai_lm.checkpoints.validation import check_finite
from penzai_lm.file_access import open_regular
from penzai_lm.file_access import write_atomic
from penzai_lm.sae.formats.errors import SAEFormatError
from penzai_lm.sae.formats.npz_files import check_member

_CODES = {
    np.dtype(np.float64): "F64", np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
}


def _open(path: Path, what: str):
  """`open_regular`, with its refusal as an `SAEFormatError`."""
  try:
    return open_regular(path, what=what)
  except ValueError as e:
    raise SAEFormatError(str(e)) from e


def _locations(f, path: Path, size: int) -> dict[str, TensorLocation]:
  """The checked header read from the open file ``f`` of ``size`` bytes."""
  try:
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


def safetensors_locations(path: Path) -> dict[str, TensorLocation]:
  """The checked header of a safetensors file: name -> location.

  Raises:
    SAEFormatError: a file that is not a regular file (a FIFO, device...),
      too short for its header, a header that is not JSON or does not
      match the file (truncated data), non-float tensors.
  """
  with _open(path, "a safetensors file") as f:
    return _locations(f, path, os.fstat(f.fileno()).st_size)


def _read_tensor(f, loc: TensorLocation) -> np.ndarray:
  """One tensor of the open file ``f`` as float32, checked finite."""
  stored = np.dtype(SAFETENSORS_DTYPES[loc.entry["dtype"]])
  out = aligned_empty(loc.entry["shape"], stored)
  try:
    read_at(f, loc.base + loc.entry["data_offsets"][0], out, loc.where)
    if stored != np.float32:
      out = out.astype(np.float32)
    check_finite(out, loc.where)
  except SAEFormatError:
    raise
  except CheckpointError as e:
    raise SAEFormatError(str(e)) from e
  except OSError as e:
    raise SAEFormatError(f"Cannot read {loc.where}: {type(e).__name__}: {e};"
                         f" {CORRUPT_HINT}") from e
  return out


def read_safetensors(path: Path, names=None) -> dict[str, np.ndarray]:
  """Tensors of a safetensors file (all, or ``names`` that exist) as
  float32 arrays, checked (see the module docstring); the file is opened
  once (`penzai_lm.file_access.open_regular`)."""
  with _open(path, "a safetensors file") as f:
    locations = _locations(f, path, os.fstat(f.fileno()).st_size)
    return {name: _read_tensor(f, loc) for name, loc in locations.items()
            if names is None or name in names}


def read_npz(path: Path) -> dict[str, np.ndarray]:
  """Arrays of a numpy ``.npz`` file as float32, checked: each member's
  ``.npy`` header is checked against the member's declared size before its
  data is read (`npz_files.check_member`)."""
  with _open(path, "a .npz file") as f:
    try:
      with zipfile.ZipFile(f) as archive:
        raw = {}
        for info in archive.infolist():
          key = check_member(archive, info, path,
                             os.fstat(f.fileno()).st_size)
          with archive.open(info) as member:
            raw[key] = np.lib.format.read_array(member, allow_pickle=False)
    except SAEFormatError:
      raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError,
            NotImplementedError, RuntimeError) as e:
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
  atomically and never through a link
  (`penzai_lm.file_access.write_atomic`)."""
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
  write_atomic(Path(path), [struct.pack("<Q", len(blob)), blob,
                            *(a.reshape(-1).view(np.uint8) for a in arrays)])
