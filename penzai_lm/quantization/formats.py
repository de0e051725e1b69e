"""Weight formats: quantizers and dequantizers, as llama.cpp defines them.

A quantized weight is out-major: ``N`` outputs by ``K`` contracted values,
quantized in blocks along K (`QuantizedWeight`). The formats:

* ``"int8"``: weight-only int8 with one float32 scale per output channel
  (``w = q * scale``, symmetric, ``scale = max|w| / 127``).
* ``"q8_0"``: llama.cpp's Q8_0: blocks of 32, ``w = q * d`` (int8 ``q``,
  ``d = max|w| / 127`` rounded to float16).
* ``"q4_0"``: Q4_0: blocks of 32, ``w = (q - 8) * d`` (``q`` in 0..15,
  ``d = max / -8`` of the value of largest magnitude, float16).
* ``"q4_1"``: Q4_1: blocks of 32, ``w = q * d + m`` (``m`` the block's
  minimum, ``d = (max - min) / 15``, both float16).

One more layout has no quantizer: ``"q8_16"``, int8 values in groups of 16
with a float32 scale and offset each (``w = q * d + m``), which holds every
other llama.cpp type exactly (K-quants, Q5_1; `gguf_blocks`), for
``load(..., quantize="keep")``.

4-bit values are two per byte in ggml's order (byte j of a block holds value
j in its low nibble and value j + 16 in its high nibble), and kept as
``scale`` and ``mins`` with ``w = q * scale + mins``. Q4_0's ``mins`` is
``-8 d`` by definition: wherever a ``q4_0`` weight is used (`dequantize`,
the CPU kernels) its offsets are derived from ``scale`` and the ``mins``
array is not read. The quantizers follow ggml's
reference code (``quantize_row_*_ref``: round half away from zero, the same
clamps), so quantizing a weight that was dequantized from a GGUF block of
the same format gives back that block's integers and scales exactly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "q8_0", "q4_0", "q4_1")
# What a `QuantizedWeight` can hold: the quantizers' formats and the kept
# layout. 8-bit layouts store qs int8 [N, K]; 4-bit ones two values a byte.
LAYOUTS = (*FORMATS, "q8_16")
FOUR_BIT = ("q4_0", "q4_1")
BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """An out-major quantized ``[N, K]`` weight.

  Attributes:
    qs: int8 ``[N, K]`` (8-bit formats) or uint8 ``[N, K // 2]`` (4-bit).
    scale: float32 ``[N, K // block]``.
    mins: float32 ``[N, K // block]`` (4-bit formats and ``q8_16``), else
      None. For ``q4_0`` it is ``-8 * scale`` and never read.
    format: One of `LAYOUTS`.
  """

  qs: jax.Array
  scale: jax.Array
  mins: jax.Array | None
  format: str = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, int]:
    n, packed = self.qs.shape
    return n, packed * 2 if self.format in FOUR_BIT else packed

  @property
  def nbytes(self) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize
               for x in (self.qs, self.scale, self.mins) if x is not None)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The ``[N, K]`` weight in ``dtype`` (traceable)."""
    return dequantize(self.qs, self.scale, self.mins, self.format, dtype)


def dequantize(qs, scale, mins, format: str, dtype=jnp.float32):  # pylint: disable=redefined-builtin
  """The ``[N, K]`` weight of a format's arrays, in ``dtype``."""
  n = qs.shape[0]
  if format in FOUR_BIT:
    blocks = qs.reshape(n, -1, BLOCK // 2)
    q = jnp.concatenate([blocks & 15, blocks >> 4], axis=-1)
  else:
    q = qs.reshape(n, scale.shape[1], -1)
  w = q.astype(jnp.float32) * scale[..., None]
  if format == "q4_0":  # its offsets are -8 scales, whatever mins holds
    mins = scale * -8
  if mins is not None:
    w = w + mins[..., None]
  return w.reshape(n, -1).astype(dtype)


def _round_away(x, xp=np):
  """C's ``roundf``: halves away from zero (numpy's round is to even)."""
  return xp.copysign(xp.floor(xp.abs(x) + 0.5), x)


def _f16(x):
  return x.astype(np.float16).astype(np.float32)


def _inverse(d, xp=np):
  with np.errstate(divide="ignore"):
    return xp.where(d != 0, np.float32(1) / d, np.float32(0)).astype(
        np.float32)


def on_accelerator(w) -> bool:
  """Whether ``w`` is a JAX array on a device other than the CPU."""
  return isinstance(w, jax.Array) and any(
      d.platform != "cpu" for d in w.devices())


def quantize(w, format: str) -> QuantizedWeight:  # pylint: disable=redefined-builtin
  """Quantizes an out-major ``[N, K]`` float weight.

  A numpy weight (or one on the CPU) is quantized with numpy on the host,
  a few million values at a time, which bounds its temporaries (a whole
  table's would be several times its float32 size). A weight on a GPU is
  quantized there, in one compiled program with the same formulas (far
  faster than numpy on the host for a large model); its results stay on
  that device.

  Raises:
    ValueError: for an unknown format, or a block format whose K is not a
      multiple of 32.
  """
  if format not in FORMATS:
    raise ValueError(f"unknown weight format {format!r}; choose one of"
                     f" {FORMATS}.")
  n, k = w.shape
  if format != "int8" and k % BLOCK:
    raise ValueError(f"{format} quantizes blocks of {BLOCK} contracted"
                     f" values, and this weight contracts {k}; use"
                     " quantize='int8' (one scale per output) instead.")
  if on_accelerator(w):
    return QuantizedWeight(*_quantize_on_device(w, format), format)
  step = max(1, _CHUNK // max(k, 1))
  chunks = [_quantize_rows(np.asarray(w[i:i + step], np.float32), format)
            for i in range(0, max(n, 1), step)]
  qs, scale, mins = (None if chunks[0][j] is None else
                     np.concatenate([c[j] for c in chunks])
                     for j in range(3))
  return QuantizedWeight(jnp.asarray(qs), jnp.asarray(scale),
                         None if mins is None else jnp.asarray(mins), format)


@functools.partial(jax.jit, static_argnums=1)
def _quantize_on_device(w, format):  # pylint: disable=redefined-builtin
  return _quantize_rows(w.astype(jnp.float32), format, jnp)


_CHUNK = 1 << 22  # Values quantized at a time.


def _quantize_rows(w, format: str, xp=np):  # pylint: disable=redefined-builtin
  """``(qs, scale, mins or None)`` of float32 rows ``w``, computed with
  ``xp`` (numpy, or jax.numpy under `jax.jit`)."""
  n, k = w.shape
  if format == "int8":
    d = xp.abs(w).max(axis=1, keepdims=True, initial=0) / np.float32(127)
    return _round_away(w * _inverse(d, xp), xp).astype(np.int8), d, None
  x = w.reshape(n, k // BLOCK, BLOCK)
  if format == "q8_0":
    d = xp.abs(x).max(axis=-1, initial=0) / np.float32(127)
    q = _round_away(x * _inverse(d, xp)[..., None], xp)
    return q.reshape(n, k).astype(np.int8), _f16(d), None
  if format == "q4_0":
    index = xp.abs(x).argmax(axis=-1)[..., None]
    d = xp.take_along_axis(x, index, axis=-1)[..., 0] / np.float32(-8)
    q = xp.minimum(15, xp.trunc(x * _inverse(d, xp)[..., None]
                                + np.float32(8.5)))
    d = _f16(d)
    mins = -8 * d
  else:  # q4_1
    low, high = x.min(axis=-1), x.max(axis=-1)
    d = (high - low) / np.float32(15)
    q = xp.minimum(15, xp.trunc(
        (x - low[..., None]) * _inverse(d, xp)[..., None] + np.float32(0.5)))
    d, mins = _f16(d), _f16(low)
  q = q.astype(np.uint8)
  packed = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
  return (packed.reshape(n, k // 2), d.astype(np.float32),
          mins.astype(np.float32))
