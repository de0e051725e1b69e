// Attention of every token of a prompt over a KV cache, for XLA:CPU, called
// through the XLA FFI.
//
// Why this exists: XLA:CPU runs a prompt's attention as the chain of small
// ops penzai's layers make (a YNNPACK dot for the scores, mask and scale,
// a max, exp, sum, divide, a second dot for the values), each a separate
// pass over a [heads, tokens, slots] tensor with its own dispatch. For
// SmolLM2's 128-token prompts that was ~50 ms of a ~250 ms prefill (Q4_0
// with int8 activations), where the arithmetic is ~20 MFLOP per layer.
// Here each (row, key/value head, block of 16 prompt tokens) is one task
// on the kernels' workers: chunks of 128 slots of keys and values are
// transposed into scratch once per block, and every query head of its
// tokens takes its scores as vectors along the slots, a vectorized softmax
// and its output as vectors along the features (no horizontal sums), the
// chunks combined by their maxima as they come (flash attention's online
// softmax).
//
// The prompt's keys and values are already in the caches (XLA writes them,
// as for the chain).
//
// Conventions:
//   q:      f32[R, T, G, Q, D] each row's T prompt tokens' queries (scaled,
//                              rotated): G key/value heads, Q query heads
//                              per group, D per head
//   k:      T[R, G, L, D]      key cache, L slots (any shape of as many
//                              elements)
//   v:      T[R, G, D, L]      value cache, slots last (likewise)
//   q_pos:  s32[R, T]          each query's position (-1: padding)
//   kv_pos: s32[R, L]          each slot's position, -1 where empty
//   window: s32[1]             slots at distance >= window are not attended
//   softcap (attribute)        > 0: scores become cap * tanh(score / cap)
//   out:    f32[R, T, G, Q, D]
// Slot l of row r is attended by token t iff 0 <= kv_pos[r, l] <=
// q_pos[r, t] and q_pos[r, t] - kv_pos[r, l] < window, as in the decode
// kernel. A token with no slot to attend (padding) gets zeros.

#include <cmath>
#include <vector>

#include "attend.h"
#include "common.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary
using namespace pzlm::attend;  // NOLINT: Shape, Attended, kChunk

constexpr int64_t kTokens = 16;  // prompt tokens per task

// Scratch of one task (floats): the chunk's keys transposed [D, kChunk]
// and values [kChunk, Dp], and per query (token x head) its scores
// [kChunk], running maximum and sum, and output [Dp].
inline int64_t ScratchFloats(const Shape& sh) {
  const int64_t Dp = (sh.D + 15) / 16 * 16, nq = kTokens * sh.Q;
  return sh.D * kChunk + kChunk * Dp + nq * (kChunk + 2 + Dp);
}

// Two queries' scores against NV vectors of 16 transposed keys (kt: [D,
// kChunk]): each key vector is loaded once for both, and the 2 x NV
// accumulators (independent FMA chains) stay in registers.
template <int NV>
inline void Scores(const float* q0, const float* q1, const float* kt,
                   int64_t D, float* s0, float* s1) {
  V16 a[NV], b[NV];
  for (int c = 0; c < NV; ++c) a[c] = V16{}, b[c] = V16{};
  for (int64_t d = 0; d < D; ++d) {
    const V16 x = V16{} + q0[d], y = V16{} + q1[d];
    const float* row = kt + d * kChunk;
    for (int c = 0; c < NV; ++c) {
      const V16 w = Load(row + 16 * c);
      a[c] += x * w;
      b[c] += y * w;
    }
  }
  for (int c = 0; c < NV; ++c) {
    Store(s0 + 16 * c, a[c]);
    Store(s1 + 16 * c, b[c]);
  }
}

template <int NV>
inline void ScoresOf(const float* q, int64_t nq, int64_t Q, int64_t G,
                     int64_t D, const float* kt, float* s) {
  for (int64_t i = 0; i < nq; i += 2) {
    // Query i is token i / Q's head i % Q (at (t * G * Q + h) * D); an odd
    // last query is paired with itself.
    const int64_t j = std::min(i + 1, nq - 1);
    Scores<NV>(q + ((i / Q) * G * Q + i % Q) * D,
               q + ((j / Q) * G * Q + j % Q) * D, kt, D, s + i * kChunk,
               s + j * kChunk);
  }
}

// o[0, 16 * ND) = o * old + sum over j < n of p[j] * vt[j, 0, 16 * ND)
// (vt rows Dp apart), the accumulators in registers.
// Two sets of accumulators (even and odd slots): twice the independent
// FMA chains.
template <int ND>
inline void Values(const float* p, const float* vt, int64_t Dp, int64_t n,
                   float old, float* o) {
  V16 x[ND], y[ND];
  for (int c = 0; c < ND; ++c) x[c] = Load(o + 16 * c) * old, y[c] = V16{};
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const V16 w0 = V16{} + p[j], w1 = V16{} + p[j + 1];
    const float* row = vt + j * Dp;
    for (int c = 0; c < ND; ++c) {
      x[c] += w0 * Load(row + 16 * c);
      y[c] += w1 * Load(row + Dp + 16 * c);
    }
  }
  if (j < n) {
    const V16 w = V16{} + p[j];
    for (int c = 0; c < ND; ++c) x[c] += w * Load(vt + j * Dp + 16 * c);
  }
  for (int c = 0; c < ND; ++c) Store(o + 16 * c, x[c] + y[c]);
}

// Tokens [t0, t1) of one row and group: their queries' scores are a
// product of the queries with a chunk of keys transposed into scratch
// (vectors along the slots), their outputs a product of the softmax
// numerators with the chunk's values transposed (vectors along the
// features), the chunks combined by their maxima as they come.
template <typename T>
void AttendTokens(const Shape& sh, int64_t Tn, const float* q, const T* k,
                  const T* v, const int32_t* kv_pos, const int32_t* q_pos,
                  int32_t window, float softcap, int64_t t0, int64_t t1,
                  float* scratch, float* out) {
  const int64_t Q = sh.Q, D = sh.D, L = sh.L, G = sh.G;
  const int64_t Dp = (D + 15) / 16 * 16, nq = (t1 - t0) * Q;
  float* kt = scratch;              // [D, kChunk]
  float* vt = kt + D * kChunk;      // [kChunk, Dp]
  float* s = vt + kChunk * Dp;      // [nq, kChunk]
  float* best = s + nq * kChunk;    // [nq]
  float* total = best + nq;         // [nq]
  float* acc = total + nq;          // [nq, Dp]
  // The slots any of the tokens attends.
  int64_t lo = L, hi = 0;
  for (int64_t t = t0; t < t1; ++t) {
    int64_t a = 0, b = L;
    while (a < L && !Attended(kv_pos[a], q_pos[t], window)) ++a;
    while (b > a && !Attended(kv_pos[b - 1], q_pos[t], window)) --b;
    if (a < b) lo = std::min(lo, a), hi = std::max(hi, b);
  }
  for (int64_t i = 0; i < nq; ++i) best[i] = kNegInf, total[i] = 0.f;
  for (int64_t i = 0; i < nq * Dp; ++i) acc[i] = 0.f;
  for (int64_t a = lo; a < hi; a += kChunk) {
    const int64_t n = std::min(hi - a, kChunk), nv = (n + 15) / 16;
    for (int64_t d = 0; d < D; ++d) {
      float* row = kt + d * kChunk;
      for (int64_t j = 0; j < n; ++j) row[j] = ToF32(k[(a + j) * D + d]);
      for (int64_t j = n; j < nv * 16; ++j) row[j] = 0.f;
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < D; ++d) vt[j * Dp + d] = ToF32(v[d * L + a + j]);
      for (int64_t d = D; d < Dp; ++d) vt[j * Dp + d] = 0.f;
    }
    alignas(64) int32_t pos[kChunk];  // -1 (not attended) past the chunk
    for (int64_t j = 0; j < kChunk; ++j) pos[j] = j < n ? kv_pos[a + j] : -1;
    // Every query's scores first (in pairs), then each one's softmax and
    // values.
    const float* qt = q + t0 * G * Q * D;
    static_assert(kChunk == 128, "ScoresOf<1..8> cover a chunk");
    switch (nv) {
      case 1: ScoresOf<1>(qt, nq, Q, G, D, kt, s); break;
      case 2: ScoresOf<2>(qt, nq, Q, G, D, kt, s); break;
      case 3: ScoresOf<3>(qt, nq, Q, G, D, kt, s); break;
      case 4: ScoresOf<4>(qt, nq, Q, G, D, kt, s); break;
      case 5: ScoresOf<5>(qt, nq, Q, G, D, kt, s); break;
      case 6: ScoresOf<6>(qt, nq, Q, G, D, kt, s); break;
      case 7: ScoresOf<7>(qt, nq, Q, G, D, kt, s); break;
      default: ScoresOf<8>(qt, nq, Q, G, D, kt, s); break;
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t t = t0 + i / Q;
      float* si = s + i * kChunk;
      if (softcap > 0.f) {
        for (int64_t c = 0; c < nv; ++c)
          Store(si + 16 * c, SoftCap(Load(si + 16 * c), softcap));
      }
      // Attended(pos, q_pos, window), 16 slots at a time.
      const I32x16 qp = I32x16{} + q_pos[t], win = I32x16{} + window;
      V16 vmax = V16{} + kNegInf;
      for (int64_t c = 0; c < nv; ++c) {
        const I32x16 p = LoadAs<I32x16>(pos + 16 * c);
        const V16 x = Load(si + 16 * c);
        const V16 y = (p >= 0) & (p <= qp) & (qp - p < win) ? x : kNegInf;
        Store(si + 16 * c, y);
        vmax = vmax > y ? vmax : y;
      }
      float mx = kNegInf;
      for (int l = 0; l < 16; ++l) mx = std::max(mx, vmax[l]);
      if (mx == kNegInf) continue;  // nothing attended in this chunk
      const float m = std::max(best[i], mx);
      const float old = best[i] == kNegInf ? 0.f : std::exp(best[i] - m);
      best[i] = m;
      V16 sum{};
      for (int64_t c = 0; c < nv; ++c) {
        const V16 x = Load(si + 16 * c);
        V16 e = ExpNonPositive(x - m);
        e = x > kNegInf ? e : V16{};
        Store(si + 16 * c, e);
        sum += e;
      }
      total[i] = total[i] * old + Sum(sum);
      float* o = acc + i * Dp;
      for (int64_t d = 0; d < Dp; d += 64) {
        switch (std::min<int64_t>(4, (Dp - d) / 16)) {
          case 1: Values<1>(si, vt + d, Dp, n, old, o + d); break;
          case 2: Values<2>(si, vt + d, Dp, n, old, o + d); break;
          case 3: Values<3>(si, vt + d, Dp, n, old, o + d); break;
          default: Values<4>(si, vt + d, Dp, n, old, o + d); break;
        }
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = t0 + i / Q, h = i % Q;
    float* o = out + (t * G * Q + h) * D;
    const float scale = best[i] == kNegInf ? 0.f : 1.f / total[i];
    for (int64_t d = 0; d < D; ++d) o[d] = acc[i * Dp + d] * scale;
  }
}

template <ffi::DataType DT, typename T>
ffi::Error Handler(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                   ffi::Buffer<DT> k, ffi::Buffer<DT> v,
                   ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_pos,
                   ffi::Buffer<ffi::S32> window, float softcap,
                   ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), qp = q_pos.dimensions(), kp = kv_pos.dimensions();
  if (qd.size() != 5 || kp.size() != 2 || qp.size() != 2)
    return ffi::Error::InvalidArgument(
        "prompt attention: q [R, T, G, Q, D], q_pos [R, T], kv_pos [R, L]");
  const int64_t R = qd[0], Tn = qd[1];
  const Shape sh{R, qd[2], qd[3], qd[4], kp[1]};
  const int64_t cache = sh.R * sh.G * sh.L * sh.D;
  if (int64_t(k.element_count()) != cache ||
      int64_t(v.element_count()) != cache)
    return ffi::Error::InvalidArgument(
        "prompt attention: k must hold [R, G, L, D] and v [R, G, D, L]");
  if (qp[0] != R || qp[1] != Tn || kp[0] != R || window.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "prompt attention: q_pos [R, T], kv_pos [R, L] and window [1]");
  if (sh.Q > kMaxQ)
    return ffi::Error::InvalidArgument(
        "prompt attention: at most 32 query heads per key/value head");
  const T* kc = reinterpret_cast<const T*>(k.untyped_data());
  const T* vc = reinterpret_cast<const T*>(v.untyped_data());
  const float* qs = q.typed_data();
  const int32_t* qpos = q_pos.typed_data();
  const int32_t* kvpos = kv_pos.typed_data();
  const int32_t win = window.typed_data()[0];
  float* o = out->typed_data();
  const int64_t G = sh.G, blocks = (Tn + kTokens - 1) / kTokens;
  const int64_t scratch = ScratchFloats(sh);
  // Tasks in (row, group, block of tokens) order: a row and group's blocks,
  // which read the same keys and values, are dealt out one after another.
  PoolTiles(pool, R * G * blocks, [&](int64_t task) {
    thread_local std::vector<float> buf;
    if (int64_t(buf.size()) < scratch) buf.resize(scratch);
    const int64_t b = task % blocks, rg = task / blocks;
    const int64_t r = rg / G, g = rg % G;
    const int64_t t0 = b * kTokens, t1 = std::min(Tn, t0 + kTokens);
    // Row r's tokens, at group g: token t's head h is at
    // ((t * G + g) * Q + h) * D from `at`.
    const int64_t at = (r * Tn * G + g) * sh.Q * sh.D;
    AttendTokens(sh, Tn, qs + at, kc + rg * sh.L * sh.D,
                 vc + rg * sh.D * sh.L, kvpos + r * sh.L, qpos + r * Tn,
                 win, softcap, t0, t1, buf.data(), o + at);
  });
  return ffi::Error::Success();
}

}  // namespace

#define PROMPT_ATTENTION_BINDING(T)     \
  ffi::Ffi::Bind()                      \
      .Ctx<ffi::ThreadPool>()           \
      .Arg<ffi::Buffer<ffi::F32>>()     \
      .Arg<ffi::Buffer<T>>()            \
      .Arg<ffi::Buffer<T>>()            \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Attr<float>("softcap")           \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_prompt_attention_f32,
                              (Handler<ffi::F32, float>),
                              PROMPT_ATTENTION_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_prompt_attention_bf16,
                              (Handler<ffi::BF16, uint16_t>),
                              PROMPT_ATTENTION_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_prompt_attention_f16,
                              (Handler<ffi::F16, Half>),
                              PROMPT_ATTENTION_BINDING(ffi::F16));
