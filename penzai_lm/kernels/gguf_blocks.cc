// GGUF's quantized blocks, as they lie in the file, written out as float32:
// the loader's dequantization of a quantized file into a float model
// (`penzai_lm.kernels.gguf_blocks`, called with ctypes, not from XLA).
//
// Each value is the one gguf-py's `dequantize_blocks` gives, bit for bit:
// the same float32 operations in the same order, each rounded on its own
// (no fused multiply-adds: the pragmas below keep the compiler from
// contracting `d * q + m`). Types (ggml's numbers), a block of 32 values
// unless said otherwise:
//   Q4_0 (2):  d f16, 16 bytes of nibbles     -> d * (q - 8)
//   Q4_1 (3):  d, m f16, 16 bytes of nibbles  -> d * q + m
//   Q5_0 (6):  d f16, high bits u32, nibbles  -> d * (q - 16)
//   Q8_0 (8):  d f16, 32 int8                 -> q * d
//   Q4_K (12): 256 values: d, dmin f16, 12 bytes of 6-bit scales and mins,
//              128 bytes of nibbles           -> (d * sc) * q - dmin * m
//   Q6_K (14): 256 values: 128 bytes of low nibbles, 64 of high 2 bits, 16
//              int8 scales, d f16             -> (d * sc) * (q - 32)
// Nibbles in ggml's order: a block's (or 32-value group's) low nibbles
// first, then its high nibbles.

#pragma STDC FP_CONTRACT OFF

#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

using pzlm::F16ToF32;

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
}

void Q4_0(const uint8_t* b, float* out) {
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    out[j] = d * float(int(qs[j] & 15) - 8);
    out[j + 16] = d * float(int(qs[j] >> 4) - 8);
  }
}

void Q4_1(const uint8_t* b, float* out) {
  const float d = Half(b), m = Half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    const float lo = d * float(qs[j] & 15), hi = d * float(qs[j] >> 4);
    out[j] = lo + m;
    out[j + 16] = hi + m;
  }
}

void Q5_0(const uint8_t* b, float* out) {
  const float d = Half(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    out[j] = d * float(lo - 16);
    out[j + 16] = d * float(hi - 16);
  }
}

void Q8_0(const uint8_t* b, float* out) {
  const float d = Half(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) out[j] = float(qs[j]) * d;
}

// Q4_K's eight 6-bit scales and mins (gguf-py's `get_scale_min`).
void ScalesMins(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[j + 4] & 0x3F;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

void Q4_K(const uint8_t* b, float* out) {
  const float d = Half(b), dmin = Half(b + 2);
  uint8_t sc[8], mn[8];
  ScalesMins(b + 4, sc, mn);
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 4; ++g) {  // 32 bytes: sub-blocks 2g (low), 2g + 1
    const float d0 = d * float(sc[2 * g]), m0 = dmin * float(mn[2 * g]);
    const float d1 = d * float(sc[2 * g + 1]), m1 = dmin * float(mn[2 * g + 1]);
    const uint8_t* q = qs + 32 * g;
    float* o = out + 64 * g;
    for (int i = 0; i < 32; ++i) {
      const float lo = d0 * float(q[i] & 15), hi = d1 * float(q[i] >> 4);
      o[i] = lo - m0;
      o[i + 32] = hi - m1;
    }
  }
}

void Q6_K(const uint8_t* b, float* out) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = Half(b + 208);
  for (int g = 0; g < 2; ++g) {  // 128 values: 64 bytes of ql, 32 of qh
    const uint8_t* ql = b + 64 * g;
    const uint8_t* qh = b + 128 + 32 * g;
    for (int k = 0; k < 4; ++k) {  // values 32k..32k+31 of the half
      const uint8_t* l = ql + 32 * (k & 1);
      const int shift = 4 * (k >> 1);
      for (int h = 0; h < 2; ++h) {  // 16 values a scale
        const float ds = d * float(scales[8 * g + 2 * k + h]);
        float* o = out + 128 * g + 32 * k + 16 * h;
        for (int i = 0; i < 16; ++i) {
          const int j = 16 * h + i;
          const int q = ((l[j] >> shift) & 15) | (((qh[j] >> (2 * k)) & 3) << 4);
          o[i] = ds * float(q - 32);
        }
      }
    }
  }
}

struct Format {
  int type, values, bytes;
  void (*decode)(const uint8_t*, float*);
};

constexpr Format kFormats[] = {
    {2, 32, 18, Q4_0}, {3, 32, 20, Q4_1}, {6, 32, 22, Q5_0},
    {8, 32, 34, Q8_0}, {12, 256, 144, Q4_K}, {14, 256, 210, Q6_K},
};

}  // namespace

// Writes the float32 values of `n_bytes` of blocks of ggml type `type` to
// `out` (`n_values` floats). Returns 0, -1 for a type it does not decode,
// -2 when the sizes are not whole blocks of that type.
extern "C" int pzlm_gguf_dequantize(int type, const uint8_t* blocks,
                                    int64_t n_bytes, float* out,
                                    int64_t n_values) {
  for (const Format& f : kFormats) {
    if (f.type != type) continue;
    if (n_bytes % f.bytes || n_bytes / f.bytes * f.values != n_values)
      return -2;
    for (int64_t i = 0, n = n_bytes / f.bytes; i < n; ++i)
      f.decode(blocks + i * f.bytes, out + i * f.values);
    return 0;
  }
  return -1;
}
