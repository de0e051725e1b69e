// Attention of one new token per row over a KV cache, for XLA:CPU, called
// through the XLA FFI.
//
// Why this exists: XLA:CPU runs decode attention as ~10 small ops per layer
// (a YNNPACK dot for the scores, mask and scale, a windowed max, exp, sum,
// divide, a second dot for the values), each over the whole cache, mostly
// on one core. Measured with perf on SmolLM2 int8 decoding 1,000 tokens:
// ~12.5 us per cached slot per step (~6.5 ms of a 16.7 ms step at ~520
// slots), where reading those slots' keys and values takes ~1 ms. Here each
// (row, key/value head, chunk of slots) is one task on the kernels' workers:
// it reads every key once for all the query heads of its group, runs a
// vectorized softmax, reads every value once, and the chunks are combined
// with their maxima (as flash-decoding does). Slots outside the range of
// attended positions are never read, so a half-empty cache costs half.
//
// The kernel also writes the new token's key and value into the caches (in
// place: the caches are aliased to its outputs). XLA:CPU's own write into a
// bfloat16 cache converted the whole cache to float32 and back at every
// layer and step.
//
// Conventions:
//   q:      f32[R, G, Q, D]  each row's query (scaled, rotated): G key/value
//                            heads, Q query heads per group, D per head
//   k_new:  T[R, G, D]       the new key and value, written at slot `end`
//   v_new:  T[R, G, D]
//   end:    s32[1]
//   k:      T[R, G, L, D]    key cache, L slots (any shape of as many
//                            elements: XLA drops size-1 dimensions)
//   v:      T[R, G, D, L]    value cache, slots last (likewise)
//   q_pos:  s32[R]           the query's position
//   kv_pos: s32[R, L]        each slot's position, -1 where empty or padding
//   window: s32[1]           slots at distance >= window are not attended
//   softcap (attribute)      > 0: scores become cap * tanh(score / cap)
//   out:    f32[R, G, Q, D], and the caches k and v (aliased)
// Slot l of row r is attended iff 0 <= kv_pos <= q_pos and
// q_pos - kv_pos < window. A row with no slot to attend gets zeros.

#include <cmath>
#include <limits>

#include "attend.h"
#include "common.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary
using namespace pzlm::attend;  // NOLINT: Shape, Partial, kChunk

template <typename T>
void DecodeAttention(ffi::ThreadPool& pool, const Shape& sh, const float* q,
                     const T* k, const T* v, const int32_t* q_pos,
                     const int32_t* kv_pos, int32_t window, float softcap,
                     float* out) {
  const int64_t R = sh.R, G = sh.G, Q = sh.Q, D = sh.D, L = sh.L;
  // Each row's attended slots lie in [lo, hi): only those are read.
  std::vector<int64_t> lo(R, 0), hi(R, 0);
  int64_t chunks = 1;
  for (int64_t r = 0; r < R; ++r) {
    const int32_t* p = kv_pos + r * L;
    int64_t a = 0, b = L;
    while (a < L && !Attended(p[a], q_pos[r], window)) ++a;
    while (b > a && !Attended(p[b - 1], q_pos[r], window)) --b;
    lo[r] = a;
    hi[r] = b;
    chunks = std::max(chunks, (b - a + kChunk - 1) / kChunk);
  }
  const int64_t tasks = R * G * chunks;
  const int64_t per_task = Q * kChunk + Q * (D + 2);
  thread_local std::vector<float> scratch;
  if (int64_t(scratch.size()) < tasks * per_task)
    scratch.resize(tasks * per_task);
  float* buf = scratch.data();
  Workers::Get(std::max<int64_t>(1, pool.num_threads()))
      .Run(tasks, [&](int64_t t) {
        const int64_t c = t % chunks, rg = t / chunks, r = rg / G;
        const int64_t a = std::min(hi[r], lo[r] + c * kChunk);
        const int64_t b = std::min(hi[r], a + kChunk);
        float* s = buf + t * per_task;
        float* m = s + Q * kChunk;
        Partial(sh, q + rg * Q * D, k + rg * L * D, v + rg * D * L,
                kv_pos + r * L, q_pos[r], window, softcap, a, b, s, m,
                m + Q, m + 2 * Q);
      });
  // Combine each row and group's chunks by their maxima.
  for (int64_t rg = 0; rg < R * G; ++rg) {
    for (int64_t h = 0; h < Q; ++h) {
      float mx = kNegInf;
      for (int64_t c = 0; c < chunks; ++c)
        mx = std::max(mx, buf[(rg * chunks + c) * per_task + Q * kChunk + h]);
      float* o = out + (rg * Q + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      if (mx == kNegInf) continue;
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* m = buf + (rg * chunks + c) * per_task + Q * kChunk;
        if (m[h] == kNegInf) continue;
        const float w = std::exp(m[h] - mx);
        total += m[Q + h] * w;
        const float* part = m + 2 * Q + h * D;
        for (int64_t d = 0; d < D; ++d) o[d] += part[d] * w;
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
    }
  }
}

template <ffi::DataType DT, typename T>
ffi::Error Handler(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                   ffi::Buffer<DT>, ffi::Buffer<DT>, ffi::Buffer<DT> k_new,
                   ffi::Buffer<DT> v_new, ffi::Buffer<ffi::S32> end,
                   ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_pos,
                   ffi::Buffer<ffi::S32> window, float softcap,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<DT> k,
                   ffi::ResultBuffer<DT> v) {
  auto qd = q.dimensions(), qp = q_pos.dimensions(), kp = kv_pos.dimensions();
  if (qd.size() != 4 || kp.size() != 2)
    return ffi::Error::InvalidArgument(
        "decode attention: q [R, G, Q, D] and kv_pos [R, L]");
  Shape sh{qd[0], qd[1], qd[2], qd[3], kp[1]};
  const int64_t cache = sh.R * sh.G * sh.L * sh.D, rgd = sh.R * sh.G * sh.D;
  // The caches may come in any shape of [R, G, L, D] / [R, G, D, L]
  // elements (size-1 dimensions dropped, as XLA writes them in place).
  if (int64_t(k->element_count()) != cache ||
      int64_t(v->element_count()) != cache ||
      int64_t(k_new.element_count()) != rgd ||
      int64_t(v_new.element_count()) != rgd)
    return ffi::Error::InvalidArgument(
        "decode attention: k must hold [R, G, L, D], v [R, G, D, L], and "
        "k_new and v_new [R, G, D]");
  if (qp.size() != 1 || qp[0] != sh.R || kp[0] != sh.R ||
      window.element_count() != 1 || end.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "decode attention: q_pos [R], kv_pos [R, L], window and end [1]");
  if (sh.Q > kMaxQ)
    return ffi::Error::InvalidArgument(
        "decode attention: at most 32 query heads per key/value head");
  const int64_t e = end.typed_data()[0];
  if (e < 0 || e >= sh.L)
    return ffi::Error::InvalidArgument("decode attention: end outside cache");
  T* kc = reinterpret_cast<T*>(k->untyped_data());
  T* vc = reinterpret_cast<T*>(v->untyped_data());
  const T* kn = reinterpret_cast<const T*>(k_new.untyped_data());
  const T* vn = reinterpret_cast<const T*>(v_new.untyped_data());
  for (int64_t rg = 0; rg < sh.R * sh.G; ++rg) {
    std::memcpy(kc + (rg * sh.L + e) * sh.D, kn + rg * sh.D, sh.D * sizeof(T));
    for (int64_t d = 0; d < sh.D; ++d)
      vc[(rg * sh.D + d) * sh.L + e] = vn[rg * sh.D + d];
  }
  DecodeAttention(pool, sh, q.typed_data(), kc, vc, q_pos.typed_data(),
                  kv_pos.typed_data(), window.typed_data()[0], softcap,
                  out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

#define ATTENTION_BINDING(T)            \
  ffi::Ffi::Bind()                      \
      .Ctx<ffi::ThreadPool>()           \
      .Arg<ffi::Buffer<ffi::F32>>()     \
      .Arg<ffi::Buffer<T>>()            \
      .Arg<ffi::Buffer<T>>()            \
      .Arg<ffi::Buffer<T>>()            \
      .Arg<ffi::Buffer<T>>()            \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Attr<float>("softcap")           \
      .Ret<ffi::Buffer<ffi::F32>>()     \
      .Ret<ffi::Buffer<T>>()            \
      .Ret<ffi::Buffer<T>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_decode_attention_f32,
                              (Handler<ffi::F32, float>),
                              ATTENTION_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_decode_attention_bf16,
                              (Handler<ffi::BF16, uint16_t>),
                              ATTENTION_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_decode_attention_f16,
                              (Handler<ffi::F16, Half>),
                              ATTENTION_BINDING(ffi::F16));
