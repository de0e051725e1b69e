"""Explicit per-tensor reads from checkpoint files, into aligned buffers.

Two conventions that keep a load's host memory at the size of the weights:

* Tensor data is read with ``readinto`` at the tensor's offset, into a
  buffer made for it, never through a memory map. Pages of a mapping that
  were touched count in the process's RSS for as long as the mapping lives
  (a whole shard's pages until its mapping closes). Pages read with
  ``readinto`` stay in the kernel's page cache, outside the process.
* Buffers are 64-byte aligned (`aligned_empty`; large ones are anonymous
  mappings, see `_MAP_MIN_BYTES`). On the CPU backend,
  ``jax.device_put`` of a C-contiguous numpy array whose data is 64-byte
  aligned aliases it instead of copying it (at a 16- or 32-byte offset,
  where numpy's allocator leaves large arrays, it is copied).
  ``jnp.asarray`` copies in both cases. So a buffer filled here becomes the
  device array itself.
"""

from __future__ import annotations

import math
import mmap
from typing import BinaryIO

import ml_dtypes
import numpy as np

from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError

ALIGNMENT = 64
# Values per step of `all_finite`. Its temporaries then stay in cache and are
# allocated once per call; whole-tensor temporaries are fresh pages on every
# call, whose faults slow the check many times over (see docs/design.md).
_FINITE_CHUNK = 1 << 16
# Tile edge of `copy_into`'s transposing copies (see docs/design.md).
_TILE = 128
# Buffers from this size up are anonymous mappings populated when made
# (MAP_POPULATE), not numpy allocations. numpy asks for transparent huge
# pages, whose first-touch faults stall in memory compaction on a busy
# host; populating a mapping when it is made faults fastest (see
# docs/design.md). Mappings are page-aligned, and unmapped when the last
# array using them goes.
_MAP_MIN_BYTES = 1 << 20
# One read() call moves at most this much (Linux caps a read at ~2 GiB).
_MAX_READ = 1 << 30


def aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialized C-contiguous array whose data is `ALIGNMENT`-aligned."""
  dtype = np.dtype(dtype)
  shape = tuple(int(d) for d in shape)
  nbytes = math.prod(shape) * dtype.itemsize
  if nbytes >= _MAP_MIN_BYTES and hasattr(mmap, "MAP_POPULATE"):
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype).reshape(
        shape
    )
  raw = np.empty(nbytes + ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ALIGNMENT
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def is_aligned(array: np.ndarray) -> bool:
  """Whether ``array`` is C-contiguous with `ALIGNMENT`-aligned data."""
  return bool(array.flags.c_contiguous) and array.ctypes.data % ALIGNMENT == 0


def all_finite(array: np.ndarray) -> bool:
  """Whether ``array`` holds no NaN or inf, in cache-sized steps."""
  flat = np.ravel(array)
  if flat.dtype == np.dtype(ml_dtypes.bfloat16):
    # NaN/inf are the bf16 values whose exponent bits are all set; testing
    # the bits is faster than ml_dtypes' isfinite.
    bits = flat.view(np.uint16)
    scratch = np.empty(min(bits.size, _FINITE_CHUNK), np.uint16)
    for start in range(0, bits.size, _FINITE_CHUNK):
      chunk = bits[start:start + _FINITE_CHUNK]
      out = scratch[:chunk.size]
      np.bitwise_and(chunk, np.uint16(0x7FFF), out=out)
      if out.max() >= 0x7F80:
        return False
    return True
  scratch = np.empty(min(flat.size, _FINITE_CHUNK), bool)
  for start in range(0, flat.size, _FINITE_CHUNK):
    chunk = flat[start:start + _FINITE_CHUNK]
    if not np.isfinite(chunk, out=scratch[:chunk.size]).all():
      return False
  return True


def copy_into(out: np.ndarray, src: np.ndarray) -> None:
  """``np.copyto(out, src, casting="unsafe")``, faster for transposed views.

  Same values: a same-dtype copy moves bits (as unsigned integers: numpy
  copies ``ml_dtypes.bfloat16`` element by element otherwise), a cast is
  numpy's. When ``src``'s fastest-varying axis is not the last one (a
  transposed or moved-axis view), the copy goes tile by tile over those two
  axes, so that reads and writes both stay in cache.
  """
  if out.shape != src.shape:
    raise ValueError(f"cannot copy shape {src.shape} into {out.shape}")
  if out.dtype == src.dtype and out.dtype.itemsize in (1, 2, 4, 8):
    bits = np.dtype(f"u{out.dtype.itemsize}")
    out, src = out.view(bits), src.view(bits)
  sizes = [abs(st) if n > 1 else np.inf
           for st, n in zip(src.strides, src.shape)]
  fast = int(np.argmin(sizes)) if src.ndim else 0
  last = src.ndim - 1
  if src.ndim < 2 or fast == last or sizes[fast] == np.inf:
    np.copyto(out, src, casting="unsafe")
    return
  index = [slice(None)] * src.ndim
  for i in range(0, src.shape[fast], _TILE):
    index[fast] = slice(i, i + _TILE)
    for j in range(0, src.shape[last], _TILE):
      index[last] = slice(j, j + _TILE)
      np.copyto(out[tuple(index)], src[tuple(index)], casting="unsafe")


def read_at(f: BinaryIO, offset: int, out: np.ndarray, where: str) -> None:
  """Fills C-contiguous ``out`` with the bytes of ``f`` at ``offset``.

  Args:
    f: A file opened for binary reading (unbuffered is best: the data goes
      straight into ``out``).
    offset: Absolute file offset.
    out: The buffer to fill.
    where: File and tensor, for the message.

  Raises:
    CheckpointError: if the file ends first (it shrank since it was
      checked).
  """
  view = memoryview(out.reshape(-1).view(np.uint8))
  f.seek(offset)
  done = 0
  while done < len(view):
    n = f.readinto(view[done:done + _MAX_READ])
    if not n:
      raise CheckpointError(
          f"{where}: the file ended {len(view) - done} bytes before the"
          f" tensor's end; {CORRUPT_HINT}"
      )
    done += n
