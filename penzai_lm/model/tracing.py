"""Whether JAX is tracing: what decides between eager and traced paths.

`top_level()` is True where no JAX transformation is tracing (outside
``jax.jit``, ``grad``, ``vmap`` ...). A model call inside ``jax.jit`` may
have only concrete inputs (closed-over ones), so the inputs alone cannot
tell. `full` makes the model's constant arrays (empty caches, positions,
norm epsilons) on whichever path is running.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

try:
  from jax._src.core import trace_state_clean as _trace_state_clean  # pylint: disable=g-import-not-at-top
except ImportError:  # A JAX without it: callers look at their inputs only.
  def _trace_state_clean() -> bool:
    return True


def top_level() -> bool:
  """Whether no JAX trace is active."""
  return _trace_state_clean()


def full(shape: tuple[int, ...], fill, dtype) -> jax.Array:
  """An array of ``fill`` (a Python or numpy scalar), on the default device.

  On CPU, outside a trace, it is made by numpy and placed with device_put:
  eager ``jnp.full`` compiles a program per shape and dtype (10-50 ms each;
  a first request compiled 6 for its caches; docs/design.md). Elsewhere it is
  ``jnp.full``: inside a trace an op of the program rather than a
  constant, and on an accelerator filled there rather than transferred.
  """
  if not top_level() or jax.default_backend() != "cpu":
    return jnp.full(shape, fill, dtype)
  dtype = np.dtype(dtype)
  return jax.device_put(np.zeros(shape, dtype) if fill == 0
                        else np.full(shape, fill, dtype))
