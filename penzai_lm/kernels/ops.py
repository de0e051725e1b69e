"""JAX entry points of the CPU kernels (`matvec.cc`, `attention.cc`, ...).

The products take activations ``x: f32[R, K]`` and return ``f32[R, N]``;
R is small (decoding: one row per sequence). `decode_attention` attends one
query per row over a KV cache, `prompt_attention` every token of a prompt. They are XLA custom calls on CPU only:
callers check `available()` and fall back to XLA's own ops.
"""

from __future__ import annotations

import ctypes
import functools

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


def _require_kernels() -> None:
  if cpu_kernels() is None:
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")


def _call(target: str, n: int, x, *weights):
  _require_kernels()
  out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
  return jax.ffi.ffi_call(target, out)(x.astype(jnp.float32), *weights)


def dense(x: jax.Array, w: jax.Array, *, out_major: bool) -> jax.Array:
  """``x @ w`` (in-major ``w: [K, N]``) or ``x @ w.T`` (out-major
  ``w: [N, K]``), for float32, bfloat16 or float16 ``w``, in float32.

  bfloat16 rows against out-major bfloat16 weights (a bfloat16 model's
  decode) take both as they are: with AVX-512 BF16 the products are
  ``vdpbf16ps`` dot products of bfloat16 pairs into float32 lanes.
  """
  if (out_major and jnp.dtype(w.dtype) == jnp.bfloat16
      and jnp.dtype(x.dtype) == jnp.bfloat16):
    _require_kernels()
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("pzlm_matvec_out_bf16_rows", out)(x, w)
  kind = _DENSE[jnp.dtype(w.dtype)]
  n = w.shape[0] if out_major else w.shape[1]
  side = "out" if out_major else "in"
  return _call(f"pzlm_matvec_{side}_{kind}", n, x, w)


def q8(x: jax.Array, qs: jax.Array, scale: jax.Array, *,
       int8_activations: bool = False) -> jax.Array:
  """``x @ w.T`` with ``w[n, k] = qs[n, k] * scale[n, k // block]``
  (``qs: int8[N, K]``, ``scale: f32[N, K // block]``).

  With ``int8_activations`` (`matvec_x8.cc`), each row of ``x`` is first
  quantized to int8 blocks of 32 with a float16 scale (llama.cpp's q8_0,
  `quantize_rows`) and the products are integer dot products (VNNI where
  the CPU has it; see `int8_dot_isa`): it needs ``K % 32 == 0`` and blocks
  of 32 or one scale per output. The result is the product of the rounded
  activations ``q * d`` with ``w``: each activation is off by at most
  ``0.5625 / 127`` of its block's largest magnitude (half a step, and the
  scale's float16 rounding). A block holding a NaN or an infinity makes its
  row's outputs NaN.

  Raises:
    ValueError: If ``int8_activations`` is set for a shape it does not
      cover.
  """
  if int8_activations:
    k = qs.shape[1]
    if k % 32 or scale.shape[1] not in (1, k // 32):
      raise ValueError(
          f"q8 with int8_activations needs K % 32 == 0 and blocks of 32 or"
          f" one scale per output; got K={k}, scale {scale.shape}. Call it"
          " with int8_activations=False.")
    return _call("pzlm_matvec_q8_x8", qs.shape[0], x, qs, scale)
  return _call("pzlm_matvec_q8", qs.shape[0], x, qs, scale)


def q8_16(x: jax.Array, qs: jax.Array, scale: jax.Array,
          mins: jax.Array, *, int8_activations: bool = False) -> jax.Array:
  """``x @ w.T`` with ``w[n, k] = qs[n, k] * scale[n, k // 16]
  + mins[n, k // 16]`` (``qs: int8[N, K]``, ``scale`` and ``mins``:
  ``f32[N, K // 16]``).

  With ``int8_activations`` (``K % 32 == 0``) the activations are
  quantized as in `q8`, and the offsets multiply each group's sum of the
  rounded ``x``.

  Raises:
    ValueError: If ``int8_activations`` is set and ``K % 32 != 0``.
  """
  if int8_activations:
    if qs.shape[1] % 32:
      raise ValueError(
          f"q8_16 with int8_activations needs K % 32 == 0; got"
          f" K={qs.shape[1]}. Call it with int8_activations=False.")
    return _call("pzlm_matvec_q8_16_x8", qs.shape[0], x, qs, scale, mins)
  return _call("pzlm_matvec_q8_16", qs.shape[0], x, qs, scale, mins)


def q4(x: jax.Array, qs: jax.Array, scale: jax.Array,
       mins: jax.Array | None, *, int8_activations: bool = False
       ) -> jax.Array:
  """``x @ w.T`` with 4-bit blocks of 32 along K (``qs: uint8[N, K // 2]``
  in ggml's nibble order, ``scale`` and ``mins``: ``f32[N, K // 32]``).

  ``mins=None`` is Q4_0, whose offsets are ``-8 * scale``: the kernels
  derive them and read no ``mins`` array (20 bytes a block of 32 weights
  instead of 24).

  With ``int8_activations`` the nibbles are dotted in integers with ``x``
  quantized as in `q8`, and the offsets multiply each block's sum of the
  rounded ``x``: the result is the float product of the rounded
  activations with ``w``, as for `q8`.
  """
  if mins is None:
    target = "pzlm_matvec_q4_0_x8" if int8_activations else "pzlm_matvec_q4_0"
    return _call(target, qs.shape[0], x, qs, scale)
  target = "pzlm_matvec_q4_x8" if int8_activations else "pzlm_matvec_q4"
  return _call(target, qs.shape[0], x, qs, scale, mins)


def dequantize(qs: jax.Array, scale: jax.Array,
               mins: jax.Array | None) -> jax.Array:
  """A quantized weight as ``f32[N, K]`` (`dequantize.cc`), the values
  `penzai_lm.quantization.formats.dequantize` gives (``q * scale + min``
  as one fused multiply-add, which XLA fuses for the 4-bit layouts too),
  written by the kernels: ``qs: int8[N, K]`` with
  ``scale: f32[N, K // block]`` (and ``mins: f32[N, K // 16]``: groups of
  16 with offsets), or 4-bit ``qs: uint8[N, K // 2]`` with ``scale`` and
  ``mins: f32[N, K // 32]``.

  Raises:
    ValueError: For 4-bit ``qs`` without ``mins``.
  """
  _require_kernels()
  n, packed = qs.shape
  four_bit = jnp.dtype(qs.dtype) == jnp.uint8
  if four_bit and mins is None:
    raise ValueError("dequantize: 4-bit qs (uint8) need their mins"
                     " (f32[N, K // 32]); pass the layer's mins array.")
  k = 2 * packed if four_bit else packed
  if four_bit:
    target, args = "pzlm_dequantize_q4", (qs, scale, mins)
  elif mins is not None:
    target, args = "pzlm_dequantize_q8_16", (qs, scale, mins)
  else:
    target, args = "pzlm_dequantize_q8", (qs, scale)
  out = jax.ShapeDtypeStruct((n, k), jnp.float32)
  return jax.ffi.ffi_call(target, out)(*args)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The int8 blocks the ``int8_activations`` products use, in numpy.

  Args:
    x: ``f32[R, K]``, ``K % 32 == 0``.

  Returns:
    ``(q, d)``: ``int8[R, K]`` and ``f32[R, K // 32]`` with
    ``x ~= q * d`` per block of 32, as llama.cpp's ``quantize_row_q8_0``
    makes them: ``q = rint(x * (1 / (max|x| / 127)))`` in float32 (0 where
    the block is all zeros), and ``d = max|x| / 127`` rounded to float16.
  """
  x = np.asarray(x, np.float32)
  rows, k = x.shape
  blocks = x.reshape(rows, k // 32, 32)
  d = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
  with np.errstate(divide="ignore"):
    inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
  q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
  return q.reshape(rows, k), d.astype(np.float16).astype(np.float32)


def int8_dot_isa() -> str:
  """The instructions the ``int8_activations`` products use in this build:
  ``avx512vnni``, ``avx512bw``, ``avxvnni``, ``avx2`` or ``portable``
  (`int8_dot.h`)."""
  _require_kernels()
  isa = ctypes.CFUNCTYPE(ctypes.c_char_p)(("pzlm_int8_dot_isa", cpu_kernels()))
  return isa().decode()


@functools.cache
def int8_gemm_isa() -> str:
  """Where the ``int8_activations`` products of ``GEMM_ROWS`` rows or more
  run: ``amx`` (Intel AMX tiles, `gemm_x8.cc`: the build has them and
  Linux let this process use them), else ``none`` (they run as smaller
  products do, `int8_dot_isa`)."""
  _require_kernels()
  isa = ctypes.CFUNCTYPE(ctypes.c_char_p)(("pzlm_int8_gemm_isa", cpu_kernels()))
  return isa().decode()


@functools.cache
def q4_float_tiles() -> bool:
  """Whether this build's Q4_0 and Q4_1 products with float activations on
  tiles of 16 outputs (`tiles.float_product`, `matvec_q4_tiles.cc`) run in
  AVX-512 vectors, a tile's 16 outputs in one: there the quantized models
  hold those weights in tiles (`penzai_lm.quantization.quantize`);
  elsewhere in rows (matvec.cc)."""
  _require_kernels()
  isa = ctypes.CFUNCTYPE(ctypes.c_char_p)(("pzlm_q4_tiles_isa",
                                           cpu_kernels()))
  return isa().decode() == "avx512"


@functools.cache
def float_gemm() -> bool:
  """Whether this build's float GEMM for prompts on Q4_0 and Q4_1 tiles
  (`tiles.float_gemm`, `gemm_float.cc`) runs in AVX-512 vectors: there the
  quantized layers put those prompts' products on it; elsewhere (a plain
  loop, correct but slow) they stay on XLA's GEMM."""
  _require_kernels()
  isa = ctypes.CFUNCTYPE(ctypes.c_char_p)(("pzlm_float_gemm_isa",
                                           cpu_kernels()))
  return isa().decode() == "avx512"


def int8_tile_prompts() -> bool:
  """Whether prompts with ``int8_activations`` (more rows than a decode
  step, without AMX) run on a weight's tiles of 16 outputs (`tiles.product`):
  where the int8 dots have VNNI (`int8_dot_isa`). Without it a
  ``vpmaddubsw`` + ``vpmaddwd`` pair takes a step of products, and on an
  AVX2-only CPU the tiles ran prompts slower than XLA's float GEMM on the
  dequantized weight, where they stay (docs/cpu-speed.md)."""
  return int8_dot_isa() in ("avx512vnni", "avxvnni")


# Rows from which the int8-activation products run on the AMX tiles
# (gemm_x8.h's kGemmRows).
GEMM_ROWS = 17


def rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """``table[ids]`` for a ``[V, E]`` table and int32 ids of any shape
  (negative ids wrap, others clamp), read in place (`rows.cc`)."""
  _require_kernels()
  out = jax.ShapeDtypeStruct((*ids.shape, table.shape[1]), table.dtype)
  return jax.ffi.ffi_call("pzlm_rows", out)(table, ids.astype(jnp.int32))


def split(x: jax.Array) -> list[jax.Array]:
  """``[x[i] for i in range(len(x))]`` in one call (`rows.cc`): XLA:CPU
  compiles each slice at a constant offset as a kernel of its own."""
  _require_kernels()
  if x.ndim == 0:
    raise ValueError("split needs an array with a leading axis to split.")
  if x.shape[0] == 0:
    return []
  part = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return list(jax.ffi.ffi_call("pzlm_split", [part] * x.shape[0])(x))


def after(ready: jax.Array, value: jax.Array) -> jax.Array:
  """A copy of ``value`` made once ``ready`` is computed (`rows.cc`).

  XLA sees no reason to wait: what is computed from the result (e.g. a
  weight dequantized from ``value``, a scale) then waits for ``ready`` too.
  Keep ``value`` small: it is copied.
  """
  _require_kernels()
  return jax.ffi.ffi_call("pzlm_after", jax.ShapeDtypeStruct(
      value.shape, value.dtype))(ready, value)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     k_new: jax.Array, v_new: jax.Array, end: jax.Array,
                     q_pos: jax.Array, kv_pos: jax.Array, window: jax.Array,
                     softcap: float | None
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Writes one new key and value per row into the caches at slot ``end``,
  then attends each row's query over its cache (`attention.cc`).

  Args:
    q: ``f32[R, G, Q, D]``: R rows, G key/value heads, Q query heads each.
    k: ``[R, G, L, D]`` key cache (float32, bfloat16 or float16), or any
      reshape of it.
    v: ``[R, G, D, L]`` value cache, the dtype of ``k``, or any reshape.
    k_new: ``[R, G, D]``, the new keys (any reshape).
    v_new: ``[R, G, D]``, the new values (any reshape).
    end: ``int32`` scalar, the slot written (``0 <= end < L``).
    q_pos: ``int32[R]``, each query's position.
    kv_pos: ``int32[R, L]``, each slot's position (-1: empty or padding),
      the new slot's included.
    window: ``int32`` scalar: slots at distance >= window are not attended.
    softcap: Scores become ``cap * tanh(score / cap)``; None for none.

  Returns:
    ``(out, k, v)``: ``f32[R, G, Q, D]`` (zeros for a row with no slot to
    attend) and the written caches, shaped as given. The caches are the
    kernel's outputs aliased to its inputs, so XLA writes them in place.
  """
  if cpu_kernels() is None:
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  kind = _DENSE[jnp.dtype(k.dtype)]
  # The caches go in with their size-1 dimensions dropped (the kernel reads
  # them by element count), as XLA's loop carries them: a reshape between
  # a cache's in-place write and its read made XLA copy every cache at
  # every step (35% of a SmolLM2 int8 decode step went to memmove).
  kc, vc = (jnp.reshape(c, [n for n in c.shape if n != 1]) for c in (k, v))
  out = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
         jax.ShapeDtypeStruct(kc.shape, k.dtype),
         jax.ShapeDtypeStruct(vc.shape, k.dtype))
  heads, kc, vc = jax.ffi.ffi_call(
      f"pzlm_decode_attention_{kind}", out,
      input_output_aliases={1: 1, 2: 2})(
          q.astype(jnp.float32), kc, vc.astype(k.dtype),
          k_new.astype(k.dtype), v_new.astype(k.dtype),
          jnp.reshape(end, (1,)).astype(jnp.int32),
          q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32),
          jnp.reshape(window, (1,)).astype(jnp.int32),
          softcap=np.float32(softcap or 0.0))
  return heads, kc.reshape(k.shape), vc.reshape(v.shape)


def prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     q_pos: jax.Array, kv_pos: jax.Array, window: jax.Array,
                     softcap: float | None) -> jax.Array:
  """Attends every prompt token's queries over its row's cache
  (`prompt_attention.cc`); the prompt's keys and values are already in it.

  Args:
    q: ``f32[R, T, G, Q, D]``: R rows of T tokens, G key/value heads, Q
      query heads each.
    k: ``[R, G, L, D]`` key cache (float32, bfloat16 or float16), or any
      reshape of it.
    v: ``[R, G, D, L]`` value cache, the dtype of ``k``, or any reshape.
    q_pos: ``int32[R, T]``, each query's position (-1: padding).
    kv_pos: ``int32[R, L]``, each slot's position (-1: empty or padding).
    window: ``int32`` scalar: slots at distance >= window are not attended.
    softcap: Scores become ``cap * tanh(score / cap)``; None for none.

  Returns:
    ``f32[R, T, G, Q, D]``; zeros for a token with no slot to attend.
  """
  if cpu_kernels() is None:
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  kind = _DENSE[jnp.dtype(k.dtype)]
  return jax.ffi.ffi_call(
      f"pzlm_prompt_attention_{kind}",
      jax.ShapeDtypeStruct(q.shape, jnp.float32))(
          q.astype(jnp.float32), k, v.astype(k.dtype),
          q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32),
          jnp.reshape(window, (1,)).astype(jnp.int32),
          softcap=np.float32(softcap or 0.0))


@functools.cache
def kernel_sample_params() -> tuple[str, ...]:
  """The names of the per-row parameters the built sampling kernel reads,
  in its order (`sampler.cc`'s ``PZLM_SAMPLE_PARAMS``, as its
  ``pzlm_sample_params`` returns them)."""
  lib = cpu_kernels()
  if lib is None:
    raise RuntimeError("penzai_lm's CPU kernels are not available here;"
                       " check ops.available() before calling them.")
  names = ctypes.CFUNCTYPE(ctypes.c_char_p)(("pzlm_sample_params", lib))()
  return tuple(n for n in (names or b"").decode().split(",") if n)


def sample(logits: jax.Array, params: jax.Array, top_k: jax.Array,
           counts: jax.Array, seen: jax.Array, bias: jax.Array | None,
           banned: jax.Array | None, noise: jax.Array, coin: jax.Array, *,
           param_names: tuple[str, ...], num: int,
           chunk: int) -> tuple[jax.Array, jax.Array]:
  """`penzai_lm.sampling.sample_next`'s choice in one call (`sampler.cc`).

  Call it through ``sample_next(..., kernel=True)``, which builds these
  arguments from the settings and calls it only when the kernel
  implements every setting.

  Args:
    logits: ``f32[B, V]`` raw logits.
    params: ``f32[B, P]`` the rows' settings named by ``param_names``.
    top_k: ``int32[B]`` (0 = off).
    counts: ``int32[B, V]`` generated-token counts (penalties).
    seen: ``bool[B, V]`` prompt-or-generated tokens (penalties).
    bias: ``f32[B, V]`` logit bias, or None.
    banned: ``bool[B, V]`` banned tokens, or None.
    noise: ``f32[B, N]`` Gumbel noise (`penzai_lm.sampling.row_gumbels`).
    coin: ``f32[B]`` uniform draws in [0, 1) (XTC's).
    param_names: Static: the settings in the columns of ``params``, in
      order; they must be the kernel's (`kernel_sample_params`).
    num: Static candidates for top-k / top-p (``<= V``).
    chunk: Static tokens per chunk of the two-level draw.

  Returns:
    ``(token, logprob)``: ``int32[B]`` and ``f32[B]``, the chosen tokens and
    their log-probabilities under the raw logits.

  Raises:
    RuntimeError: If the kernels are unavailable.
    ValueError: If ``param_names`` are not the parameters the kernel reads.
  """
  _require_kernels()
  if tuple(param_names) != kernel_sample_params():
    raise ValueError(
        f"sampler.cc reads the parameters {kernel_sample_params()} but"
        f" {tuple(param_names)} were passed: list the settings the kernel"
        " implements (penzai_lm.sampling.settings.KERNEL_PARAMS, in FIELDS'"
        " order) in sampler.cc's PZLM_SAMPLE_PARAMS, in the same order.")
  batch = logits.shape[0]
  if params.shape != (batch, len(param_names)):
    raise ValueError(f"params has shape {params.shape}, expected"
                     f" {(batch, len(param_names))}.")
  bias = (jnp.zeros((batch, 0), jnp.float32) if bias is None
          else bias.astype(jnp.float32))
  bans = jnp.zeros((batch, 0), bool) if banned is None else banned
  out = (jax.ShapeDtypeStruct((batch,), jnp.int32),
         jax.ShapeDtypeStruct((batch,), jnp.float32))
  return jax.ffi.ffi_call("pzlm_sample", out)(
      logits.astype(jnp.float32), params.astype(jnp.float32),
      jnp.asarray(top_k, jnp.int32), counts.astype(jnp.int32),
      seen.astype(bool), bias, bans.astype(bool), noise.astype(jnp.float32),
      jnp.asarray(coin, jnp.float32),
      num=np.int64(num), chunk=np.int64(chunk))
