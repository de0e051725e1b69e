"""llama.cpp's block types, decoded into the layouts the kernels read.

Every llama.cpp type this module knows is, per group of 16 or 32 values
along K, small integers times a scale plus an offset: ``w = q * d + m``
(``m`` zero for the symmetric types). `decode` reads those integers and the
per-group ``d`` and ``m`` (as float32: the products of a float16 super-block
scale and a 4-8 bit sub-block scale are exact in float32) out of a tensor's
raw blocks, and `to_layout` packs them into one of the kernels' layouts
(`penzai_lm.quantization.formats`):

=========================  ==============  =================================
llama.cpp type             layout          why it is exact
=========================  ==============  =================================
Q8_0, Q5_0                 ``q8_0``        int8 values, a scale per 32
Q4_0                       ``q4_0``        nibbles, ``m = -8 d``
Q4_1, Q4_K                 ``q4_1``        nibbles, a scale and min per 32
Q5_1, Q2_K, Q3_K, Q5_K,    ``q8_16``       int8 values, a scale and offset
Q6_K (and mixes)                           per 16
=========================  ==============  =================================

Each layout computes ``q * d + m`` in float32 with one rounding, as ggml's
and gguf-py's dequantizers do (``d * q - dm``), so a kept weight
dequantizes to the float weights `penzai_lm.load` reads from the same file,
bit for bit (tests/quantization/test_gguf_blocks.py checks every type
against gguf-py on random blocks). The decoders follow gguf-py's
(``gguf.quants``), which follow ggml's ``dequantize_row_*``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from penzai_lm.quantization.formats import QuantizedWeight

QK_K = 256
# llama.cpp type -> the smallest layout that holds it exactly.
LAYOUT_OF = {
    "Q8_0": "q8_0", "Q5_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1",
    "Q4_K": "q4_1", "Q5_1": "q8_16", "Q2_K": "q8_16", "Q3_K": "q8_16",
    "Q5_K": "q8_16", "Q6_K": "q8_16",
}
KEPT_TYPES = tuple(LAYOUT_OF)


@dataclasses.dataclass(frozen=True)
class Groups:
  """A tensor's values as ``q * d + m`` per group along K (numpy, host).

  Attributes:
    q: int8 ``[N, K]`` (every type's integers fit: -32..31 at most).
    d: float32 ``[N, K // group]``.
    m: float32 ``[N, K // group]``, or None where it is zero.
    group: 16 or 32.
  """

  q: np.ndarray
  d: np.ndarray
  m: np.ndarray | None
  group: int


def _f16(raw: np.ndarray) -> np.ndarray:
  """The little-endian float16 at each row's 2 bytes, as float32 ``[B]``."""
  out = np.ascontiguousarray(raw).view(np.float16).astype(np.float32)
  return out[..., 0] if out.shape[-1] == 1 else out


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
  """ggml's nibble order: of each ``span // 2`` bytes, the low nibbles are
  values 0..span/2-1 and the high nibbles the next span/2."""
  qs = qs.reshape(*qs.shape[:-1], -1, span // 2)
  return np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(
      *qs.shape[:-2], -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
  """Bit i of a block's little-endian ``qh`` bytes, for i < count."""
  bits = np.unpackbits(qh, axis=-1, bitorder="little")
  return bits[..., :count]


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
  d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
  sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
  mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return sc.astype(np.float32), mn.astype(np.float32)


# Each decoder takes B blocks (uint8 [B, block bytes]) and returns
# (q [B, values], d [B, groups], m [B, groups] or None, group size).


def _q8_0(b):
  return b[:, 2:].view(np.int8), _f16(b[:, 0:2])[:, None], None, 32


def _q4_0(b):
  return (_nibbles(b[:, 2:], 32).astype(np.int8) - 8,
          _f16(b[:, 0:2])[:, None], None, 32)


def _q4_1(b):
  return (_nibbles(b[:, 4:], 32).astype(np.int8), _f16(b[:, 0:2])[:, None],
          _f16(b[:, 2:4])[:, None], 32)


def _five_bits(b, start):
  """Q5_0/Q5_1 values: 32 high bits at ``start``, then the nibbles."""
  high = _high_bits(b[:, start:start + 4], 32)
  return (_nibbles(b[:, start + 4:], 32) | (high << 4)).astype(np.int8)


def _q5_0(b):
  return _five_bits(b, 2) - 16, _f16(b[:, 0:2])[:, None], None, 32


def _q5_1(b):
  return (_five_bits(b, 4), _f16(b[:, 0:2])[:, None],
          _f16(b[:, 2:4])[:, None], 32)


def _q4_k(b):
  d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
  sc, mn = _k_scales(b[:, 4:16])
  return _nibbles(b[:, 16:], 64).astype(np.int8), d * sc, -(dmin * mn), 32


def _q5_k(b):
  d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
  sc, mn = _k_scales(b[:, 4:16])
  # Bit j of high byte l is the fifth bit of value l of sub-block j.
  high = _high_bits(b[:, 16:48], 8 * 32).reshape(-1, 32, 8)
  high = high.transpose(0, 2, 1).reshape(-1, QK_K)
  q = _nibbles(b[:, 48:], 64) | (high << 4)
  return q.astype(np.int8), d * sc, -(dmin * mn), 32


def _crumbs(qs):
  """2-bit fields: of each 32 bytes, the 4 shifts give 4 runs of 32."""
  q = qs.reshape(-1, qs.shape[1] // 32, 1, 32) >> np.array(
      [0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
  return (q & 3).reshape(qs.shape[0], -1)


def _q6_k(b):
  low = _nibbles(b[:, 0:128], 128)  # halves of 128: 64 low, 64 high nibbles
  q = (low | (_crumbs(b[:, 128:192]) << 4)).astype(np.int8) - 32
  scales = b[:, 192:208].view(np.int8).astype(np.float32)
  return q, _f16(b[:, 208:210])[:, None] * scales, None, 16


def _q2_k(b):
  scales = b[:, 0:16]
  d, dmin = _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
  return (_crumbs(b[:, 16:80]).astype(np.int8),
          d * (scales & 0xF).astype(np.float32),
          -(dmin * (scales >> 4).astype(np.float32)), 16)


def _q3_k(b):
  hmask, packed = b[:, 0:32], b[:, 96:108]
  # 16 six-bit scales: low nibbles in bytes 0-7, high crumbs in 8-11.
  low = (packed[:, 0:8, None] >> np.array([0, 4], np.uint8)).transpose(
      0, 2, 1).reshape(-1, 16)
  high = (packed[:, 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)
          ).transpose(0, 2, 1).reshape(-1, 16)
  sc = ((low & 0x0F) | ((high & 3) << 4)).astype(np.int8) - 32
  # A value's third bit is in hmask; a clear bit means -4.
  qh = (hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8
                                              ).reshape(1, 8, 1)) & 1
  q = (_crumbs(b[:, 32:96]).astype(np.int8)
       - ((qh.reshape(-1, QK_K) ^ 1) << 2).astype(np.int8))
  return q, _f16(b[:, 108:110])[:, None] * sc.astype(np.float32), None, 16


_DECODERS = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0,
    "Q5_1": _q5_1, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k,
    "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def block_shape(kind: str) -> tuple[int, int]:
  """``(values, bytes)`` of one block of a kept type."""
  import gguf  # pylint: disable=g-import-not-at-top

  return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]


def decode(raw: np.ndarray, kind: str, k: int) -> Groups:
  """The groups of a ``[N, row_bytes]`` uint8 array of ``kind`` blocks.

  Args:
    raw: Each row's blocks, as stored (K values per row).
    kind: A llama.cpp type name in `KEPT_TYPES`.
    k: Values per row.
  """
  values, nbytes = block_shape(kind)
  n = raw.shape[0]
  if k % values or raw.shape[1] != k // values * nbytes:
    raise ValueError(f"{kind} rows of {k} values take {k // values * nbytes}"
                     f" bytes in blocks of {values}; got {raw.shape[1]}.")
  blocks = np.ascontiguousarray(raw).reshape(-1, nbytes)
  if kind not in _DECODERS:
    raise ValueError(f"no decoder for llama.cpp type {kind}; kept types:"
                     f" {', '.join(KEPT_TYPES)}.")
  q, d, m, group = _DECODERS[kind](blocks)
  return Groups(q=np.ascontiguousarray(q).reshape(n, k),
                d=np.ascontiguousarray(d, np.float32).reshape(n, -1),
                m=None if m is None else np.ascontiguousarray(
                    m, np.float32).reshape(n, -1),
                group=group)


def to_layout(g: Groups, layout: str) -> QuantizedWeight:
  """``g`` in ``layout`` ("q8_0", "q4_0", "q4_1" or "q8_16"), exactly, as
  host (numpy) arrays.

  Raises:
    ValueError: where the layout cannot hold ``g`` exactly.
  """
  n, k = g.q.shape
  if layout == "q8_16":
    repeat = g.group // 16
    d = np.repeat(g.d, repeat, axis=1)
    m = np.zeros_like(d) if g.m is None else np.repeat(g.m, repeat, axis=1)
    return QuantizedWeight(g.q, d, m, "q8_16")
  if g.group != 32:
    raise ValueError(f"{layout} has groups of 32; these are {g.group}.")
  if layout == "q8_0":
    if g.m is not None:
      raise ValueError("q8_0 has no offsets; use q8_16.")
    return QuantizedWeight(g.q, g.d, None, "q8_0")
  if layout not in ("q4_0", "q4_1"):
    raise ValueError(f"unknown layout {layout!r}")
  if layout == "q4_0" and g.m is not None:
    raise ValueError("q4_0's offsets are -8 times its scales; these blocks"
                     " have offsets of their own: use q4_1.")
  q, m = g.q, g.m
  if m is None:  # Symmetric values in -8..7: nibbles q + 8, offset -8 d.
    q, m = q + 8, -8 * g.d
  if q.min(initial=0) < 0 or q.max(initial=0) > 15:
    raise ValueError(f"{layout} holds values 0..15; these reach"
                     f" {q.min()}..{q.max()}.")
  q = q.astype(np.uint8).reshape(n, k // 32, 32)
  packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
  return QuantizedWeight(packed, g.d, m.astype(np.float32), layout)


def common_layout(kinds) -> str:
  """The smallest layout that holds every type of ``kinds`` exactly (the
  layers of one layer stack share one layout)."""
  layouts = {LAYOUT_OF[k] for k in kinds}
  if len(layouts) == 1:
    return layouts.pop()
  if layouts <= {"q4_0", "q4_1"}:
    return "q4_1"
  return "q8_16"
