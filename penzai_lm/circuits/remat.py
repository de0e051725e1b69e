"""`Rematerialized`: a layer whose backward pass recomputes its forward.

The replacement model's attention keeps a frozen ``[heads, T, T]`` pattern
that its backward pass (the value path) needs. Kept for every block that
is ``L * heads * T^2`` floats (18 GB for SmolLM2 at 4,096 tokens), so each
attention layer is recomputed in the backward pass instead, one block at a
time. `jax.checkpoint` alone is not enough here: its recomputation depends
only on the forward values, so XLA's CPU scheduler runs it during the
forward pass and holds every block's pattern until the backward pass
(measured: 4.6 GB of temporaries at 2,048 tokens, whatever the batch; an
optimization barrier does not survive to scheduling). Here the
recomputation is a custom VJP whose input is tied to the incoming
cotangent by a data dependency (`_after`: plus zero times a finite sum of
the cotangent), so it cannot start before that block's backward step; under
`jax.vmap` (a batch of cotangents) the sum runs over the batch too, so the
recomputation stays unbatched.

Only the layer's input gets a gradient: its weights and side inputs get
zeros (the graph differentiates with respect to deltas, never weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz


def _zeros(tree):
  """Zero cotangents of ``tree``'s leaves (``float0`` for integers)."""
  def zero(leaf):
    dtype = jnp.result_type(leaf)
    if jnp.issubdtype(dtype, jnp.inexact):
      return jnp.zeros_like(leaf)
    return np.zeros(np.shape(leaf), jax.dtypes.float0)
  return jax.tree.map(zero, tree)


def _tie(x, cotangent):
  """``x`` plus zero times a finite sum of ``cotangent`` (exactly ``x``)."""
  total = sum(jnp.sum(leaf.astype(jnp.float32))
              for leaf in jax.tree.leaves(cotangent))
  zero = jnp.where(jnp.isfinite(total), total, 0.0) * 0.0
  return jax.tree.map(lambda a: a + zero.astype(a.dtype), x)


@jax.custom_batching.custom_vmap
def _after(x, cotangent):
  """``x``, once ``cotangent`` exists."""
  return _tie(x, cotangent)


@_after.def_vmap
def _after_vmap(axis_size, in_batched, x, cotangent):
  del axis_size  # The sum covers the batch axis, so x stays as batched.
  return _tie(x, cotangent), in_batched[0]


@jax.custom_vjp
def _call(layer, x, side_inputs):
  return layer(x, **side_inputs)


def _call_fwd(layer, x, side_inputs):
  return layer(x, **side_inputs), (layer, x, side_inputs)


def _call_bwd(residuals, cotangent):
  layer, x, side_inputs = residuals
  x = _after(x, cotangent)
  _, pullback = jax.vjp(lambda v: layer(v, **side_inputs), x)
  (grad_x,) = pullback(cotangent)
  return _zeros(layer), grad_x, _zeros(side_inputs)


_call.defvjp(_call_fwd, _call_bwd)


@pz.pytree_dataclass
class Rematerialized(pz.nn.Layer):
  """Runs ``inner``; its backward pass recomputes ``inner``'s forward once
  the cotangent arrives (module docstring)."""

  inner: pz.nn.Layer

  def __call__(self, x, /, **side_inputs):
    return _call(self.inner, x, side_inputs)
