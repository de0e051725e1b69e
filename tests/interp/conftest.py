"""Shared helpers for the control-vector tests."""

import gguf
import numpy as np

from penzai_lm.interp import ControlVector

HIDDEN = 8


def vec(seed, size=HIDDEN):
  return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def make_cv(blocks=(1, 2, 5), hint="llama", size=HIDDEN):
  return ControlVector(
      directions={b: vec(b, size) for b in blocks}, model_hint=hint
  )


def write_cv_gguf(path, tensors, *, arch="controlvector", hint="llama",
                  layer_count="tensors", signed=False, drop_arch=False):
  """Writes a control-vector GGUF file with gguf's GGUFWriter.

  Args:
    tensors: ``[(name, array)]``.
    layer_count: ``{arch}.layer_count``: "tensors" (their number), an int,
      or None (no key).
    signed: Write the count as int32 (llama.cpp's generator) instead of
      uint32 (repeng).
    drop_arch: Leave out ``general.architecture``.
  """
  w = gguf.GGUFWriter(path, arch)
  if drop_arch:
    del w.kv_data[0]["general.architecture"]
  if hint is not None:
    w.add_string(f"{arch}.model_hint", hint)
  count = len(tensors) if layer_count == "tensors" else layer_count
  if count is not None:
    (w.add_int32 if signed else w.add_uint32)(f"{arch}.layer_count", count)
  for name, array in tensors:
    w.add_tensor(name, array)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
