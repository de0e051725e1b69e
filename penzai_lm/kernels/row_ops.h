// Vectorized passes over one row of a vocabulary, for the sampler
// (sampler.cc): max, min, sum of exps, log-sum-exp, first argmax, softmax
// and entropy, masked sums, and a float order for bisections.

#ifndef PENZAI_LM_KERNELS_ROW_OPS_H_
#define PENZAI_LM_KERNELS_ROW_OPS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common.h"

namespace pzlm {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// exp(x) for x <= 0, and 0 for -inf (masked entries).
inline V16 ExpOrZero(V16 x) {
  return x == kNegInf ? V16{} : ExpNonPositive(x);
}

inline float Max(const float* x, int64_t n) {
  V16 m = V16{} + kNegInf;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    V16 v = Load(x + i);
    m = v > m ? v : m;
  }
  float out = kNegInf;
  for (int j = 0; j < 16; ++j) out = std::max(out, m[j]);
  for (; i < n; ++i) out = std::max(out, x[i]);
  return out;
}

inline float Min(const float* x, int64_t n) {
  V16 m = V16{} + kInf;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    V16 v = Load(x + i);
    m = v < m ? v : m;
  }
  float out = kInf;
  for (int j = 0; j < 16; ++j) out = std::min(out, m[j]);
  for (; i < n; ++i) out = std::min(out, x[i]);
  return out;
}

// sum(exp(x - m)), -inf terms 0; m >= max(x) and finite.
inline float SumExp(const float* x, int64_t n, float m) {
  V16 s{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) s += ExpOrZero(Load(x + i) - m);
  float out = Sum(s);
  for (; i < n; ++i) out += x[i] == kNegInf ? 0.f : std::exp(x[i] - m);
  return out;
}

// log(sum(exp(x))); -inf when every entry is -inf.
inline float LogSumExp(const float* x, int64_t n) {
  const float m = Max(x, n);
  if (!(m > kNegInf) || m == kInf) return m;
  return m + std::log(SumExp(x, n, m));
}

// The first index of the maximum.
inline int64_t ArgmaxFirst(const float* x, int64_t n) {
  const float m = Max(x, n);
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == m) return i;
  return 0;
}

// q = softmax(y) (0 for -inf); returns its entropy. lse: y's normaliser.
inline float ProbsAndEntropy(const float* y, int64_t V, float lse, float* q) {
  V16 h{};
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    V16 v = Load(y + i);
    V16 lp = v == kNegInf ? V16{} : v - lse;
    V16 e = ExpOrZero(v == kNegInf ? v : lp);
    Store(q + i, e);
    h -= e * lp;
  }
  float out = Sum(h);
  for (; i < V; ++i) {
    const float lp = y[i] == kNegInf ? 0.f : y[i] - lse;
    q[i] = y[i] == kNegInf ? 0.f : std::exp(lp);
    out -= q[i] * lp;
  }
  return out;
}

// The total of q over the entries whose score is at most t.
inline float MassUpTo(const float* score, const float* q, int64_t V, float t) {
  V16 m{};
  int64_t i = 0;
  for (; i + 16 <= V; i += 16)
    m += Load(score + i) <= t ? Load(q + i) : V16{};
  float out = Sum(m);
  for (; i < V; ++i) out += score[i] <= t ? q[i] : 0.f;
  return out;
}

// Float order as unsigned order (filters.sortable / unsortable).
inline uint32_t Sortable(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u >> 31 ? ~u : u | 0x80000000u;
}

inline float Unsortable(uint32_t k) {
  const uint32_t u = k >> 31 ? k & 0x7fffffffu : ~k;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The total of q over the entries of x above t.
inline float MassAbove(const float* x, const float* q, int64_t V, float t) {
  V16 m{};
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) m += Load(x + i) > t ? Load(q + i) : V16{};
  float out = Sum(m);
  for (; i < V; ++i) out += x[i] > t ? q[i] : 0.f;
  return out;
}

}  // namespace pzlm

#endif  // PENZAI_LM_KERNELS_ROW_OPS_H_
