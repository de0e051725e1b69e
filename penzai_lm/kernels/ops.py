"""JAX entry points of the CPU matrix-vector kernels (`matvec.cc`).

Every function takes activations ``x: f32[R, K]`` and returns ``f32[R, N]``;
R is small (decoding: one row per sequence). They are XLA custom calls on
CPU only: callers check `available()` and fall back to XLA's dots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
