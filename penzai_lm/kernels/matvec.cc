// Small-batch matrix products for XLA:CPU, called through the XLA FFI.
//
// Why this exists: for a vector-matrix product (decoding, a few rows of
// activations) XLA:CPU converts bfloat16/float16 weights to a float32 copy
// before every dot, and has no dot that reads int8 or 4-bit weights at all.
// Decoding reads every weight once per token, so that copy costs a weight
// sized write and read per step (SmolLM2 bf16 decoded slower than f32, and
// 576x12288 bf16 took 12 ms against 5 ms in f32). Here each step of
// weights is decoded in registers right before the FMAs that use it, for
// every row of the activations at once, and software prefetches run ahead
// of the short runs the hardware prefetchers do not follow. One SmolLM2
// decode step's products (134.5M weights, batch 1, 2 cores;
// benchmarks/cpu_kernels.py): XLA f32 21 ms; kernels bf16 13.5-16 ms,
// int8 7.7 ms, q4_1 7.5 ms (the first version decoded tiles into an L1
// buffer without prefetching: 18, 18 and 23 ms).
//
// Conventions (every entry point):
//   x: f32[R, K]  activations, R rows (batch x seq), K contracted.
//   y: f32[R, N]  result.
//   "out-major" weights are [N, K] (each output's weights contiguous, as
//   GGUF and tied embedding tables store them); "in-major" are [K, N].
//   Quantized weights are out-major and blockwise along K
//   (weight_formats.h).
// Work is split into tiles of outputs, handed out through an atomic counter
// to the caller and the kernels' own worker threads: a worker that starts
// late finds fewer tiles left. Out-major products take a few long tiles
// per thread (common.h's ParallelOutputs).


#include <type_traits>

#include "common.h"
#include "float_vec.h"
#include "weight_formats.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary

// Blocks: kOuts outputs of kRowPass rows at a time, where the rows take
// several passes over each chunk of outputs (the later passes read the
// weights from cache, the products are compute-bound, and a block loads
// each step of a row's activations once for kOuts outputs). Up to kOnePass
// rows (decoding a few rows) take one pass that streams the weights from
// memory, one output at a time with AVX-512: its weights are one run of
// memory, read front to back. Blocks of 4 read 4 runs side by side, which
// an AMD EPYC (Zen 4) streamed at 2/3 of the rate (SmolLM2's bfloat16
// products 14.4 -> 11.4 ms a step, Q8_0 10.0 -> 7.5; docs/cpu-speed.md).
// One pass over 5 or 6 rows beat passes of 4 + 1 or 2 in blocks for every
// format (Q8_0 at 5 rows 13.9 -> 11.6 ms a step); at 7 and 8 rows float32
// went 3-7% slower that way, bfloat16 weights 8% faster (their product
// takes one pass to 8 rows: `Bf16RowsOutMajor`), until 7 and 8 rows took
// one pass over 2 outputs at a time (3 for dense weights, whose step is one
// vector; `WideOuts`): each step is decoded once for every row, and each
// row's activations loaded once for 2-3 outputs (SmolLM2's products at 8
// rows 4-15% faster, docs/cpu-speed.md). With AVX2, 16 registers
// of 8 floats: 2 rows x 2 outputs x 2 accumulators plus the decoded weights
// (4 x 4, which spills, measured the same end to end within this machine's
// noise: SmolLM2 f32 decode 31.0 / 31.5 tok/s at batch 1, 113 / 117 at
// batch 8); one pass over one row takes one output at a time but for
// 4-bit weights (`SingleRowOuts`).
// Each output's sum runs in the same order in any block, so a row's
// results do not depend on the other rows of its batch.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kOuts = 2;
constexpr int kStreamOuts = 2;
constexpr int kRowPass = 2;
constexpr int kOnePass = 2;
constexpr int kBf16OnePass = 2;
constexpr int kInVecs = 4;
constexpr int kInVecsRows = 2;
#else
constexpr int kOuts = 4;
constexpr int kStreamOuts = 1;
constexpr int kRowPass = 4;
constexpr int kOnePass = 8;
constexpr int kBf16OnePass = 8;
constexpr int kInVecs = 16;
constexpr int kInVecsRows = 4;
#endif
constexpr int kMostOnePass = 8;  // Rows a pass can take (OnePass).

// Chains of multiply-adds in each output's sum: vector v of an output's
// weights (16 values) adds into accumulator v % Chains, and the
// accumulators are added lane by lane at the end. Two for Q4_0 with
// AVX-512: its float product of a lone output (one row, one output at a
// time) was one chain of two multiply-adds a step, bound by the
// multiply-add's latency (a Zen 5 EPYC: SmolLM2's Q4_0 products at 1 row
// 4.1 -> 3.4-3.6 ms a step, at 8 rows the same; docs/cpu-speed.md). Other
// formats keep one: two chains leave no registers for outputs side by side
// at 7 and more rows, and Q4_1's products at 8 rows were 10% slower that
// way (Q8_0's and int8's 13-20%) for 0-10% at 1 row. Every block of a
// format sums in its order, so a row's results still do not depend on the
// rows beside it.
template <typename W>
constexpr int Chains() {
#if defined(__AVX512F__)
  return std::is_same_v<W, Q4Centered> ? 2 : 1;
#else
  return 1;
#endif
}

// Outputs side by side in one pass over 7 or 8 rows: 16 or 24 accumulators
// beside a step of decoded weights with AVX-512 (AVX2 never takes such a
// pass; the portable path keeps one output at a time); one for two chains.
template <typename W>
constexpr int WideOuts() {
#if defined(__AVX512F__)
  return Chains<W>() == 2 ? 1 : W::kStep == 16 ? 3 : 2;
#else
  return kStreamOuts;
#endif
}

// One step of K (W::kStep values) of OutBlock: its vectors add into chains
// C0 .. C0 + S - 1 (mod C).
template <int RB, int OUTS, int C, int C0, typename W>
inline __attribute__((always_inline)) void OutStep(
    const W& w, const typename W::Row (&row)[OUTS], const float* x,
    int64_t K, int64_t k, VF (&acc)[RB][OUTS][C]) {
  constexpr int S = W::kStep / 16;
  VF wv[OUTS][S];
  for (int o = 0; o < OUTS; ++o) {
    w.Prefetch(row[o], 2 * OUTS, k);
    w.Get(row[o], k, wv[o]);
  }
  for (int r = 0; r < RB; ++r) {
    for (int s = 0; s < S; ++s) {
      VF xv = LoadF(x + r * K + k + 16 * s);
      for (int o = 0; o < OUTS; ++o) acc[r][o][(C0 + s) % C] += xv * wv[o][s];
    }
  }
}

// Outputs [n0, n0 + OUTS) of RB rows of x: each step of K is decoded
// once, into registers, and used by every row; RB * OUTS * Chains
// accumulators.
template <int RB, int OUTS, typename W>
void OutBlock(const W& w, const float* x, float* y, int64_t K, int64_t N,
              int64_t n0) {
  constexpr int S = W::kStep / 16;  // vectors a step
  constexpr int C = Chains<W>();
  static_assert(C <= 2 && S <= 2, "a step pairs at most 2 chains");
  constexpr int U = S >= C ? 1 : 2;  // steps an iteration
  VF acc[RB][OUTS][C] = {};
  typename W::Row row[OUTS];
  for (int o = 0; o < OUTS; ++o) row[o] = w.row(n0 + o);
  const int64_t whole = K - K % W::kStep;
  const int64_t paired = whole - whole % (U * W::kStep);
  for (int64_t k = 0; k < paired; k += U * W::kStep) {
    OutStep<RB, OUTS, C, 0>(w, row, x, K, k, acc);
    if constexpr (U == 2)
      OutStep<RB, OUTS, C, 1>(w, row, x, K, k + W::kStep, acc);
  }
  if (paired < whole) OutStep<RB, OUTS, C, 0>(w, row, x, K, paired, acc);
  for (int r = 0; r < RB; ++r) {
    for (int o = 0; o < OUTS; ++o) {
      VF total = acc[r][o][0];
      for (int c = 1; c < C; ++c) total += acc[r][o][c];
      float t = SumF(total);
      for (int64_t k = whole; k < K; ++k) t += x[r * K + k] * w.At(row[o], k);
      y[r * N + n0 + o] = t * w.Scale(row[o]);
    }
  }
}

// Outputs [n0, n1) of RB rows, in blocks of OUTS.
template <int RB, int OUTS, typename W>
void OutRange(const W& w, const float* x, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + OUTS <= n1; n += OUTS) OutBlock<RB, OUTS>(w, x, y, K, N, n);
  for (; n < n1; ++n) OutBlock<RB, 1>(w, x, y, K, N, n);
}

// Outputs side by side in one pass over a single row: one, but for 4-bit
// weights with AVX2. There (an AMD EPYC, Zen 3) one output took SmolLM2's
// bfloat16 products from 13.2-14.2 to 10.0-11.6 ms a step and Q8_0's from
// 9.2-10.3 to 8.7-9.1 (float32's and int8's the same; Q4_0's the same or
// 6% slower end to end), and int8's at 2 rows from 9.6-10.8 to 12.6-13.0,
// so more rows keep kStreamOuts (docs/cpu-speed.md).
template <typename W>
constexpr int SingleRowOuts() {
  return std::is_same_v<W, Q4> || std::is_same_v<W, Q4Centered> ? kStreamOuts
                                                                 : 1;
}

// Outputs [n0, n1) of R <= kMostOnePass rows in one pass, kStreamOuts at
// a time (`SingleRowOuts` for 1 row, `WideOuts` at 7 and 8 rows).
template <typename W>
void OnePass(const W& w, const float* x, float* y, int64_t R, int64_t K,
             int64_t N, int64_t n0, int64_t n1) {
  switch (R) {
    case 1: OutRange<1, SingleRowOuts<W>()>(w, x, y, K, N, n0, n1); break;
    case 2: OutRange<2, kStreamOuts>(w, x, y, K, N, n0, n1); break;
    case 3: OutRange<3, kStreamOuts>(w, x, y, K, N, n0, n1); break;
    case 4: OutRange<4, kStreamOuts>(w, x, y, K, N, n0, n1); break;
    case 5: OutRange<5, kStreamOuts>(w, x, y, K, N, n0, n1); break;
    case 6: OutRange<6, kStreamOuts>(w, x, y, K, N, n0, n1); break;
    case 7: OutRange<7, WideOuts<W>()>(w, x, y, K, N, n0, n1); break;
    default: OutRange<8, WideOuts<W>()>(w, x, y, K, N, n0, n1); break;
  }
}

// R rows against out-major weights: in one pass up to ``one_pass`` rows (at
// most kMostOnePass), else in passes of kRowPass rows.
template <typename W>
void OutMajor(ffi::ThreadPool& pool, const W& w, const float* x, float* y,
              int64_t R, int64_t K, int64_t N, int one_pass = kOnePass) {
  if (R == 0) return;
  if (R <= std::min(one_pass, kMostOnePass)) {
    ParallelOutputs(pool, N, 64, [=, &w](int64_t n0, int64_t n1) {
      OnePass(w, x, y, R, K, N, n0, n1);
    });
    return;
  }
  // Chunks of 64 outputs: their weights stay in L1/L2 between the passes
  // over the rows, kRowPass rows a pass (two chains: one pass's up to 8, as
  // `OnePass` takes them; in blocks of 4 outputs they had no registers).
  ParallelOutputs(pool, N, 64, [=, &w](int64_t n0, int64_t n1) {
    if constexpr (Chains<W>() == 2) {
      for (int64_t r0 = 0; r0 < R; r0 += kMostOnePass)
        OnePass(w, x + r0 * K, y + r0 * N,
                std::min<int64_t>(kMostOnePass, R - r0), K, N, n0, n1);
      return;
    }
    for (int64_t r0 = 0; r0 < R; r0 += kRowPass) {
      const float* xr = x + r0 * K;
      float* yr = y + r0 * N;
      switch (std::min<int64_t>(kRowPass, R - r0)) {
        case 1: OutRange<1, kOuts>(w, xr, yr, K, N, n0, n1); break;
        case 2: OutRange<2, kOuts>(w, xr, yr, K, N, n0, n1); break;
        case 3: OutRange<3, kOuts>(w, xr, yr, K, N, n0, n1); break;
        default: OutRange<4, kOuts>(w, xr, yr, K, N, n0, n1); break;
      }
    }
  });
}

// In-major dense weights [K, N]: outputs [n0, n0 + 16 * VECS) of RB rows
// over K rows [k0, k1) of the weight (each a contiguous run), added to or
// written into out.
template <int RB, int VECS, typename T>
void InBlock(const T* w, const float* x, float* out, int64_t K, int64_t N,
             int64_t k0, int64_t k1, int64_t n0) {
  VF acc[RB][VECS] = {};
  for (int64_t k = k0; k < k1; ++k) {
    const T* p = w + k * N + n0;
    // About 8 KB of this block's weights ahead: each of its rows is a short
    // run the hardware prefetchers do not follow (bf16 decoding took 19 ms
    // a step without this, 13.5 ms with it).
    constexpr int kLine = 64 / sizeof(T);
    constexpr int64_t kAhead =
        std::max<int64_t>(4, 8192 / (16 * VECS * sizeof(T)));
    for (int j = 0; j < 16 * VECS; j += kLine) {
      __builtin_prefetch(p + kAhead * N + j);
    }
    VF wv[VECS];
    for (int v = 0; v < VECS; ++v) wv[v] = LoadF(p + 16 * v);
    for (int r = 0; r < RB; ++r) {
      VF xv = Splat(x[r * K + k]);
      for (int v = 0; v < VECS; ++v) acc[r][v] += xv * wv[v];
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int v = 0; v < VECS; ++v) StoreF(out + r * N + n0 + 16 * v, acc[r][v]);
  }
}

template <int RB, typename T>
void InRange(const T* w, const float* x, float* out, int64_t K, int64_t N,
             int64_t k0, int64_t k1, int64_t n0, int64_t n1) {
  // RB * V accumulators, in passes of kRowPass rows (AVX-512: 8 rows with
  // V = 2 read the weights once but took longer at batch 8, bf16: 32-43 ms
  // against 27).
  constexpr int V = RB == 1 ? kInVecs : kInVecsRows;
  int64_t n = n0;
  for (; n + 16 * V <= n1; n += 16 * V) InBlock<RB, V>(w, x, out, K, N, k0, k1, n);
  // The rest in as few passes over K as halving widths allow (a 192-wide
  // key projection took 12 passes of 16, now 8 + 4).
  if (V > 8 && n + 128 <= n1) { InBlock<RB, 8>(w, x, out, K, N, k0, k1, n); n += 128; }
  if (V > 4 && n + 64 <= n1) { InBlock<RB, 4>(w, x, out, K, N, k0, k1, n); n += 64; }
  if (V > 2 && n + 32 <= n1) { InBlock<RB, 2>(w, x, out, K, N, k0, k1, n); n += 32; }
  for (; n + 16 <= n1; n += 16) InBlock<RB, 1>(w, x, out, K, N, k0, k1, n);
  for (; n < n1; ++n) {
    for (int r = 0; r < RB; ++r) {
      float t = 0;
      for (int64_t k = k0; k < k1; ++k) t += x[r * K + k] * ToF32(w[k * N + n]);
      out[r * N + n] = t;
    }
  }
}

// A task takes a tile of outputs and a chunk of K; K is split only when
// there are too few output tiles for the threads, and the chunks' partial
// sums are added up at the end.
template <typename T>
void InMajor(ffi::ThreadPool& pool, const T* w, const float* x, float* y,
             int64_t R, int64_t K, int64_t N) {
  constexpr int64_t kTileN = 256;
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t splits =
      tiles >= 2 * threads ? 1
                           : std::max<int64_t>(1, std::min(2 * threads, K / 64));
  const int64_t chunk = (K + splits - 1) / splits;
  std::unique_ptr<float[]> partial;
  if (splits > 1) partial.reset(new float[splits * R * N]);
  float* parts = partial.get();
  ParallelTiles(pool, tiles * splits, [=](int64_t t) {
    int64_t split = t / tiles, n0 = (t % tiles) * kTileN;
    int64_t n1 = std::min(N, n0 + kTileN);
    int64_t k0 = split * chunk, k1 = std::min(K, k0 + chunk);
    float* out = splits > 1 ? parts + split * R * N : y;
    for (int64_t r0 = 0; r0 < R; r0 += kRowPass) {
      const float* xr = x + r0 * K;
      float* o = out + r0 * N;
      switch (std::min<int64_t>(kRowPass, R - r0)) {
        case 1: InRange<1>(w, xr, o, K, N, k0, k1, n0, n1); break;
        case 2: InRange<2>(w, xr, o, K, N, k0, k1, n0, n1); break;
        case 3: InRange<3>(w, xr, o, K, N, k0, k1, n0, n1); break;
        default: InRange<4>(w, xr, o, K, N, k0, k1, n0, n1); break;
      }
    }
  });
  for (int64_t split = 1; split < splits; ++split) {
    const float* p = parts + split * R * N;
    if (split == 1) std::memcpy(y, parts, R * N * sizeof(float));
    for (int64_t i = 0; i < R * N; ++i) y[i] += p[i];
  }
}


// bfloat16 rows against out-major bfloat16 weights [N, K]. With AVX-512
// BF16, and at most kRowPass rows (a decode step), each vdpbf16ps takes 32
// weights of an output and 32 values of a row and adds the 16 pairs'
// products into 16 float lanes (the products are exact in float32, as in
// the float path, which converts both sides). Otherwise the rows are
// widened to float32 once and the float path runs, in one pass up to 8
// rows: it decodes a step of weights once for every row, and from 5 rows it
// was the faster one (SmolLM2's step at 8 rows: 28.3 ms on vdpbf16ps, 25.0
// in passes of 4 rows, 23.1 in one pass; docs/cpu-speed.md).
#if defined(__AVX512BF16__)
template <int RB, int OUTS>
void Bf16Block(const uint16_t* w, const uint16_t* x, float* y, int64_t K,
               int64_t N, int64_t n0) {
  __m512 acc[RB][OUTS];
  for (int r = 0; r < RB; ++r)
    for (int o = 0; o < OUTS; ++o) acc[r][o] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask =
        K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (K - k)) - 1);
    __m512bh wv[OUTS];
    for (int o = 0; o < OUTS; ++o)
      wv[o] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n0 + o) * K + k);
    for (int r = 0; r < RB; ++r) {
      const __m512bh xv =
          (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * K + k);
      for (int o = 0; o < OUTS; ++o)
        acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, wv[o]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int o = 0; o < OUTS; ++o)
      y[r * N + n0 + o] = _mm512_reduce_add_ps(acc[r][o]);
}

template <int RB>
void Bf16Range(const uint16_t* w, const uint16_t* x, float* y, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kStreamOuts <= n1; n += kStreamOuts)
    Bf16Block<RB, kStreamOuts>(w, x, y, K, N, n);
  for (; n < n1; ++n) Bf16Block<RB, 1>(w, x, y, K, N, n);
}
#endif

ffi::Error Bf16RowsOutMajor(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                            ffi::Buffer<ffi::BF16> w,
                            ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument(
        "bf16 rows: x [R, K], w [N, K], both bfloat16");
  const int64_t R = xd[0], K = xd[1], N = wd[0];
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(w.untyped_data());
  float* yd = y->typed_data();
#if defined(__AVX512BF16__)
  if (R > 0 && R <= kRowPass) {
    ParallelOutputs(pool, N, 64, [=](int64_t n0, int64_t n1) {
      switch (R) {
        case 1: Bf16Range<1>(ws, xs, yd, K, N, n0, n1); break;
        case 2: Bf16Range<2>(ws, xs, yd, K, N, n0, n1); break;
        case 3: Bf16Range<3>(ws, xs, yd, K, N, n0, n1); break;
        default: Bf16Range<4>(ws, xs, yd, K, N, n0, n1); break;
      }
    });
    return ffi::Error::Success();
  }
#endif
  std::vector<float> wide(R * K);
  for (int64_t i = 0; i < R * K; ++i) wide[i] = Bf16ToF32(xs[i]);
  OutMajor(pool, Dense<uint16_t>{ws, K}, wide.data(), yd, R, K, N,
           kBf16OnePass);
  return ffi::Error::Success();
}

// Checks shapes shared by all entry points; returns R, K.
ffi::Error CheckX(const ffi::Buffer<ffi::F32>& x, int64_t& R, int64_t& K) {
  auto d = x.dimensions();
  if (d.size() != 2) return ffi::Error::InvalidArgument("x must be [R, K]");
  R = d[0];
  K = d[1];
  return ffi::Error::Success();
}

template <ffi::DataType T, typename Decode>
ffi::Error DenseOutMajor(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<T> w, ffi::ResultBuffer<ffi::F32> y) {
  int64_t R, K;
  if (auto e = CheckX(x, R, K); e.failure()) return e;
  auto wd = w.dimensions();
  if (wd.size() != 2 || wd[1] != K)
    return ffi::Error::InvalidArgument("w must be [N, K]");
  int64_t N = wd[0];
  Decode decode{reinterpret_cast<decltype(decode.w)>(w.untyped_data()), K};
  OutMajor(pool, decode, x.typed_data(), y->typed_data(), R, K, N);
  return ffi::Error::Success();
}

template <ffi::DataType T, typename S>
ffi::Error DenseInMajor(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<T> w, ffi::ResultBuffer<ffi::F32> y) {
  int64_t R, K;
  if (auto e = CheckX(x, R, K); e.failure()) return e;
  auto wd = w.dimensions();
  if (wd.size() != 2 || wd[0] != K)
    return ffi::Error::InvalidArgument("w must be [K, N]");
  InMajor<S>(pool, reinterpret_cast<const S*>(w.untyped_data()),
                      x.typed_data(), y->typed_data(), R, K, wd[1]);
  return ffi::Error::Success();
}

ffi::Error Q8OutMajor(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::S8> qs, ffi::Buffer<ffi::F32> scale,
                      ffi::ResultBuffer<ffi::F32> y) {
  int64_t R, K;
  if (auto e = CheckX(x, R, K); e.failure()) return e;
  auto qd = qs.dimensions(), sd = scale.dimensions();
  if (qd.size() != 2 || qd[1] != K || sd.size() != 2 || sd[0] != qd[0] ||
      sd[1] == 0 || K % sd[1] != 0)
    return ffi::Error::InvalidArgument("q8: qs [N, K], scale [N, K / block]");
  const int64_t block = K / sd[1], N = qd[0];
  const float* xd = x.typed_data();
  float* yd = y->typed_data();
  if (block == K) {
    OutMajor(pool, Q8Channel{{qs.typed_data(), scale.typed_data(), K}}, xd, yd,
             R, K, N);
  } else if (block == 32) {
    OutMajor(pool, Q8Block32{{qs.typed_data(), scale.typed_data(), K}}, xd, yd,
             R, K, N);
  } else {
    OutMajor(pool, Q8Any{{qs.typed_data(), scale.typed_data(), K}, block}, xd,
             yd, R, K, N);
  }
  return ffi::Error::Success();
}

ffi::Error Q8Group16OutMajor(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S8> qs,
                             ffi::Buffer<ffi::F32> scale,
                             ffi::Buffer<ffi::F32> mins,
                             ffi::ResultBuffer<ffi::F32> y) {
  int64_t R, K;
  if (auto e = CheckX(x, R, K); e.failure()) return e;
  auto qd = qs.dimensions(), sd = scale.dimensions(), md = mins.dimensions();
  if (K % 16 != 0 || qd.size() != 2 || qd[1] != K || sd.size() != 2 ||
      sd[0] != qd[0] || sd[1] * 16 != K || md.size() != 2 || md[0] != sd[0] ||
      md[1] != sd[1])
    return ffi::Error::InvalidArgument(
        "q8_16: K % 16 == 0, qs [N, K], scale and mins [N, K / 16]");
  Q8Group16 decode{{qs.typed_data(), scale.typed_data(), K},
                   mins.typed_data()};
  OutMajor(pool, decode, x.typed_data(), y->typed_data(), R, K, qd[0]);
  return ffi::Error::Success();
}

ffi::Error Q4OutMajor(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::F32> mins,
                      ffi::ResultBuffer<ffi::F32> y) {
  if (!Q4Shapes(x, qs, scale) || !(mins.dimensions() == scale.dimensions()))
    return ffi::Error::InvalidArgument(
        "q4: K % 32 == 0, x [R, K], qs [N, K / 2], scale and mins"
        " [N, K / 32]");
  Q4 decode{qs.typed_data(), scale.typed_data(), mins.typed_data(),
            x.dimensions()[1]};
  OutMajor(pool, decode, x.typed_data(), y->typed_data(), x.dimensions()[0],
           x.dimensions()[1], qs.dimensions()[0]);
  return ffi::Error::Success();
}

// Q4_0: the offsets are -8 scales, derived rather than read.
ffi::Error Q4CenteredOutMajor(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::U8> qs,
                              ffi::Buffer<ffi::F32> scale,
                              ffi::ResultBuffer<ffi::F32> y) {
  if (!Q4Shapes(x, qs, scale))
    return ffi::Error::InvalidArgument(
        "q4_0: K % 32 == 0, x [R, K], qs [N, K / 2], scale [N, K / 32]");
  Q4Centered decode{qs.typed_data(), scale.typed_data(), nullptr,
                    x.dimensions()[1]};
  OutMajor(pool, decode, x.typed_data(), y->typed_data(), x.dimensions()[0],
           x.dimensions()[1], qs.dimensions()[0]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_out_f32,
                              (DenseOutMajor<ffi::F32, Dense<float>>),
                              PZLM_PRODUCT_BINDING_1(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_out_bf16,
                              (DenseOutMajor<ffi::BF16, Dense<uint16_t>>),
                              PZLM_PRODUCT_BINDING_1(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_out_f16,
                              (DenseOutMajor<ffi::F16, Dense<Half>>),
                              PZLM_PRODUCT_BINDING_1(ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_in_f32,
                              (DenseInMajor<ffi::F32, float>),
                              PZLM_PRODUCT_BINDING_1(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_in_bf16,
                              (DenseInMajor<ffi::BF16, uint16_t>),
                              PZLM_PRODUCT_BINDING_1(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_in_f16,
                              (DenseInMajor<ffi::F16, Half>),
                              PZLM_PRODUCT_BINDING_1(ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q8, Q8OutMajor,
                              PZLM_PRODUCT_BINDING_2(ffi::S8, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_matvec_q8_16, Q8Group16OutMajor,
    PZLM_PRODUCT_BINDING_3(ffi::S8, ffi::F32, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_matvec_q4, Q4OutMajor,
    PZLM_PRODUCT_BINDING_3(ffi::U8, ffi::F32, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_matvec_q4_0, Q4CenteredOutMajor,
    PZLM_PRODUCT_BINDING_2(ffi::U8, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_out_bf16_rows, Bf16RowsOutMajor,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
