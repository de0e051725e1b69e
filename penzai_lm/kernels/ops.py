"""JAX entry points of the CPU kernels (`matvec.cc`, `attention.cc`).

The products take activations ``x: f32[R, K]`` and return ``f32[R, N]``;
R is small (decoding: one row per sequence). `decode_attention` attends one
query per row over a KV cache. They are XLA custom calls on CPU only:
callers check `available()` and fall back to XLA's own ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm.kernels.build import cpu_kernels

_DENSE = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16",
          jnp.dtype(jnp.float16): "f16"}


def available() -> bool:
  """Whether the kernels are built and registered in this process."""
  return cpu_kernels() is not None


def dense_dtype_supported(dtype) -> bool:
  return jnp.dtype(dtype) in _DENSE


def _call(target: str, n: int, x, *weights):
  if cpu_kernels() is None:
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
  return jax.ffi.ffi_call(target, out)(x.astype(jnp.float32), *weights)


def dense(x: jax.Array, w: jax.Array, *, out_major: bool) -> jax.Array:
  """``x @ w`` (in-major ``w: [K, N]``) or ``x @ w.T`` (out-major
  ``w: [N, K]``), for float32, bfloat16 or float16 ``w``."""
  kind = _DENSE[jnp.dtype(w.dtype)]
  n = w.shape[0] if out_major else w.shape[1]
  side = "out" if out_major else "in"
  return _call(f"pzlm_matvec_{side}_{kind}", n, x, w)


def q8(x: jax.Array, qs: jax.Array, scale: jax.Array) -> jax.Array:
  """``x @ w.T`` with ``w[n, k] = qs[n, k] * scale[n, k // block]``
  (``qs: int8[N, K]``, ``scale: f32[N, K // block]``)."""
  return _call("pzlm_matvec_q8", qs.shape[0], x, qs, scale)


def q4(x: jax.Array, qs: jax.Array, scale: jax.Array,
       mins: jax.Array) -> jax.Array:
  """``x @ w.T`` with 4-bit blocks of 32 along K (``qs: uint8[N, K // 2]``
  in ggml's nibble order, ``scale`` and ``mins``: ``f32[N, K // 32]``)."""
  return _call("pzlm_matvec_q4", qs.shape[0], x, qs, scale, mins)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     q_pos: jax.Array, kv_pos: jax.Array, window: jax.Array,
                     softcap: float | None) -> jax.Array:
  """Attention of one query per row over a KV cache (`attention.cc`).

  Args:
    q: ``f32[R, G, Q, D]``: R rows, G key/value heads, Q query heads each.
    k: ``[R, G, L, D]`` key cache (float32, bfloat16 or float16), or any
      reshape of it.
    v: ``[R, G, D, L]`` value cache, the dtype of ``k``, or any reshape.
    q_pos: ``int32[R]``, each query's position.
    kv_pos: ``int32[R, L]``, each slot's position (-1: empty or padding).
    window: ``int32`` scalar: slots at distance >= window are not attended.
    softcap: Scores become ``cap * tanh(score / cap)``; None for none.

  Returns:
    ``f32[R, G, Q, D]``; zeros for a row with no slot to attend.
  """
  if cpu_kernels() is None:
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  kind = _DENSE[jnp.dtype(k.dtype)]
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  # The caches go in with their size-1 dimensions dropped (the kernel reads
  # them by element count), as `write_at` writes them: a reshape between
  # the in-place write and this call makes XLA copy every cache at every
  # step (35% of a SmolLM2 int8 decode step went to memmove).
  k, v = (jnp.reshape(c, [n for n in c.shape if n != 1]) for c in (k, v))
  return jax.ffi.ffi_call(f"pzlm_decode_attention_{kind}", out)(
      q.astype(jnp.float32), k, v.astype(k.dtype),
      q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32),
      jnp.reshape(window, (1,)).astype(jnp.int32),
      softcap=np.float32(softcap or 0.0))
