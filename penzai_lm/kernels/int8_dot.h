// Dot products of int8 activations with int8 or 4-bit weights, one "step"
// of 64 values (two blocks of 32) at a time, for matvec_x8.cc. The
// instructions are chosen at compile time (the library is built per
// machine with -march=native):
//   __AVX512VNNI__ + __AVX512BW__: vpdpbusd on 64 bytes;
//   __AVX512BW__:                  vpmaddubsw + vpmaddwd on 64 bytes;
//   __AVX2__:                      the same on two halves of 32 bytes;
//   otherwise:                     scalar loops.
// Every path gives the same integers in the same lanes: lane j (0..15) of
// a step's result is the sum of the products of its bytes 4j .. 4j + 3, so
// lanes 0-7 belong to the step's first block and 8-15 to its second.
// vpdpbusd multiplies unsigned by signed bytes: int8 weights are used as
// |w| with w's sign moved onto the activation (llama.cpp's trick; the
// activations are quantized to [-127, 127], so negating one never
// overflows). 4-bit weights are unsigned already.

#ifndef PENZAI_LM_KERNELS_INT8_DOT_H_
#define PENZAI_LM_KERNELS_INT8_DOT_H_

#include <cstdint>
#include <cstring>

#include "common.h"

namespace pzlm {
namespace x8 {

#if defined(__AVX512BW__)
// One 64-byte register; 16 float lanes.
struct Bytes { __m512i v; };
struct Floats { __m512 v; };
inline Floats Zero() { return {_mm512_setzero_ps()}; }
inline Floats Fma(Floats a, Floats b, Floats c) {
  return {_mm512_fmadd_ps(a.v, b.v, c.v)};
}
inline Floats Mul(Floats a, Floats b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline float Total(Floats a) { return _mm512_reduce_add_ps(a.v); }
inline Floats LoadFloats(const float* p) { return {_mm512_loadu_ps(p)}; }
// {p[0] x 8, p[1] x 8}: a step's two per-block factors, on its lanes.
inline Floats BlockLanes(const float* p) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1,
                                       0, 0, 0, 0, 0, 0, 0, 0);
  __m128 two = _mm_castsi128_ps(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two))};
}
inline Bytes LoadBytes(const void* p) { return {_mm512_loadu_si512(p)}; }
// |w| and the weights' signs.
struct SignedBytes { __m512i abs; __mmask64 neg; };
inline SignedBytes Split(Bytes w) {
  return {_mm512_abs_epi8(w.v), _mm512_movepi8_mask(w.v)};
}
inline Floats DotUS(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  __m512i d = _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                _mm512_set1_epi16(1));
#endif
  return {_mm512_cvtepi32_ps(d)};
}
// Σ w * x per lane, for int8 weights w and int8 activations x.
inline Floats DotS8(SignedBytes w, Bytes x) {
  __m512i sx = _mm512_mask_sub_epi8(x.v, w.neg, _mm512_setzero_si512(), x.v);
  return DotUS(w.abs, sx);
}
// 32 bytes of 4-bit weights (two ggml blocks of 16 bytes) as 64 values in
// order: byte j of a block holds value j (low nibble) and j + 16 (high).
inline Bytes Nibbles(const uint8_t* p) {
  __m512i b = _mm512_castsi256_si512(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  b = _mm512_shuffle_i64x2(b, b, 0x50);  // 128-bit lanes {0, 0, 1, 1}
  b = _mm512_mask_srli_epi16(b, 0xff00ff00u, b, 4);  // lanes 1, 3: high
  return {_mm512_and_si512(b, _mm512_set1_epi8(15))};
}
inline Floats DotU4(Bytes nib, Bytes x) { return DotUS(nib.v, x.v); }

#elif defined(__AVX2__)
// Two 32-byte registers; 2 x 8 float lanes.
struct Bytes { __m256i lo, hi; };
struct Floats { __m256 lo, hi; };
inline Floats Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Floats Fma(Floats a, Floats b, Floats c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Floats Mul(Floats a, Floats b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
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
inline Floats BlockLanes(const float* p) {
  return {_mm256_set1_ps(p[0]), _mm256_set1_ps(p[1])};
}
inline Bytes LoadBytes(const void* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
struct SignedBytes { Bytes w; };
inline SignedBytes Split(Bytes w) { return {w}; }
inline __m256 DotUS(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  __m256i d = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                _mm256_set1_epi16(1));
#endif
  return _mm256_cvtepi32_ps(d);
}
inline Floats DotS8(SignedBytes w, Bytes x) {
  return {DotUS(_mm256_sign_epi8(w.w.lo, w.w.lo), _mm256_sign_epi8(x.lo, w.w.lo)),
          DotUS(_mm256_sign_epi8(w.w.hi, w.w.hi), _mm256_sign_epi8(x.hi, w.w.hi))};
}
inline __m256i Nibbles16(const uint8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}
inline Bytes Nibbles(const uint8_t* p) { return {Nibbles16(p), Nibbles16(p + 16)}; }
inline Floats DotU4(Bytes nib, Bytes x) {
  return {DotUS(nib.lo, x.lo), DotUS(nib.hi, x.hi)};
}

#else
// Portable: 64 bytes and 16 float lanes in plain arrays.
struct Bytes { int16_t v[64]; };
struct Floats { float v[16]; };
inline Floats Zero() { return Floats{}; }
inline Floats Fma(Floats a, Floats b, Floats c) {
  for (int j = 0; j < 16; ++j) c.v[j] += a.v[j] * b.v[j];
  return c;
}
inline Floats Mul(Floats a, Floats b) {
  for (int j = 0; j < 16; ++j) a.v[j] *= b.v[j];
  return a;
}
inline float Total(Floats a) {
  float s = 0;
  for (int j = 0; j < 16; ++j) s += a.v[j];
  return s;
}
inline Floats LoadFloats(const float* p) {
  Floats f;
  std::memcpy(f.v, p, sizeof(f.v));
  return f;
}
inline Floats BlockLanes(const float* p) {
  Floats f;
  for (int j = 0; j < 16; ++j) f.v[j] = p[j / 8];
  return f;
}
inline Bytes LoadBytes(const void* p) {
  Bytes b;
  for (int j = 0; j < 64; ++j) b.v[j] = static_cast<const int8_t*>(p)[j];
  return b;
}
struct SignedBytes { Bytes w; };
inline SignedBytes Split(Bytes w) { return {w}; }
inline Floats DotBytes(const Bytes& a, const Bytes& b) {
  Floats f;
  for (int j = 0; j < 16; ++j) {
    int32_t s = 0;
    for (int i = 4 * j; i < 4 * j + 4; ++i) s += int32_t(a.v[i]) * b.v[i];
    f.v[j] = float(s);
  }
  return f;
}
inline Floats DotS8(SignedBytes w, Bytes x) { return DotBytes(w.w, x); }
inline Bytes Nibbles(const uint8_t* p) {
  Bytes b;
  for (int blk = 0; blk < 2; ++blk) {
    for (int j = 0; j < 16; ++j) {
      b.v[32 * blk + j] = p[16 * blk + j] & 15;
      b.v[32 * blk + 16 + j] = p[16 * blk + j] >> 4;
    }
  }
  return b;
}
inline Floats DotU4(Bytes nib, Bytes x) { return DotBytes(nib, x); }
#endif

// Which instructions this build uses (ops.int8_dot_isa()).
inline const char* Isa() {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return "avx512vnni";
#elif defined(__AVX512BW__)
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
