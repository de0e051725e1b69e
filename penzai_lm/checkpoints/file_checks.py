"""File layout checks: a checkpoint file's tensor table against the file,
before any tensor data is touched (see `penzai_lm.checkpoints.validation`
for the checks that follow: config against tensors, config values, weights).

* GGUF tensor types, shapes and offsets against the file length,
  ``general.alignment`` and each other (`check_gguf_tensor_infos`);
* safetensors header entries against the file, their dtype x shape and
  each other (`check_safetensors_header`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Sequence

from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError

# No real tensor dimension comes near this; a bigger one (possible next to a
# zero dimension, where byte counts cannot catch it) would overflow numpy.
MAX_DIMENSION = 2**40

# GGML tensors have at most 4 dimensions (GGML_MAX_DIMS).
_GGUF_MAX_DIMS = 4

# safetensors dtype -> bytes per element.
_SAFETENSORS_SIZES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 1),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 2),
    **dict.fromkeys(("I32", "U32", "F32"), 4),
    **dict.fromkeys(("I64", "U64", "F64"), 8),
}


def _is_int(v: Any) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_no_overlap(spans: list[tuple[int, int, str]], where: str) -> None:
  """Raises if two (start, end, name) byte ranges overlap.

  After sorting by start, any overlap shows up between neighbours.
  """
  spans = sorted(s for s in spans if s[1] > s[0])
  for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
    if s1 < e0:
      raise CheckpointError(
          f"{where}: tensors {n0!r} (bytes {s0}..{e0}) and {n1!r} (bytes"
          f" {s1}..{e1}) overlap; {CORRUPT_HINT}"
      )


def check_gguf_tensor_infos(
    path: str,
    file_size: int,
    data_start: int,
    alignment: int,
    infos: Iterable[tuple[str, Sequence[int], int, int]],
) -> None:
  """Checks GGUF tensor infos against the file, before any view is built.

  Args:
    path: The file, for messages.
    file_size: Its length in bytes.
    data_start: File offset of the tensor data section.
    alignment: ``general.alignment`` (default 32).
    infos: ``(name, dims, raw ggml type, offset in the data section)`` per
      tensor, as stored (dims innermost first).

  Raises:
    CheckpointError: an unknown type, a shape that does not fit its type's
      blocks, a misaligned offset, data past the end of the file, or two
      tensors sharing bytes.
  """
  import gguf  # pylint: disable=g-import-not-at-top

  spans = []
  for name, dims, raw_type, offset in infos:
    where = f"GGUF file {path}: tensor {name!r}"
    try:
      qtype = gguf.GGMLQuantizationType(raw_type)
      block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
      raise CheckpointError(
          f"{where} has unknown tensor type {raw_type}; {CORRUPT_HINT}"
      ) from None
    dims = [int(d) for d in dims]
    if len(dims) > _GGUF_MAX_DIMS or any(d > MAX_DIMENSION for d in dims):
      raise CheckpointError(
          f"{where} claims an impossible shape {dims}; {CORRUPT_HINT}"
      )
    if dims and dims[0] % block:
      raise CheckpointError(
          f"{where} has shape {dims}, but its type {qtype.name} stores blocks"
          f" of {block} values along the first dimension; {CORRUPT_HINT}"
      )
    if offset % alignment:
      raise CheckpointError(
          f"{where} starts at data offset {offset}, which is not a multiple"
          f" of general.alignment={alignment}; {CORRUPT_HINT}"
      )
    n_bytes = math.prod(dims) // block * type_size
    start = data_start + offset
    if start + n_bytes > file_size:
      raise CheckpointError(
          f"{where} (type {qtype.name}, shape {dims}) needs {n_bytes:,} bytes"
          f" at file offset {start:,}, past the end of the file"
          f" ({file_size:,} bytes); {CORRUPT_HINT}"
      )
    spans.append((start, start + n_bytes, name))
  _check_no_overlap(spans, f"GGUF file {path}")


def check_safetensors_header(
    file: str, header: Any, data_start: int, file_size: int
) -> dict[str, dict[str, Any]]:
  """Checks a parsed safetensors header against the file it came from.

  Args:
    file: The file, for messages.
    header: The parsed JSON header.
    data_start: File offset of the data section (8 + header length).
    file_size: The file's length in bytes.

  Returns:
    Tensor name -> header entry (``dtype``, ``shape``, ``data_offsets``),
    without ``__metadata__``.

  Raises:
    CheckpointError: a malformed entry, an unknown dtype, a dtype x shape
      that disagrees with the entry's byte range, data past the end of the
      file, or two tensors sharing bytes.
  """
  if not isinstance(header, dict):
    raise CheckpointError(
        f"{file}: the safetensors header is not a JSON object; {CORRUPT_HINT}"
    )
  data_len = file_size - data_start
  entries, spans = {}, []
  for name, info in header.items():
    if name == "__metadata__":
      continue
    where = f"{file}: tensor {name!r}"
    try:
      dtype, shape = info["dtype"], list(info["shape"])
      start, end = info["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise CheckpointError(
          f"{where} has a malformed header entry {str(info)[:200]};"
          f" {CORRUPT_HINT}"
      ) from None
    if dtype not in _SAFETENSORS_SIZES:
      raise CheckpointError(
          f"{where} has unknown dtype {dtype!r} in the header; {CORRUPT_HINT}"
      )
    if not all(_is_int(d) and 0 <= d <= MAX_DIMENSION for d in shape):
      raise CheckpointError(
          f"{where} has an impossible shape {shape} in the header;"
          f" {CORRUPT_HINT}"
      )
    if not (_is_int(start) and _is_int(end) and 0 <= start <= end):
      raise CheckpointError(
          f"{where} has invalid data_offsets {[start, end]} in the header;"
          f" {CORRUPT_HINT}"
      )
    if end > data_len:
      raise CheckpointError(
          f"{where}: the header places its data at bytes {start}..{end} of"
          f" the data section, but the file holds only {data_len} bytes of"
          f" data; {CORRUPT_HINT}"
      )
    want = math.prod(shape) * _SAFETENSORS_SIZES[dtype]
    if end - start != want:
      raise CheckpointError(
          f"{where}: dtype {dtype} x shape {shape} is {want} bytes, but its"
          f" data_offsets span {end - start} bytes (the header's dtype or"
          f" shape is wrong); {CORRUPT_HINT}"
      )
    entries[name] = info
    spans.append((data_start + start, data_start + end, name))
  _check_no_overlap(spans, file)
  return entries
