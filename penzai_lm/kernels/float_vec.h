// The float products' 16-float vector, VF (matvec.cc), with loads that
// decode weights into it.

#ifndef PENZAI_LM_KERNELS_FLOAT_VEC_H_
#define PENZAI_LM_KERNELS_FLOAT_VEC_H_

#include "common.h"

namespace pzlm {

// The products' 16-float vector, VF. With AVX-512 it is GCC's 64-byte
// vector, one register. With AVX2 only, GCC has no machine mode for a
// 64-byte vector: it kept the accumulators in memory and moved them
// through general registers on every FMA (an AVX2-only EPYC: SmolLM2's f32
// products took 35 ms a step at 1 row and 300 ms at 8, where XLA took 22
// and 69). There VF is two 8-float vectors, which GCC keeps in registers.
#if defined(__AVX2__) && !defined(__AVX512F__)
typedef float V8 __attribute__((vector_size(32)));
struct VF { V8 lo, hi; };
inline VF operator+(VF a, VF b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline VF operator*(VF a, VF b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline VF& operator+=(VF& a, VF b) {
  a.lo += b.lo;
  a.hi += b.hi;
  return a;
}
inline VF Splat(float s) {
  V8 v = (V8)_mm256_set1_ps(s);
  return {v, v};
}
inline VF LoadF(const float* p) { return {LoadAs<V8>(p), LoadAs<V8>(p + 8)}; }
inline V8 Bf16x8(const uint16_t* p) {
  return (V8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline VF LoadF(const uint16_t* p) { return {Bf16x8(p), Bf16x8(p + 8)}; }
inline VF LoadF(const Half* h) {
#if defined(__F16C__)
  const __m128i* p = reinterpret_cast<const __m128i*>(h);
  return {(V8)_mm256_cvtph_ps(_mm_loadu_si128(p)),
          (V8)_mm256_cvtph_ps(_mm_loadu_si128(p + 1))};
#else
  float t[16];
  for (int j = 0; j < 16; ++j) t[j] = F16ToF32(h[j].bits);
  return LoadF(t);
#endif
}
inline V8 S8x8(const int8_t* p) {
  return (V8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline VF LoadS8(const int8_t* p) { return {S8x8(p), S8x8(p + 8)}; }
inline VF LoadU8(U8x16 b) {
  __m128i v = (__m128i)b;
  return {(V8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
          (V8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))};
}
inline void StoreF(float* p, VF v) {
  std::memcpy(p, &v.lo, 32);
  std::memcpy(p + 8, &v.hi, 32);
}
inline float SumF(VF v) {
  V8 t = v.lo + v.hi;
  float s = 0;
  for (int j = 0; j < 8; ++j) s += t[j];
  return s;
}
#else
using VF = V16;
// A broadcast (V16{} + s adds 0, an instruction per splat, for -0.0).
inline VF Splat(float s) {
#if defined(__AVX512F__)
  return (VF)_mm512_set1_ps(s);
#else
  VF v;
  for (int j = 0; j < 16; ++j) v[j] = s;
  return v;
#endif
}
template <typename T>
inline VF LoadF(const T* p) { return Cvt16(p); }
inline VF LoadS8(const int8_t* p) { return CvtS8(p); }
inline VF LoadU8(U8x16 b) { return CvtU8(b); }
inline void StoreF(float* p, VF v) { Store(p, v); }
inline float SumF(VF v) { return Sum(v); }
#endif

}  // namespace pzlm

#endif  // PENZAI_LM_KERNELS_FLOAT_VEC_H_
