"""GGUF tensors -> Hugging Face ``state_dict`` tensors.

Maps llama.cpp tensor names to HF names, dequantizes each tensor once with
``gguf.quants.dequantize`` and converts it to HF's value conventions:

* GGUF lists shapes as ``[in, out]``; the numpy arrays are ``(out, in)``, which
  is already HF's ``nn.Linear`` layout.
* llama.cpp permutes the rows of llama q/k projections (and biases) for its
  interleaved-pair RoPE; they are un-permuted here to HF's rotate-half layout
  (``GGUFSpec.unpermute_qk``).
* gemma3 files store RMSNorm weights as ``1 + w``; HF's Gemma3RMSNorm stores
  ``w`` (and computes ``x * (1 + w)``), so 1 is subtracted (in float32)
  (``GGUFSpec.norm_offset``).

Block tensor names come from the spec's ``GGUFSpec.block_names``.
"""

from __future__ import annotations

from pathlib import Path
import re

import numpy as np

from penzai_lm.checkpoints.architectures import spec_for
from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.validation import check_finite

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
  import gguf  # pylint: disable=g-import-not-at-top

  try:
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
  except NotImplementedError as e:
    raise CheckpointError(
        f"GGUF file {path}: tensor {t.name!r} has type"
        f" {t.tensor_type.name}, which gguf-py cannot dequantize"
    ) from e
  except Exception as e:
    raise CheckpointError(
        f"GGUF file {path}: cannot decode tensor {t.name!r}: {e};"
        f" {CORRUPT_HINT}"
    ) from e
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


def to_hf_values(
    spec: ArchitectureSpec,
    gguf_name: str,
    hf_name: str,
    arr: np.ndarray,
    heads: int,
    kv_heads: int,
) -> np.ndarray:
  """Converts a dequantized tensor to HF's value conventions (see above)."""
  g = spec.gguf
  if g.unpermute_qk:
    if ".self_attn.q_proj." in hf_name:
      arr = unpermute_rows(arr, heads)
    elif ".self_attn.k_proj." in hf_name:
      arr = unpermute_rows(arr, kv_heads)
  if g.norm_offset and gguf_name.endswith("norm.weight"):
    arr = arr - np.float32(g.norm_offset)
  return arr
