"""Reads the tokenizer metadata of a GGUF file, without its tensors.

`gguf.GGUFReader` parses every field and tensor of a file up front, which
takes seconds for a 262k-token vocabulary. The tokenizer needs a handful of
keys, so for a path this module walks the key/value section of the file
directly and decodes only the arrays it is asked for. An already-open
`gguf.GGUFReader` (the model loader passes one) is read through its fields.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection
from typing import Any

import numpy as np

__all__ = ["read_tokenizer_metadata", "gguf_file_path"]

# GGUF value type ids -> struct format of the fixed-size scalar types.
_SCALAR = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
    7: "?", 10: "<u8", 11: "<i8", 12: "<f8",
}
_STRING, _ARRAY = 8, 9

# Keys read as full values; string arrays are decoded only when requested.
_WANTED_PREFIXES = ("tokenizer.", "general.architecture")


def _read_string(buf: memoryview, pos: int) -> tuple[str, int]:
  (length,) = struct.unpack_from("<Q", buf, pos)
  pos += 8
  return bytes(buf[pos : pos + length]).decode("utf-8", "replace"), pos + length


def _read_value(
    buf: memoryview, pos: int, vtype: int, decode_strings: bool
) -> tuple[Any, int]:
  if vtype in _SCALAR:
    (value,) = struct.unpack_from(_SCALAR[vtype], buf, pos)
    return value, pos + struct.calcsize(_SCALAR[vtype])
  if vtype == _STRING:
    return _read_string(buf, pos)
  if vtype != _ARRAY:
    raise ValueError(f"GGUF metadata has a value of unknown type {vtype}.")
  etype, count = struct.unpack_from("<IQ", buf, pos)
  pos += 12
  if etype in _NUMPY:
    arr = np.frombuffer(buf, dtype=_NUMPY[etype], count=count, offset=pos)
    return arr.copy(), pos + arr.nbytes
  if etype != _STRING:
    raise ValueError(f"GGUF metadata has an array of element type {etype}.")
  values = [] if decode_strings else None
  unpack = struct.Struct("<Q").unpack_from
  for _ in range(count):
    (length,) = unpack(buf, pos)
    pos += 8
    if values is not None:
      values.append(bytes(buf[pos : pos + length]).decode("utf-8", "replace"))
    pos += length
  return (values if values is not None else count), pos


def _from_path(path: str, string_arrays: Collection[str]) -> dict[str, Any]:
  with open(path, "rb") as f:
    if f.read(4) != b"GGUF":
      raise ValueError(
          f"{path} is not a GGUF file (it does not start with b'GGUF')."
      )
  mm = np.memmap(path, dtype=np.uint8, mode="r")
  buf = memoryview(mm)
  version, _, kv_count = struct.unpack_from("<IQQ", buf, 4)
  if version not in (2, 3):
    raise ValueError(f"{path} is GGUF version {version}; only 2 and 3 work.")
  pos, meta = 24, {}
  for _ in range(kv_count):
    key, pos = _read_string(buf, pos)
    (vtype,) = struct.unpack_from("<I", buf, pos)
    value, pos = _read_value(buf, pos + 4, vtype, key in string_arrays)
    if key.startswith(_WANTED_PREFIXES):
      meta[key] = value
  return meta


def _from_reader(reader: Any, string_arrays: Collection[str]) -> dict[str, Any]:
  """Reads the same keys from an open `gguf.GGUFReader`."""
  meta = {}
  for key, field in reader.fields.items():
    if not key.startswith(_WANTED_PREFIXES):
      continue
    types = list(field.types)
    if not types:
      continue
    if types[0] == _ARRAY:
      if len(types) > 1 and types[1] == _STRING:
        if key in string_arrays:
          meta[key] = [
              bytes(field.parts[i]).decode("utf-8", "replace")
              for i in field.data
          ]
        else:
          meta[key] = len(field.data)
      else:
        meta[key] = np.concatenate([field.parts[i] for i in field.data]) if (
            field.data
        ) else np.zeros((0,))
    elif types[0] == _STRING:
      meta[key] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    else:
      meta[key] = field.parts[field.data[0]].tolist()[0]
  return meta


def gguf_file_path(path_or_reader: Any) -> str | None:
  """The file behind a path or a `gguf.GGUFReader` (None if unknown)."""
  if isinstance(path_or_reader, (str, os.PathLike)):
    return os.fspath(path_or_reader)
  data = getattr(path_or_reader, "data", None)
  name = getattr(data, "filename", None)
  return os.fspath(name) if name else None


def read_tokenizer_metadata(
    path_or_reader: Any, string_arrays: Collection[str] = ()
) -> dict[str, Any]:
  """Returns the ``tokenizer.*`` and ``general.architecture`` metadata.

  Numeric arrays come back as numpy arrays. String arrays come back as lists
  of str if their key is in ``string_arrays`` and as their length otherwise.

  Args:
    path_or_reader: A GGUF file path or an open `gguf.GGUFReader`.
    string_arrays: Keys of string arrays to decode (e.g.
      ``"tokenizer.ggml.tokens"``).

  Raises:
    ValueError: If the file is not a readable GGUF file.
  """
  if isinstance(path_or_reader, (str, os.PathLike)):
    path = os.fspath(path_or_reader)
    if not os.path.isfile(path):
      raise ValueError(f"GGUF file {path!r} does not exist.")
    return _from_path(path, set(string_arrays))
  if hasattr(path_or_reader, "fields"):
    return _from_reader(path_or_reader, set(string_arrays))
  raise TypeError(
      "Expected a GGUF file path or a gguf.GGUFReader, got "
      f"{type(path_or_reader).__name__}."
  )
