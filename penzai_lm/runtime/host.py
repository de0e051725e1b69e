"""Arrays back on the host, from one process or several.

On a mesh spanning several processes (hosts), an array may have shards on
other processes' devices, which ``np.asarray`` refuses to read. `to_host`
gathers such an array from every process (a collective: SPMD host code
reaches it in every process, in the same order) and reads any other
array as ``np.asarray`` does.
"""

from __future__ import annotations

import jax
from jax.experimental import multihost_utils
import numpy as np


def to_host(x) -> np.ndarray:
  """``x`` as a numpy array, gathered from every process if it has shards
  on other processes' devices (see the module docstring)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
