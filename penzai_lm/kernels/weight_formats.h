// The weight formats the float products read (matvec.cc). Each
// gives, for an out-major output n, a Row, and
//   Get(row, k, v):  v[0 .. kStep / 16) = weights [k, k + kStep) as floats
//   At(row, k):      one weight (the tail of K past the last whole step)
//   Scale(row):      a factor for the output's sum (a per-channel scale)
//   Prefetch(row, ahead, k): the weights `ahead` outputs further on.
// Decoding happens in registers, right before the FMAs that use it: a
// weight is read once per pass and never written back as floats.
//
// Layouts (out-major, blockwise along K):
//   Dense<T>:  T[N, K] (float, bfloat16 as uint16_t, float16 as Half)
//   q8:        qs s8[N, K], w = qs * scale[n, k / block]
//   q8_16:     qs s8[N, K], w = qs * scale[n, k / 16] + min[n, k / 16]
//   q4:        qs u8[N, K / 2], w = nibble * scale[n, k / 32] + min[n, k / 32]
//              (ggml's order: byte j of each 32-value block holds value j
//              in its low nibble and value j + 16 in its high nibble);
//   q4_0:      the same with min = -8 * scale, not read from memory.

#ifndef PENZAI_LM_KERNELS_WEIGHT_FORMATS_H_
#define PENZAI_LM_KERNELS_WEIGHT_FORMATS_H_

#include <type_traits>

#include "common.h"
#include "float_vec.h"

namespace pzlm {

template <typename T>
struct Dense {
  static constexpr int kStep = 16;
  const T* w;
  int64_t K;
  using Row = const T*;
  Row row(int64_t n) const { return w + n * K; }
  void Prefetch(Row r, int64_t ahead, int64_t k) const {
    __builtin_prefetch(r + ahead * K + k);
  }
  void Get(Row r, int64_t k, VF* v) const { v[0] = LoadF(r + k); }
  float At(Row r, int64_t k) const { return ToF32(r[k]); }
  float Scale(Row) const { return 1.f; }
};

// The int8 formats' arrays: qs [N, K], and scales.
struct Q8Arrays {
  const int8_t* qs;
  const float* scale;
  int64_t K;
  template <typename Row>
  void Prefetch(const Row& r, int64_t ahead, int64_t k) const {
    __builtin_prefetch(r.q + ahead * K + k);
  }
};

// int8 with one scale per output (block == K): the scale multiplies the sum.
struct Q8Channel : Q8Arrays {
  static constexpr int kStep = 16;
  struct Row { const int8_t* q; float d; };
  Row row(int64_t n) const { return {qs + n * K, scale[n]}; }
  void Get(Row r, int64_t k, VF* v) const {
    v[0] = LoadS8(r.q + k);
  }
  float At(Row r, int64_t k) const { return float(r.q[k]); }
  float Scale(Row r) const { return r.d; }
};

// Q8_0: blocks of 32, one scale each.
struct Q8Block32 : Q8Arrays {
  static constexpr int kStep = 32;
  struct Row { const int8_t* q; const float* s; };
  Row row(int64_t n) const { return {qs + n * K, scale + n * (K / 32)}; }
  void Get(Row r, int64_t k, VF* v) const {
    VF d = Splat(r.s[k / 32]);
    v[0] = LoadS8(r.q + k) * d;
    v[1] = LoadS8(r.q + k + 16) * d;
  }
  float At(Row r, int64_t k) const { return r.q[k] * r.s[k / 32]; }
  float Scale(Row) const { return 1.f; }
};

// int8 blocks of any other size (correct, not tuned: the quantizers make
// blocks of 32 or of all of K).
struct Q8Any : Q8Arrays {
  static constexpr int kStep = 16;
  int64_t block;
  struct Row { const int8_t* q; const float* s; };
  Row row(int64_t n) const { return {qs + n * K, scale + n * (K / block)}; }
  void Get(Row r, int64_t k, VF* v) const {
    float t[16];
    for (int j = 0; j < 16; ++j) t[j] = At(r, k + j);
    v[0] = LoadF(t);
  }
  float At(Row r, int64_t k) const { return r.q[k] * r.s[k / block]; }
  float Scale(Row) const { return 1.f; }
};

// int8 groups of 16 with a scale and an offset each (the layout that
// holds llama.cpp's K-quants exactly). K is a multiple of 16.
struct Q8Group16 : Q8Arrays {
  static constexpr int kStep = 16;
  const float* mins;
  struct Row { const int8_t* q; const float* s; const float* m; };
  Row row(int64_t n) const {
    return {qs + n * K, scale + n * (K / 16), mins + n * (K / 16)};
  }
  void Get(Row r, int64_t k, VF* v) const {
    v[0] = LoadS8(r.q + k) * Splat(r.s[k / 16]) + Splat(r.m[k / 16]);
  }
  float At(Row, int64_t) const { return 0.f; }  // K % 16 == 0: no tail
  float Scale(Row) const { return 1.f; }
};

// 4-bit blocks of 32: w = nibble * d + m, ggml's nibble order (byte j holds
// value j low and value j + 16 high). K is a multiple of 32. kCentered:
// Q4_0, whose m is -8 d, derived from the scale (`mins` is never read).
template <bool kCentered>
struct Q4Nibbles {
  static constexpr int kStep = 32;
  const uint8_t* qs;
  const float* scale;
  const float* mins;  // unused (may be null) where kCentered
  int64_t K;
  struct Row { const uint8_t* q; const float* s; const float* m; };
  Row row(int64_t n) const {
    return {qs + n * (K / 2), scale + n * (K / 32),
            kCentered ? nullptr : mins + n * (K / 32)};
  }
  void Prefetch(Row r, int64_t ahead, int64_t k) const {
    __builtin_prefetch(r.q + ahead * (K / 2) + k / 2);
  }
  void Get(Row r, int64_t k, VF* v) const {
    U8x16 b = LoadAs<U8x16>(r.q + k / 2);
    const float s = r.s[k / 32];
    VF d = Splat(s), m = Splat(kCentered ? -8.f * s : r.m[k / 32]);
    v[0] = LoadU8(b & 15) * d + m;
    v[1] = LoadU8(b >> 4) * d + m;
  }
  float At(Row, int64_t) const { return 0.f; }  // K % 32 == 0: no tail
  float Scale(Row) const { return 1.f; }
};
using Q4 = Q4Nibbles<false>;
using Q4Centered = Q4Nibbles<true>;

// Q4_0, Q8_0 (kInt8), Q4_1 (kMins), q8_16 (kInt8 and kMins) and Q5_0
// (kFive) in tiles of 16 outputs (matvec_tiles.cc's layout): output n is
// lane n % 16 of tile n / 16, whose block b (P = 16, 32 or 20 bytes an
// output) holds the output's byte 4 d + i at 16 P b + 64 d + 4 (n % 16) +
// i, and its scale (a float16; Q4_1's and q8_16's float32s, and their
// offsets alike) at 16 b + n % 16 (q8_16: 16 (2 b + g) + n % 16 for group
// g of 16 values). Read one output at a time (the dequantization), not for
// products.
template <bool kInt8, bool kMins = false, bool kFive = false>
struct BlockTiles {
  static constexpr int kStep = 32;
  static constexpr int64_t kBlockBytes = kInt8 ? 512 : kFive ? 320 : 256;
  using S = std::conditional_t<kMins, float, uint16_t>;  // a scale
  const uint8_t* qs;
  const S* scale;
  const float* mins;  // Q4_1's offsets, else unused
  int64_t K;
  struct Row { const uint8_t* q; const S* s; const float* m; };
  static constexpr int64_t kGroups = kInt8 && kMins ? 2 : 1;  // a block
  Row row(int64_t n) const {
    const int64_t t = n / 16, j = n % 16,
                  at = t * (K / 32) * 16 * kGroups + j;
    return {qs + t * (K / 32) * kBlockBytes + 4 * j, scale + at,
            kMins ? mins + at : nullptr};
  }
  void Get(Row r, int64_t k, VF* v) const {
    const int64_t b = k / 32;
    uint8_t bytes[kInt8 ? 32 : kFive ? 20 : 16];
    for (int d = 0; d < int(sizeof(bytes)) / 4; ++d)
      std::memcpy(bytes + 4 * d, r.q + kBlockBytes * b + 64 * d, 4);
    if constexpr (kFive) {  // w = (value - 16) * scale, exactly
      int8_t q[32];
      for (int v = 0; v < 32; ++v)
        q[v] = int8_t(((bytes[v % 16] >> (v < 16 ? 0 : 4)) & 15) |
                      (((bytes[16 + v % 4] >> (v / 4)) & 1) << 4)) - 16;
      const VF d = Splat(F16ToF32(r.s[16 * b]));
      v[0] = LoadS8(q) * d;
      v[1] = LoadS8(q + 16) * d;
      return;
    }
    if constexpr (kInt8 && kMins) {  // q8_16, as Q8Group16
      const int8_t* q = reinterpret_cast<const int8_t*>(bytes);
      v[0] = LoadS8(q) * Splat(r.s[32 * b]) + Splat(r.m[32 * b]);
      v[1] = LoadS8(q + 16) * Splat(r.s[32 * b + 16]) +
             Splat(r.m[32 * b + 16]);
      return;
    }
    float s;
    if constexpr (kMins) s = r.s[16 * b]; else s = F16ToF32(r.s[16 * b]);
    VF d = Splat(s);
    if constexpr (kInt8) {
      v[0] = LoadS8(reinterpret_cast<const int8_t*>(bytes)) * d;
      v[1] = LoadS8(reinterpret_cast<const int8_t*>(bytes) + 16) * d;
    } else {
      const U8x16 q = LoadAs<U8x16>(bytes);
      VF m = Splat(kMins ? r.m[16 * b] : -8.f * s);
      v[0] = LoadU8(q & 15) * d + m;
      v[1] = LoadU8(q >> 4) * d + m;
    }
  }
  float At(Row, int64_t) const { return 0.f; }  // K % 32 == 0: no tail
  float Scale(Row) const { return 1.f; }
};

}  // namespace pzlm

#endif  // PENZAI_LM_KERNELS_WEIGHT_FORMATS_H_
