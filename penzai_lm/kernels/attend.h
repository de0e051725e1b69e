// Attention over a cache's slots for one query position: the part shared
// by the decode kernel (attention.cc: one new token per row) and the prompt
// kernel (prompt_attention.cc: every prompt token of a row). Conventions
// as in attention.cc.

#ifndef PENZAI_LM_KERNELS_ATTEND_H_
#define PENZAI_LM_KERNELS_ATTEND_H_

#include <cmath>
#include <limits>

#include "common.h"

namespace pzlm {
namespace attend {

constexpr int64_t kChunk = 128;  // slots per task
constexpr int64_t kMaxQ = 32;    // query heads per group (accumulators)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// cap * tanh(x / cap), through exp(-2|x / cap|).
inline V16 SoftCap(V16 x, float cap) {
  V16 a = x / cap;
  V16 abs = a < 0.f ? -a : a;
  V16 e = ExpNonPositive(-2.f * abs);
  V16 t = (1.f - e) / (1.f + e);
  return (a < 0.f ? -t : t) * cap;
}

struct Shape {
  int64_t R, G, Q, D, L;
};

inline bool Attended(int32_t p, int32_t q_pos, int32_t window) {
  return p >= 0 && p <= q_pos && int64_t(q_pos) - p < window;
}

// One task: slots [lo, hi) (at most kChunk) of one row and group. Writes
// the scores' maximum m[Q], the softmax numerators' sum[Q] and the
// unnormalized output part[Q, D]; s is scratch for Q x kChunk scores.
// kQ > 0 fixes Q (= sh.Q) at compile time, so that the query heads'
// accumulators stay in registers: with Q known only at run time they went
// through the stack, a store and a load around every multiply-add (a third
// of the kernel's time in perf, SmolLM2's Q = 3).
template <typename T, int kQ>
void PartialQ(const Shape& sh, const float* q, const T* k, const T* v,
              const int32_t* kv_pos, int32_t q_pos, int32_t window,
              float softcap, int64_t lo, int64_t hi, float* s, float* m,
              float* sum, float* part) {
  constexpr int kAcc = kQ > 0 ? kQ : kMaxQ;
  const int64_t Q = kQ > 0 ? kQ : sh.Q, D = sh.D, n = hi - lo;
  // Scores: each key is read once and used by every query head.
  for (int64_t l = lo; l < hi; ++l) {
    float* sl = s + (l - lo);
    if (!Attended(kv_pos[l], q_pos, window)) {
      for (int64_t h = 0; h < Q; ++h) sl[h * kChunk] = kNegInf;
      continue;
    }
    const T* key = k + l * D;
    // The keys of one chunk are a short run the hardware prefetchers do
    // not follow in time: ask for the row 4 slots ahead.
    if (l + 4 < hi)
      for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(key + 4 * D + d);
    V16 acc[kAcc];
    for (int64_t h = 0; h < Q; ++h) acc[h] = V16{};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      V16 kv = Cvt16(key + d);
      for (int64_t h = 0; h < Q; ++h) acc[h] += Load(q + h * D + d) * kv;
    }
    for (int64_t h = 0; h < Q; ++h) {
      float t = Sum(acc[h]);
      for (int64_t j = d; j < D; ++j) t += q[h * D + j] * ToF32(key[j]);
      sl[h * kChunk] = t;
    }
  }
  // Softmax numerators, in place of the scores (0 where not attended).
  for (int64_t h = 0; h < Q; ++h) {
    float* sh_row = s + h * kChunk;
    if (softcap > 0.f) {
      int64_t l = 0;
      for (; l + 16 <= n; l += 16) {
        V16 x = Load(sh_row + l);
        Store(sh_row + l, x > kNegInf ? SoftCap(x, softcap) : x);
      }
      for (; l < n; ++l)
        if (sh_row[l] > kNegInf)
          sh_row[l] = softcap * std::tanh(sh_row[l] / softcap);
    }
    float mx = kNegInf;
    for (int64_t l = 0; l < n; ++l) mx = std::max(mx, sh_row[l]);
    m[h] = mx;
    if (mx == kNegInf) {  // nothing attended in this chunk
      sum[h] = 0.f;
      for (int64_t l = 0; l < n; ++l) sh_row[l] = 0.f;
      continue;
    }
    V16 total{};
    int64_t l = 0;
    for (; l + 16 <= n; l += 16) {
      V16 x = Load(sh_row + l);
      V16 e = ExpNonPositive(x - mx);
      e = x > kNegInf ? e : V16{};
      Store(sh_row + l, e);
      total += e;
    }
    float t = Sum(total);
    for (; l < n; ++l) {
      float e = sh_row[l] > kNegInf ? std::exp(sh_row[l] - mx) : 0.f;
      sh_row[l] = e;
      t += e;
    }
    sum[h] = t;
  }
  // Values: each row of V (one feature, slots contiguous) is read once.
  for (int64_t d = 0; d < D; ++d) {
    const T* vr = v + d * sh.L;
    const bool ahead = d + 1 < D;  // the next feature's run, prefetched
    V16 acc[kAcc];
    for (int64_t h = 0; h < Q; ++h) acc[h] = V16{};
    int64_t l = lo;
    for (; l + 16 <= hi; l += 16) {
      if (ahead) __builtin_prefetch(vr + sh.L + l);
      V16 vv = Cvt16(vr + l);
      for (int64_t h = 0; h < Q; ++h)
        acc[h] += Load(s + h * kChunk + (l - lo)) * vv;
    }
    for (int64_t h = 0; h < Q; ++h) {
      float t = Sum(acc[h]);
      for (int64_t j = l; j < hi; ++j)
        t += s[h * kChunk + (j - lo)] * ToF32(vr[j]);
      part[h * D + d] = t;
    }
  }
}

// `PartialQ` for any Q: fixed for 1 to 8 query heads a group (the
// families' 1 to 8), else at run time.
template <typename T>
void Partial(const Shape& sh, const float* q, const T* k, const T* v,
             const int32_t* kv_pos, int32_t q_pos, int32_t window,
             float softcap, int64_t lo, int64_t hi, float* s, float* m,
             float* sum, float* part) {
  switch (sh.Q) {
#define PZLM_PARTIAL_Q(N)                                                  \
  case N:                                                                 \
    return PartialQ<T, N>(sh, q, k, v, kv_pos, q_pos, window, softcap, lo, \
                          hi, s, m, sum, part);
    PZLM_PARTIAL_Q(1) PZLM_PARTIAL_Q(2) PZLM_PARTIAL_Q(3) PZLM_PARTIAL_Q(4)
    PZLM_PARTIAL_Q(5) PZLM_PARTIAL_Q(6) PZLM_PARTIAL_Q(7) PZLM_PARTIAL_Q(8)
#undef PZLM_PARTIAL_Q
    default:
      return PartialQ<T, 0>(sh, q, k, v, kv_pos, q_pos, window, softcap, lo,
                            hi, s, m, sum, part);
  }
}

}  // namespace attend
}  // namespace pzlm

#endif  // PENZAI_LM_KERNELS_ATTEND_H_
