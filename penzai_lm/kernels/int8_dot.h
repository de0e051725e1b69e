// Integer dot products of 64 bytes at a time, for matvec_x8.cc: int8
// activations against int8 or 4-bit weights. The instructions are chosen
// when the library is built (for the machine it runs on: build.py's
// -march, or the path PENZAI_LM_CPU_ISA forces):
//   __AVX512VNNI__ + __AVX512BW__: vpdpbusd on 64 bytes;
//   __AVX512BW__:                  vpmaddubsw + vpmaddwd on 64 bytes;
//   __AVX2__:                      the same (or AVX-VNNI's vpdpbusd) on two
//                                  halves of 32 bytes;
//   otherwise:                     scalar loops.
// Every path gives the same integers in the same lanes: lane j (0..15) of
// a dot product holds the sum of the products of bytes 4j .. 4j + 3.
//
// vpdpbusd multiplies unsigned by signed bytes. 4-bit weights are unsigned
// already. Signed int8 weights w go in "flipped", w ^ 0x80 = w + 128 as an
// unsigned byte (one instruction), so a dot gives Σ w x + 128 Σ x, and the
// products subtract 128 Σ x, which the activations' quantization counts
// anyway. vpmaddubsw would saturate on 255 * 127 * 2, so the paths without
// VNNI take |w| and move w's sign onto x instead (llama.cpp's trick; x is
// in [-127, 127], so negating it never overflows): `kFlip` says which.

#ifndef PENZAI_LM_KERNELS_INT8_DOT_H_
#define PENZAI_LM_KERNELS_INT8_DOT_H_

#include <cstdint>
#include <cstring>

#include "common.h"

namespace pzlm {
namespace x8 {

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// One 64-byte register; 16 int32 or float lanes.
struct Bytes { __m512i v; };
struct Ints { __m512i v; };
struct Floats { __m512 v; };

#if defined(__AVX512VNNI__)
constexpr bool kFlip = true;
#else
constexpr bool kFlip = false;
#endif

inline Bytes LoadBytes(const void* p) { return {_mm512_loadu_si512(p)}; }
// The first n (< 64) bytes at p, zeros after them; nothing past p + n is
// read.
inline Bytes LoadBytesN(const void* p, int n) {
  return {_mm512_maskz_loadu_epi8((uint64_t(1) << n) - 1, p)};
}
// The 4 bytes at p in every lane.
inline Bytes Broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return {_mm512_set1_epi32(v)};
}
inline Bytes Low4(Bytes b) {
  return {_mm512_and_si512(b.v, _mm512_set1_epi8(15))};
}
inline Bytes High4(Bytes b) {
  return {_mm512_and_si512(_mm512_srli_epi16(b.v, 4), _mm512_set1_epi8(15))};
}
inline Bytes Flip(Bytes b) {
  return {_mm512_xor_si512(b.v, _mm512_set1_epi8(char(0x80)))};
}
// v with bit e of each byte of h as its bit 4 (a 5-bit value's high bit).
inline Bytes WithBit4(Bytes v, Bytes h, int e) {
  const __m512i at4 = e <= 4 ? _mm512_slli_epi32(h.v, 4 - e)
                             : _mm512_srli_epi32(h.v, e - 4);
  return {_mm512_ternarylogic_epi32(v.v, at4, _mm512_set1_epi8(0x10), 0xF8)};
}
inline Ints NoInts() { return {_mm512_setzero_si512()}; }
// acc + Σ u * s per lane (u unsigned, s signed).
inline Ints DotUS(Ints acc, Bytes u, Bytes s) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(
      _mm512_maddubs_epi16(u.v, s.v), _mm512_set1_epi16(1)))};
#endif
}
// acc + Σ w * x per lane for signed w and x (x in [-127, 127]).
inline Ints DotSS(Ints acc, Bytes w, Bytes x) {
  __m512i sx = _mm512_mask_sub_epi8(x.v, _mm512_movepi8_mask(w.v),
                                    _mm512_setzero_si512(), x.v);
  return DotUS(acc, {_mm512_abs_epi8(w.v)}, {sx});
}
inline Floats ToFloats(Ints i) { return {_mm512_cvtepi32_ps(i.v)}; }
inline Floats NoFloats() { return {_mm512_setzero_ps()}; }
inline Floats Fma(Floats a, Floats b, Floats c) {
  return {_mm512_fmadd_ps(a.v, b.v, c.v)};
}
inline Floats Mul(Floats a, Floats b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Floats Add(Floats a, Floats b) { return {_mm512_add_ps(a.v, b.v)}; }
inline float Total(Floats a) { return _mm512_reduce_add_ps(a.v); }
inline Floats Splat(float v) { return {_mm512_set1_ps(v)}; }
// A vector's two halves added (the first step of a lane sum).
inline __m256 Halves(Floats a) {
  return _mm256_add_ps(
      _mm512_castps512_ps256(a.v),
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
}
// The lane sums of 4 vectors at once.
inline void Total4(const Floats* a, float* out) {
  __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(Halves(a[0]), Halves(a[1])),
                            _mm256_hadd_ps(Halves(a[2]), Halves(a[3])));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u),
                                _mm256_extractf128_ps(u, 1)));
}
// One vector's lane sum in Total4's order, so that an output's result does
// not depend on the size of the block it was summed in.
inline float TotalAs4(Floats a) {
  __m256 h = _mm256_hadd_ps(Halves(a), Halves(a));
  h = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h),
                                  _mm256_extractf128_ps(h, 1)));
}
inline Floats LoadFloats(const float* p) { return {_mm512_loadu_ps(p)}; }
// 16 float16 values (their bits) as floats.
inline Floats LoadHalves(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p)))};
}
inline void StoreFloats(float* p, Floats f) { _mm512_storeu_ps(p, f.v); }
inline Floats LoadFloatsN(const float* p, int n) {
  return {_mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p)};
}
// Lanes {p[0] x G, p[1] x G, ...} (G = 16 / count) from count values, of
// which the first n are read (the others are zero).
template <int kCount>
inline Floats Spread(const float* p, int n) {
  static_assert(kCount == 2 || kCount == 4);
  const __m512i idx = kCount == 4
      ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
      : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m128 v;
  if (n == kCount) {
    v = kCount == 4 ? _mm_loadu_ps(p) : _mm_castsi128_ps(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(p)));
  } else {
    v = _mm_maskz_loadu_ps(__mmask8((1u << n) - 1), p);
  }
  return {_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v))};
}

#elif defined(__AVX2__)
// Two 32-byte registers; 2 x 8 lanes.
struct Bytes { __m256i lo, hi; };
struct Ints { __m256i lo, hi; };
struct Floats { __m256 lo, hi; };

#if defined(__AVXVNNI__)
constexpr bool kFlip = true;
#else
constexpr bool kFlip = false;
#endif

inline Bytes LoadBytes(const void* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline Bytes LoadBytesN(const void* p, int n) {
  alignas(32) uint8_t t[64] = {};
  std::memcpy(t, p, n);
  return LoadBytes(t);
}
inline Bytes Broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)};
}
inline Bytes Low4(Bytes b) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(b.lo, m), _mm256_and_si256(b.hi, m)};
}
inline Bytes High4(Bytes b) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), m),
          _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), m)};
}
inline Bytes Flip(Bytes b) {
  const __m256i m = _mm256_set1_epi8(char(0x80));
  return {_mm256_xor_si256(b.lo, m), _mm256_xor_si256(b.hi, m)};
}
inline Bytes WithBit4(Bytes v, Bytes h, int e) {
  const __m256i m = _mm256_set1_epi8(0x10);
  auto at4 = [e, m](__m256i x) {
    return _mm256_and_si256(e <= 4 ? _mm256_slli_epi32(x, 4 - e)
                                   : _mm256_srli_epi32(x, e - 4), m);
  };
  return {_mm256_or_si256(v.lo, at4(h.lo)), _mm256_or_si256(v.hi, at4(h.hi))};
}
inline Ints NoInts() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline __m256i Dot8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}
inline Ints DotUS(Ints acc, Bytes u, Bytes s) {
  return {Dot8(acc.lo, u.lo, s.lo), Dot8(acc.hi, u.hi, s.hi)};
}
inline Ints DotSS(Ints acc, Bytes w, Bytes x) {
  return {Dot8(acc.lo, _mm256_sign_epi8(w.lo, w.lo),
               _mm256_sign_epi8(x.lo, w.lo)),
          Dot8(acc.hi, _mm256_sign_epi8(w.hi, w.hi),
               _mm256_sign_epi8(x.hi, w.hi))};
}
inline Floats ToFloats(Ints i) {
  return {_mm256_cvtepi32_ps(i.lo), _mm256_cvtepi32_ps(i.hi)};
}
inline Floats NoFloats() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Floats Fma(Floats a, Floats b, Floats c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Floats Mul(Floats a, Floats b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
inline Floats Add(Floats a, Floats b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
inline Floats Splat(float v) {
  return {_mm256_set1_ps(v), _mm256_set1_ps(v)};
}
inline float Total(Floats a) {
  __m256 t = _mm256_add_ps(a.lo, a.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Floats LoadFloats(const float* p) {
  return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
inline Floats LoadHalves(const uint16_t* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)),
          _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
inline void StoreFloats(float* p, Floats f) {
  _mm256_storeu_ps(p, f.lo);
  _mm256_storeu_ps(p + 8, f.hi);
}
inline Floats LoadFloatsN(const float* p, int n) {
  alignas(32) float t[16] = {};
  std::memcpy(t, p, n * sizeof(float));
  return LoadFloats(t);
}
template <int kCount>
inline Floats Spread(const float* p, int n) {
  static_assert(kCount == 2 || kCount == 4);
  float v[4] = {};
  std::memcpy(v, p, n * sizeof(float));
  if (kCount == 2) return {_mm256_set1_ps(v[0]), _mm256_set1_ps(v[1])};
  return {_mm256_setr_m128(_mm_set1_ps(v[0]), _mm_set1_ps(v[1])),
          _mm256_setr_m128(_mm_set1_ps(v[2]), _mm_set1_ps(v[3]))};
}

#else
// Portable: 64 bytes and 16 lanes in plain arrays.
struct Bytes { uint8_t v[64]; };
struct Ints { int32_t v[16]; };
struct Floats { float v[16]; };
constexpr bool kFlip = true;

inline Bytes LoadBytes(const void* p) {
  Bytes b;
  std::memcpy(b.v, p, 64);
  return b;
}
inline Bytes LoadBytesN(const void* p, int n) {
  Bytes b = {};
  std::memcpy(b.v, p, n);
  return b;
}
inline Bytes Broadcast4(const void* p) {
  Bytes b;
  for (int j = 0; j < 64; j += 4) std::memcpy(b.v + j, p, 4);
  return b;
}
inline Bytes Low4(Bytes b) {
  for (auto& x : b.v) x &= 15;
  return b;
}
inline Bytes High4(Bytes b) {
  for (auto& x : b.v) x >>= 4;
  return b;
}
inline Bytes Flip(Bytes b) {
  for (auto& x : b.v) x ^= 0x80;
  return b;
}
inline Bytes WithBit4(Bytes v, Bytes h, int e) {
  for (int j = 0; j < 64; ++j) v.v[j] |= ((h.v[j] >> e) & 1) << 4;
  return v;
}
inline Ints NoInts() { return Ints{}; }
inline Ints DotUS(Ints acc, Bytes u, Bytes s) {
  for (int j = 0; j < 64; ++j)
    acc.v[j / 4] += int32_t(u.v[j]) * int32_t(int8_t(s.v[j]));
  return acc;
}
inline Ints DotSS(Ints acc, Bytes w, Bytes x) {
  for (int j = 0; j < 64; ++j)
    acc.v[j / 4] += int32_t(int8_t(w.v[j])) * int32_t(int8_t(x.v[j]));
  return acc;
}
inline Floats ToFloats(Ints i) {
  Floats f;
  for (int j = 0; j < 16; ++j) f.v[j] = float(i.v[j]);
  return f;
}
inline Floats NoFloats() { return Floats{}; }
inline Floats Fma(Floats a, Floats b, Floats c) {
  for (int j = 0; j < 16; ++j) c.v[j] += a.v[j] * b.v[j];
  return c;
}
inline Floats Mul(Floats a, Floats b) {
  for (int j = 0; j < 16; ++j) a.v[j] *= b.v[j];
  return a;
}
inline Floats Add(Floats a, Floats b) {
  for (int j = 0; j < 16; ++j) a.v[j] += b.v[j];
  return a;
}
inline float Total(Floats a) {
  float s = 0;
  for (int j = 0; j < 16; ++j) s += a.v[j];
  return s;
}
inline Floats Splat(float v) {
  Floats f;
  for (auto& x : f.v) x = v;
  return f;
}
inline Floats LoadFloats(const float* p) {
  Floats f;
  std::memcpy(f.v, p, sizeof(f.v));
  return f;
}
inline Floats LoadHalves(const uint16_t* p) {
  Floats f;
  for (int j = 0; j < 16; ++j) f.v[j] = F16ToF32(p[j]);
  return f;
}
inline void StoreFloats(float* p, Floats f) {
  std::memcpy(p, f.v, sizeof(f.v));
}
inline Floats LoadFloatsN(const float* p, int n) {
  Floats f = {};
  std::memcpy(f.v, p, n * sizeof(float));
  return f;
}
template <int kCount>
inline Floats Spread(const float* p, int n) {
  Floats f;
  for (int j = 0; j < 16; ++j) {
    const int i = j / (16 / kCount);
    f.v[j] = i < n ? p[i] : 0.f;
  }
  return f;
}
#endif

// The lane sums of n vectors, each added up in the same order for any n.
template <int n>
inline void Totals(const Floats* a, float* out) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (n == 4) {
    Total4(a, out);
  } else {
    for (int i = 0; i < n; ++i) out[i] = TotalAs4(a[i]);
  }
#else
  for (int i = 0; i < n; ++i) out[i] = Total(a[i]);
#endif
}

// Σ w * x per lane for signed int8 weights: `Signed(w)` once per weight
// step, then `DotSigned` per row of activations. With kFlip the weights go
// in as w + 128 and the caller subtracts 128 Σ x.
inline Bytes Signed(Bytes w) { return kFlip ? Flip(w) : w; }
inline Ints DotSigned(Ints acc, Bytes w, Bytes x) {
  return kFlip ? DotUS(acc, w, x) : DotSS(acc, w, x);
}

// Which instructions this build uses (ops.int8_dot_isa()).
inline const char* Isa() {
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
  return "avx512vnni";
#elif defined(__AVX512BW__) && defined(__AVX512VL__)
  return "avx512bw";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
  return "avxvnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace x8
}  // namespace pzlm

#endif  // PENZAI_LM_KERNELS_INT8_DOT_H_
