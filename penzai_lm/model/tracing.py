"""Whether JAX is tracing: what decides between eager and traced paths.

`top_level()` is True where no JAX transformation is tracing (outside
``jax.jit``, ``grad``, ``vmap`` ...). A model call inside ``jax.jit`` may
have only concrete inputs (closed-over ones), so the inputs alone cannot
tell.
"""

from __future__ import annotations

try:
  from jax._src.core import trace_state_clean as _trace_state_clean  # pylint: disable=g-import-not-at-top
except ImportError:  # A JAX without it: callers look at their inputs only.
  def _trace_state_clean() -> bool:
    return True


def top_level() -> bool:
  """Whether no JAX trace is active."""
  return _trace_state_clean()
