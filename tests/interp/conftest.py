"""Shared helpers for the control-vector tests."""

import numpy as np

from penzai_lm.interp import ControlVector

HIDDEN = 8


def vec(seed, size=HIDDEN):
  return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def make_cv(blocks=(1, 2, 5), hint="llama", size=HIDDEN):
  return ControlVector(
      directions={b: vec(b, size) for b in blocks}, model_hint=hint
  )
