"""Reads the tokenizer metadata of a GGUF file, without its tensors.

`gguf.GGUFReader` parses every field and tensor of a file up front, which
takes seconds for a 262k-token vocabulary. The tokenizer needs a handful of
keys, so this module walks the key/value section of the file directly and
decodes only the arrays it is asked for. An open `gguf.GGUFReader` (the model
loader passes one) is read through its file when it knows it, else through
its fields.

The file is untrusted: every length is checked against the file's size
before it is used, and strings of the keys read must be valid UTF-8 (a
replacement character would silently merge two tokens). Problems raise
`file_values.TokenizerFileError` naming the file and the key.

Walking the file also yields a digest of the raw bytes of every key read
(see `read_tokenizer_fields`): it identifies the vocabulary's content, and
names the tokenizer cache entry built from it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Collection
from typing import Any

import numpy as np

from penzai_lm.tokenizer.file_values import TokenizerFileError

__all__ = ["gguf_file_path", "read_tokenizer_fields", "read_tokenizer_metadata"]

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
_CORRUPT = "the file is truncated or corrupt; re-download it"

# Keys read as full values; string arrays are decoded only when requested.
_WANTED_PREFIXES = ("tokenizer.", "general.architecture")


def _decode(raw: bytes, file: str, key: str, index: int | None) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    which = "its value" if index is None else f"entry {index}"
    raise TokenizerFileError(
        file, key,
        f"is not valid UTF-8: {which} is {raw[:40]!r} (bad byte at {e.start})"
        f"; {_CORRUPT}.") from e


class _Walker:
  """Reads values from the key/value section, checking every bound."""

  def __init__(self, buf: memoryview, file: str):
    self.buf, self.file, self.key = buf, file, "(the GGUF header)"

  def need(self, pos: int, n: int) -> None:
    if n < 0 or pos + n > len(self.buf):
      raise TokenizerFileError(
          self.file, self.key,
          f"needs bytes {pos}..{pos + n}, past the end of the file "
          f"({len(self.buf)} bytes); {_CORRUPT}.")

  def unpack(self, fmt: str, pos: int) -> tuple[Any, ...]:
    self.need(pos, struct.calcsize(fmt))
    return struct.unpack_from(fmt, self.buf, pos)

  def raw_string(self, pos: int) -> tuple[bytes, int]:
    (length,) = self.unpack("<Q", pos)
    self.need(pos + 8, length)
    return bytes(self.buf[pos + 8 : pos + 8 + length]), pos + 8 + length

  def value(self, pos: int, vtype: int, decode: bool) -> tuple[Any, int]:
    if vtype in _SCALAR:
      (value,) = self.unpack(_SCALAR[vtype], pos)
      return value, pos + struct.calcsize(_SCALAR[vtype])
    if vtype == _STRING:
      raw, pos = self.raw_string(pos)
      return _decode(raw, self.file, self.key, None), pos
    if vtype != _ARRAY:
      raise TokenizerFileError(
          self.file, self.key, f"has unknown value type {vtype}; {_CORRUPT}.")
    etype, count = self.unpack("<IQ", pos)
    pos += 12
    if etype in _NUMPY:
      nbytes = count * np.dtype(_NUMPY[etype]).itemsize
      self.need(pos, nbytes)
      arr = np.frombuffer(self.buf, _NUMPY[etype], count=count, offset=pos)
      return arr.copy(), pos + nbytes
    if etype != _STRING:
      raise TokenizerFileError(
          self.file, self.key,
          f"is an array of element type {etype}, which GGUF does not define;"
          f" {_CORRUPT}.")
    values = [] if decode else None
    unpack, size = struct.Struct("<Q").unpack_from, len(self.buf)
    for i in range(count):
      if pos + 8 > size:
        self.need(pos, 8)
      (length,) = unpack(self.buf, pos)
      pos += 8
      if pos + length > size:
        self.need(pos, length)
      if values is not None:
        values.append(_decode(
            bytes(self.buf[pos : pos + length]), self.file, self.key, i))
      pos += length
    return (values if values is not None else count), pos


def _from_path(
    path: str, string_arrays: Collection[str]
) -> tuple[dict[str, Any], str]:
  with open(path, "rb") as f:
    if f.read(4) != b"GGUF":
      raise ValueError(
          f"{path} is not a GGUF file (it does not start with b'GGUF')."
      )
  mm = np.memmap(path, dtype=np.uint8, mode="r")
  walker = _Walker(memoryview(mm), path)
  version, _, kv_count = walker.unpack("<IQQ", 4)
  if version not in (2, 3):
    raise ValueError(f"{path} is GGUF version {version}; only 2 and 3 work.")
  pos, meta = 24, {}
  digest = hashlib.sha256(b"penzai_lm GGUF tokenizer fields\0")
  for n in range(kv_count):
    start = pos
    walker.key = f"(metadata entry {n})"
    raw_key, pos = walker.raw_string(pos)
    key = raw_key.decode("utf-8", "replace")
    wanted = key.startswith(_WANTED_PREFIXES)
    walker.key = key
    (vtype,) = walker.unpack("<I", pos)
    value, pos = walker.value(pos + 4, vtype, wanted and key in string_arrays)
    if wanted:
      meta[key] = value
      digest.update(walker.buf[start:pos])  # Key, type and value bytes.
  return meta, digest.hexdigest()


def _from_reader(reader: Any, string_arrays: Collection[str]) -> dict[str, Any]:
  """Reads the same keys from an open `gguf.GGUFReader`."""
  file, meta = "a GGUF file", {}
  for key, field in reader.fields.items():
    if not key.startswith(_WANTED_PREFIXES):
      continue
    types = list(field.types)
    if not types:
      continue
    if types[0] == _ARRAY:
      if len(types) > 1 and types[1] == _STRING:
        if key in string_arrays:
          meta[key] = [_decode(bytes(field.parts[i]), file, key, n)
                       for n, i in enumerate(field.data)]
        else:
          meta[key] = len(field.data)
      else:
        meta[key] = np.concatenate([field.parts[i] for i in field.data]) if (
            field.data
        ) else np.zeros((0,))
    elif types[0] == _STRING:
      meta[key] = _decode(bytes(field.parts[field.data[0]]), file, key, None)
    else:
      meta[key] = field.parts[field.data[0]].tolist()[0]
  return meta


def gguf_file_path(path_or_reader: Any) -> str | None:
  """The file behind a path or a `gguf.GGUFReader` (None if unknown)."""
  if isinstance(path_or_reader, (str, os.PathLike)):
    return os.fspath(path_or_reader)
  # penzai_lm's reader (`checkpoints.gguf_file`) remembers its path; its
  # ``data`` is a plain ndarray view with no file name.
  name = getattr(path_or_reader, "path", None)
  if not isinstance(name, (str, os.PathLike)):
    name = getattr(getattr(path_or_reader, "data", None), "filename", None)
  return os.fspath(name) if name else None


def read_tokenizer_fields(
    path_or_reader: Any, string_arrays: Collection[str] = ()
) -> tuple[dict[str, Any], str | None]:
  """Returns the ``tokenizer.*`` and ``general.architecture`` metadata.

  Numeric arrays come back as numpy arrays. String arrays come back as lists
  of str if their key is in ``string_arrays`` and as their length otherwise.

  Args:
    path_or_reader: A GGUF file path or an open `gguf.GGUFReader`.
    string_arrays: Keys of string arrays to decode (e.g.
      ``"tokenizer.ggml.tokens"``).

  Returns:
    ``(metadata, digest)``: ``digest`` is the sha256 (hex) of the raw bytes
    of every key returned, whether decoded or not; None for a reader whose
    file is unknown.

  Raises:
    ValueError: If the file is not a readable GGUF file
      (`file_values.TokenizerFileError` when a key is truncated or holds
      invalid UTF-8).
  """
  path = gguf_file_path(path_or_reader)
  if path is not None:
    if not os.path.isfile(path):
      raise ValueError(f"GGUF file {path!r} does not exist.")
    return _from_path(path, set(string_arrays))
  if hasattr(path_or_reader, "fields"):
    return _from_reader(path_or_reader, set(string_arrays)), None
  raise TypeError(
      "Expected a GGUF file path or a gguf.GGUFReader, got "
      f"{type(path_or_reader).__name__}."
  )


def read_tokenizer_metadata(
    path_or_reader: Any, string_arrays: Collection[str] = ()
) -> dict[str, Any]:
  """`read_tokenizer_fields` without the digest."""
  return read_tokenizer_fields(path_or_reader, string_arrays)[0]
