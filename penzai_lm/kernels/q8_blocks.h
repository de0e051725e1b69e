// Activations quantized as llama.cpp's quantize_row_q8_0 quantizes them,
// shared by the int8-activation products (matvec_x8.cc) and the prompt
// GEMM (gemm_x8.cc): per block of 32 values, d = max|x| / 127,
// q = rint(x * (1 / d)) in float32, and d kept as a float16 (block_q8_0.d).

#ifndef PENZAI_LM_KERNELS_Q8_BLOCKS_H_
#define PENZAI_LM_KERNELS_Q8_BLOCKS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"

namespace pzlm {

// v rounded to float16 (to nearest even) and back.
inline float ToHalfAndBack(float v) {
#if defined(__F16C__)
  return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
  return float(_Float16(v));
#endif
}

// One block of 32 values x into q, with the sums of q's two halves in
// half[0..1]; returns d rounded to float16 (NaN if the block holds a NaN or
// an infinity; then q is all zeros).
inline float QuantizeBlock(const float* x, int8_t* q, int32_t* half) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  // x * 0 is NaN exactly where x is a NaN or an infinity.
  const __m512 zero = _mm512_setzero_ps();
  const bool finite = _mm512_cmp_ps_mask(
      _mm512_add_ps(_mm512_mul_ps(a, zero), _mm512_mul_ps(b, zero)), zero,
      _CMP_EQ_OQ) == 0xffff;
  const float amax = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = finite ? amax / 127.f : NAN;
  const __m512 inv = _mm512_set1_ps(finite && amax > 0.f ? 1.f / d : 0.f);
  // Rounded to nearest even (MXCSR's default), as nearbyint; |x| * (1 /
  // d) <= 127 up to a rounding, which the saturating narrowing clamps.
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                   _mm512_cvtsepi32_epi8(qb));
  half[0] = _mm512_reduce_add_epi32(qa);
  half[1] = _mm512_reduce_add_epi32(qb);
#else
  float amax = 0.f;
  bool finite = true;
  for (int j = 0; j < 32; ++j) {
    finite = finite && std::isfinite(x[j]);
    amax = std::max(amax, std::fabs(x[j]));
  }
  const float d = finite ? amax / 127.f : NAN;
  const float inv = finite && amax > 0.f ? 1.f / d : 0.f;
  half[0] = half[1] = 0;
  for (int j = 0; j < 32; ++j) {
    float v = std::nearbyint(x[j] * inv);
    q[j] = int8_t(std::min(127.f, std::max(-127.f, v)));
    half[j / 16] += q[j];
  }
#endif
  return ToHalfAndBack(d);
}

}  // namespace pzlm

#endif  // PENZAI_LM_KERNELS_Q8_BLOCKS_H_
