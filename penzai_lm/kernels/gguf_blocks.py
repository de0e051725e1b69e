"""GGUF's quantized blocks to float32 at load (`gguf_blocks.cc`).

`block_decoder` gives the loader a `penzai_lm.checkpoints.BlockDecoder`:
called with ctypes (it releases the GIL), it writes the same float32
values as gguf-py's ``dequantize_blocks`` for Q4_0, Q4_1, Q5_0, Q8_0,
Q4_K and Q6_K blocks, in one pass instead of gguf-py's several numpy
steps; other types are left to gguf-py.
"""

from __future__ import annotations

import ctypes

import numpy as np

from penzai_lm.checkpoints import BlockDecoder
from penzai_lm.kernels.build import cpu_kernels

# ggml's type numbers (``gguf.GGMLQuantizationType``) that the kernel decodes
# (its table, `kFormats`, is the one the calls go by).
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
_UNKNOWN_TYPE, _NOT_WHOLE_BLOCKS = -1, -2


def block_decoder() -> BlockDecoder | None:
  """The kernel's decoder, or None where the kernels are not available."""
  lib = cpu_kernels()
  if lib is None:
    return None
  kernel = lib.pzlm_gguf_dequantize
  kernel.restype = ctypes.c_int
  kernel.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.c_void_p, ctypes.c_int64]

  def decode(ggml_type: int, blocks: np.ndarray, out: np.ndarray) -> bool:
    """Fills ``out`` with the values of ``blocks`` (False: not a type it
    decodes; ``out`` is untouched)."""
    if (blocks.dtype != np.uint8 or out.dtype != np.float32
        or not blocks.flags.c_contiguous or not out.flags.c_contiguous
        or not out.flags.writeable):
      raise ValueError(
          "decode needs C-contiguous uint8 blocks and a writable"
          f" C-contiguous float32 out, got {blocks.dtype} and {out.dtype}")
    status = kernel(int(ggml_type), blocks.ctypes.data, blocks.nbytes,
                    out.ctypes.data, out.size)
    if status == _UNKNOWN_TYPE:
      return False
    if status == _NOT_WHOLE_BLOCKS:
      raise ValueError(
          f"{blocks.nbytes} bytes of ggml type {int(ggml_type)} blocks do not"
          f" make {out.size} values")
    return True

  return decode
