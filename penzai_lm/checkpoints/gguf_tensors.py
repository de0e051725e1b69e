"""GGUF tensors -> Hugging Face ``state_dict`` tensors.

Maps llama.cpp tensor names to HF names, dequantizes each tensor once with
``gguf.quants.dequantize`` (or a caller's `BlockDecoder` that gives the same
values) and converts it to HF's value conventions.
`read_gguf_tensor` reads a tensor's bytes explicitly
(:mod:`~penzai_lm.checkpoints.tensor_io`: no pages of the file's memory map
are touched) and dequantizes them a chunk of rows at a time straight into
the wanted dtype; float32 exists only one chunk at a time.

The conventions:

* GGUF lists shapes as ``[in, out]``; the numpy arrays are ``(out, in)``, which
  is already HF's ``nn.Linear`` layout.
* llama.cpp permutes the rows of llama q/k projections (and biases) for its
  interleaved-pair RoPE; they are un-permuted here to HF's rotate-half layout
  (``GGUFSpec.unpermute_qk``).
* gemma2/gemma3 files store RMSNorm weights as ``1 + w``; HF's Gemma RMSNorms
  store ``w`` (and compute ``x * (1 + w)``), so 1 is subtracted (in float32)
  (``GGUFSpec.norm_offset``).

Block tensor names come from the spec's ``GGUFSpec.block_names``.
"""

from __future__ import annotations

from pathlib import Path
import re
from typing import Callable

import numpy as np

from penzai_lm.checkpoints.architectures import spec_for
from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.tensor_io import aligned_empty
from penzai_lm.checkpoints.tensor_io import read_at
from penzai_lm.checkpoints.validation import check_finite

# Values dequantized per gguf-py call (256 KiB of float32). gguf-py's
# dequantizers make several temporaries of their input's size; chunks of
# this many values bound them and keep them in cache (see docs/design.md).
_CHUNK_VALUES = 1 << 16

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([A-Za-z0-9_]+)\.(weight|bias)$")


def hf_tensor_name(
    architecture: str | ArchitectureSpec, gguf_name: str
) -> str | None:
  """HF state_dict name of a GGUF tensor, or None if it has no HF counterpart.

  Args:
    architecture: A built-in architecture name, or a spec with a ``gguf``
      part.
    gguf_name: The llama.cpp tensor name.
  """
  m = _BLOCK_RE.match(gguf_name)
  if m:
    layer, kind, suffix = m.groups()
    hf = spec_for(architecture).gguf.block_names.get(kind)
    return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"
  m = _TOP_RE.match(gguf_name)
  if m and m.group(1) in _TOP_LEVEL_NAMES:
    return f"{_TOP_LEVEL_NAMES[m.group(1)]}.{m.group(2)}"
  return None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's ``permute`` of q/k rows (weights or biases).

  llama.cpp writes ``w.reshape(n, 2, d//n//2, ...).swapaxes(1, 2)``; this is
  its inverse.
  """
  d = w.shape[0]
  if d % (2 * n_head):
    raise CheckpointError(
        f"cannot un-permute a q/k tensor with {d} rows into {n_head} heads"
    )
  return (
      w.reshape(n_head, d // n_head // 2, 2, *w.shape[1:])
      .swapaxes(1, 2)
      .reshape(w.shape)
  )


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's ``permute`` (HF layout -> GGUF layout), for tests and writers."""
  d = w.shape[0]
  return (
      w.reshape(n_head, 2, d // n_head // 2, *w.shape[1:])
      .swapaxes(1, 2)
      .reshape(w.shape)
  )


# ``decode(ggml_type, blocks, out) -> bool``: a faster decoder of GGUF blocks
# than gguf-py (the CPU kernels' `penzai_lm.kernels.gguf_blocks`, passed
# down by the loader). It fills float32 ``out`` [rows, cols] from the rows'
# blocks ``blocks`` (uint8 [rows, row bytes], as in the file) with exactly
# the values gguf-py gives, or returns False for a type it does not decode,
# which gguf-py then does.
BlockDecoder = Callable[[int, np.ndarray, np.ndarray], bool]


def _dequantize_data(data: np.ndarray, qtype, name: str, path) -> np.ndarray:
  """``gguf.quants.dequantize`` with its errors as CheckpointErrors.

  Block formats go to their gguf-py class's ``dequantize_rows`` directly:
  the same arithmetic, without ``dequantize``'s split into calls of 16 rows.
  """
  import gguf  # pylint: disable=g-import-not-at-top

  quant = getattr(gguf.quants, qtype.name, None)
  try:
    if (quant is not None and getattr(quant, "qtype", None) == qtype
        and hasattr(quant, "dequantize_rows") and data.ndim == 2):
      quant.init_grid()
      return quant.dequantize_rows(data)
    return gguf.quants.dequantize(data, qtype)
  except NotImplementedError as e:
    raise CheckpointError(
        f"GGUF file {path}: tensor {name!r} has type"
        f" {qtype.name}, which gguf-py cannot dequantize"
    ) from e
  except Exception as e:
    raise CheckpointError(
        f"GGUF file {path}: cannot decode tensor {name!r}: {e};"
        f" {CORRUPT_HINT}"
    ) from e


def dequantize(t, path: Path) -> np.ndarray:
  """A GGUF tensor as a float32 array of its (out, in) numpy shape.

  Args:
    t: A ``gguf.ReaderTensor``.
    path: The file it belongs to, for error messages.

  Returns:
    A new array, not a view of the memory-mapped file.

  Raises:
    CheckpointError: a type gguf-py cannot dequantize, undecodable data, or
      NaN/inf values.
  """
  arr = _dequantize_data(t.data, t.tensor_type, t.name, path)
  want = tuple(int(d) for d in reversed(t.shape.tolist()))
  if arr.dtype != np.float32:
    arr = arr.astype(np.float32)
  elif arr.base is not None or not arr.flags.writeable:
    arr = np.array(arr)  # detach F32 views from the memory-mapped file
  if tuple(arr.shape) != want:
    arr = arr.reshape(want)
  # Checked here, once per tensor while it is hot in cache: a NaN weight
  # would otherwise load silently and make every log-probability NaN.
  check_finite(arr, f"GGUF file {path}: tensor {t.name!r}")
  return arr


def read_gguf_tensor(
    path: Path,
    t,
    dtype: np.dtype,
    *,
    unpermute_heads: int | None = None,
    norm_offset: float = 0.0,
    decode_blocks: BlockDecoder | None = None,
) -> np.ndarray:
  """One tensor in HF conventions, as a new 64-byte-aligned array of ``dtype``.

  Equal to ``dequantize(t, path)``, with `to_hf_values`' conventions
  applied in float32 and then cast to ``dtype``; but read from the file
  with explicit reads and dequantized a chunk of rows at a time.

  Args:
    path: The GGUF file.
    t: Its ``gguf.ReaderTensor`` (offsets already checked).
    dtype: float32 or bfloat16.
    unpermute_heads: Un-permute the rows into this many heads (llama q/k).
    norm_offset: Subtracted from every value (in float32).
    decode_blocks: Decodes the blocks of the types it knows (`BlockDecoder`,
      the same values), gguf-py the rest.

  Raises:
    CheckpointError: as `dequantize` (NaN/inf named for the whole tensor).
  """
  import gguf  # pylint: disable=g-import-not-at-top

  want = tuple(int(d) for d in reversed(t.shape.tolist()))
  cols = want[-1] if want else 1
  rows = int(t.n_elements) // max(cols, 1)
  block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
  row_bytes = cols // block * type_size
  out = aligned_empty(want, dtype)
  flat = out.reshape(rows, cols)
  step = max(1, _CHUNK_VALUES // max(cols, 1))
  buf = np.empty(min(step, rows) * row_bytes, np.uint8)
  scratch = None  # The decoder's float32 rows, where ``out`` is not.
  if decode_blocks is not None and out.dtype != np.float32:
    scratch = np.empty((min(step, rows), cols), np.float32)
  where = f"GGUF file {path}: tensor {t.name!r}"
  with open(path, "rb", buffering=0) as f:
    for start in range(0, rows, step):
      n = min(step, rows - start)
      raw = buf[: n * row_bytes].reshape(n, row_bytes)
      read_at(f, t.data_offset + start * row_bytes, raw, where)
      rows_out = flat[start:start + n]
      values = rows_out if scratch is None else scratch[:n]
      if decode_blocks is None or not decode_blocks(
          int(t.tensor_type), raw, values):
        values = _dequantize_data(raw, t.tensor_type, t.name, path)
        values = values.astype(np.float32, copy=False).reshape(n, cols)
      try:
        check_finite(values, where)
      except CheckpointError:
        dequantize(t, path)  # raises, counting over the whole tensor
        raise
      if norm_offset:
        values = values - np.float32(norm_offset)
      if values is not rows_out:  # Decoded in place otherwise.
        rows_out[...] = values
  if unpermute_heads is not None:
    out = unpermute_rows(out, unpermute_heads)
  return out


def read_gguf_blocks(
    path: Path, t, *, unpermute_heads: int | None = None
) -> np.ndarray:
  """A quantized tensor's raw blocks, ``uint8 [rows, row_bytes]``, with its
  rows in HF order (``unpermute_heads`` as for `read_gguf_tensor`; blocks
  run along a row, so moving whole rows keeps them intact)."""
  import gguf  # pylint: disable=g-import-not-at-top

  cols = int(t.shape[0])
  rows = int(t.n_elements) // max(cols, 1)
  block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
  out = aligned_empty((rows, cols // block * type_size), np.uint8)
  with open(path, "rb", buffering=0) as f:
    read_at(f, t.data_offset, out, f"GGUF file {path}: tensor {t.name!r}")
  if unpermute_heads is not None:
    out = unpermute_rows(out, unpermute_heads)
  return out


def hf_conventions(
    spec: ArchitectureSpec,
    gguf_name: str,
    hf_name: str,
    heads: int,
    kv_heads: int,
) -> tuple[int | None, float]:
  """``(heads to un-permute the rows into or None, value to subtract)``."""
  g = spec.gguf
  unpermute = None
  if g.unpermute_qk:
    if ".self_attn.q_proj." in hf_name:
      unpermute = heads
    elif ".self_attn.k_proj." in hf_name:
      unpermute = kv_heads
  offset = 0.0
  if g.norm_offset and gguf_name.endswith("norm.weight"):
    offset = float(g.norm_offset)
  return unpermute, offset


def to_hf_values(
    spec: ArchitectureSpec,
    gguf_name: str,
    hf_name: str,
    arr: np.ndarray,
    heads: int,
    kv_heads: int,
) -> np.ndarray:
  """Converts a dequantized tensor to HF's value conventions (see above)."""
  unpermute, offset = hf_conventions(spec, gguf_name, hf_name, heads, kv_heads)
  if unpermute is not None:
    arr = unpermute_rows(arr, unpermute)
  if offset:
    arr = arr - np.float32(offset)
  return arr
