"""Opening GGUF files: magic check, a faster ``gguf.GGUFReader``, bounds.

The reader checks every tensor's type, shape and offset against the file
(:func:`~penzai_lm.checkpoints.file_checks.check_gguf_tensor_infos`) before
gguf-py builds any view of the data: a misaligned, overlapping or
out-of-file tensor is named in a :class:`CheckpointError` instead of being
read as garbage or failing with a numpy reshape error.
"""

from __future__ import annotations

import collections.abc
import functools
import operator
import os
from pathlib import Path
import struct

import numpy as np

from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.file_checks import check_gguf_tensor_infos

GGUF_MAGIC = b"GGUF"


_U64 = struct.Struct("<Q")


class ArrayParts(collections.abc.Sequence):
  """The ``parts`` of a GGUF field holding an array: the views gguf-py's
  reader lists (the field's own ``head`` parts, the array's type and
  length, then per element its value, or for a string its length and its
  bytes), each made when it is read.

  Args:
    head: The parts before the elements'.
    data: Scalar elements: their values (one per part). Strings: the file.
    starts: Strings only: each string's offset in ``data`` (its length
      field), then the offset after the last one.
  """

  def __init__(self, head: list, data: np.ndarray,
               starts: list[int] | None = None):
    self._head, self._data, self._starts = list(head), data, starts

  def after(self, head: list) -> "ArrayParts":
    """These parts behind ``head``."""
    return ArrayParts(list(head) + self._head, self._data, self._starts)

  def __len__(self) -> int:
    if self._starts is None:
      return len(self._head) + len(self._data)
    return len(self._head) + 2 * (len(self._starts) - 1)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    n = len(self)
    index = operator.index(index)
    if index < 0:
      index += n
    if not 0 <= index < n:
      raise IndexError("part index out of range")
    k = index - len(self._head)
    if k < 0:
      return self._head[index]
    if self._starts is None:
      return self._data[k:k + 1]
    start = self._starts[k // 2]
    if k % 2 == 0:
      return self._data[start:start + 8].view(np.uint64)
    return self._data[start + 8:self._starts[k // 2 + 1]]


@functools.cache
def _fast_reader_class():
  import gguf  # pylint: disable=g-import-not-at-top

  array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

  class FastGGUFReader(gguf.GGUFReader):
    """A ``gguf.GGUFReader`` that slices a plain ndarray view of its memmap.

    GGUFReader makes a few numpy views per metadata value (two per token of a
    262k-token vocabulary); views of an ``np.memmap`` go through Python-level
    ``__array_finalize__``, which slows opening down. The parsed fields
    and tensors are identical; tensor ``data`` are plain ndarray views of the
    same read-only mapping.

    Arrays of strings and of scalars (a vocabulary and its token types and
    merges) are split into the same parts in one pass, instead of one
    recursive call per element, and their parts are `ArrayParts`: each
    element's view is made when it is read (a load reads none of them).

    It also checks the tensor infos against the file before building tensor
    views, and remembers its ``path`` for error messages.
    """

    def __init__(self, path, mode="r"):
      self.path = str(path)
      super().__init__(path, mode)

    def _build_fields(self, offs, count):
      # gguf-py's loop, without concatenating each field's parts into a
      # list (that would make every element's view of an `ArrayParts`).
      for _ in range(count):
        orig_offs = offs
        kv_klen, kv_kdata = self._get_str(offs)
        offs += int(kv_klen.nbytes + kv_kdata.nbytes)
        raw_kv_type = self._get(offs, np.uint32)
        offs += int(raw_kv_type.nbytes)
        head = [kv_klen, kv_kdata, raw_kv_type]
        size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
        if isinstance(parts, ArrayParts):
          parts = parts.after(head)
        else:
          parts = head + parts
        self._push_field(gguf.ReaderField(
            orig_offs, str(bytes(kv_kdata), encoding="utf-8"), parts,
            [i + len(head) for i in idxs], types), skip_sum=True)
        offs += size
      return offs

    def _get_field_parts(self, orig_offs, raw_type):
      if raw_type != array or self.byte_order != "I":
        return super()._get_field_parts(orig_offs, raw_type)
      data = self._plain_data
      raw_itype = self._get(orig_offs, np.uint32)
      alen = self._get(orig_offs + 4, np.uint64)
      itype, n = int(raw_itype[0]), int(alen[0])
      scalar = self.gguf_scalar_to_np.get(itype) if itype != string else None
      if n == 0 or (itype != string and scalar is None):
        return super()._get_field_parts(orig_offs, raw_type)
      offs = orig_offs + 12
      if itype == string:
        starts, buf, size = [], memoryview(data), len(data)
        for _ in range(n):
          if offs + 8 > size:
            raise ValueError(f"a string array runs past the end, at {offs}")
          (length,) = _U64.unpack_from(buf, offs)
          if offs + 8 + length > size:
            raise ValueError(f"a string runs past the end, at {offs}")
          starts.append(offs)
          offs += 8 + length
        starts.append(offs)
        parts = ArrayParts([raw_itype, alen], data, starts)
        return (offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)),
                [array, string])
      itemsize = np.dtype(scalar).itemsize
      if offs + itemsize * n > len(data):
        raise ValueError(f"an array runs past the end, at {offs}")
      values = data[offs:offs + itemsize * n].view(scalar)
      return (12 + itemsize * n, ArrayParts([raw_itype, alen], values),
              list(range(2, 2 + n)), [array, gguf.GGUFValueType(itype)])

    def _build_tensors(self, start_offs, fields):
      infos = []
      for f in fields:
        _, name, _, dims, raw_type, offset = f.parts
        infos.append((
            bytes(name).decode("utf-8", "replace"),
            dims.tolist(),
            int(raw_type[0]),
            int(offset[0]),
        ))
      check_gguf_tensor_infos(
          self.path, len(self._plain_data), int(start_offs),
          int(self.alignment), infos,
      )
      super()._build_tensors(start_offs, fields)

    @property
    def data(self):
      return self._plain_data

    @data.setter
    def data(self, value):
      self._memmap = value
      self._plain_data = value.view(np.ndarray)

  return FastGGUFReader


def open_gguf_reader(path: str | os.PathLike):
  """Opens ``path`` with a (faster) ``gguf.GGUFReader``.

  No magic check; tensor infos are checked against the file (CheckpointError).
  """
  return _fast_reader_class()(path, "r")


def open_checked(path: Path):
  """Opens a GGUF file, checking its magic and that every tensor fits in it.

  Args:
    path: An existing file.

  Returns:
    The open reader.

  Raises:
    CheckpointError: not a GGUF file, or a truncated or corrupt one (tensors
      with unknown types, misaligned, overlapping or past the end).
  """
  size = path.stat().st_size
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    if len(magic) < 4:
      raise CheckpointError(
          f"{path} is not a GGUF file: it is only {size} bytes long"
          f" ({CORRUPT_HINT})"
      )
    raise CheckpointError(
        f"{path} is not a GGUF file (starts with {magic!r}, expected"
        f" {GGUF_MAGIC!r})"
    )
  try:
    return open_gguf_reader(path)
  except CheckpointError:
    raise  # the tensor-info checks already say what and where
  except Exception as e:  # gguf raises ValueError/IndexError/KeyError/...
    raise CheckpointError(
        f"Cannot read GGUF file {path}: {type(e).__name__}: {e}; {CORRUPT_HINT}"
    ) from e
