// Q4_0 and Q4_1 products with float activations on a weight in tiles of 16
// outputs (matvec_tiles.cc's layout, `penzai_lm.kernels.tiles`), called
// through the XLA FFI.
//
// Why: in rows (matvec.cc's Q4Centered) each 16 values of an output are
// widened byte by byte, converted, scaled and offset (a multiply-add) and
// multiplied into the output's sum, which ends in a sum across lanes. In a
// tile, lane j of every vector is output j: a 64-byte vector d of a block
// holds bytes 4 d .. 4 d + 3 of 16 outputs, and value 4 d + i (low nibble)
// or 16 + 4 d + i (high nibble) of all 16 is one shift and one logic op
// away: (w >> (8 i + 4 h)) & 15, ORed into the mantissa of 2^23, is the
// float 2^23 + n, and subtracting 2^23 + 8 (Q4_0) or 2^23 (Q4_1) leaves
// n - 8 or n exactly. Each such vector takes one multiply-add per row
// against that value of the row, broadcast; a block's sum is scaled once
// (the 16 outputs' scales, one vector), and no output ends in a sum across
// lanes.
//
// Arithmetic: output j of row r is Σ_b scale_bj Σ_{i in b} x_ri (n_bij - 8)
// for Q4_0, Σ_b (scale_bj Σ_{i in b} x_ri n_bij + min_bj Σ_{i in b} x_ri)
// for Q4_1; each block's sum in two chains (alternating by the value's
// parity), in the same order for every row and batch: a row's results do
// not depend on the rows beside it. It differs from the product with the
// dequantized weights ((n - 8) scale, n scale + min) only in where the
// float roundings fall.
//
// Layout (as matvec_tiles.cc): qs u8 [T, K / 32 * 256], byte 256 b + 64 d +
// 4 j + i of tile t is byte 4 d + i of block b of output 16 t + j (ggml's
// nibble order: low nibble value 4 d + i, high nibble 16 + 4 d + i);
// scale f16 [T, K / 32 * 16], 16 b + j block b's scale of output 16 t + j
// (Q4_1: f32, and its mins alike). x f32 [R, K], y f32 [R, 16 T].
//
// With AVX-512 (a 16-float vector a tile) only; other builds keep a plain
// loop, correct but slow: `ops.q4_float_tiles` says which, and the layers
// keep Q4_0 and Q4_1 in rows there.

#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary

constexpr int64_t kOutputs = 16;    // outputs per tile (lanes)
constexpr int64_t kBlockBytes = 256;  // a block of 32 values of a tile
constexpr int64_t kMostRows = 8;    // rows a pass over the tiles
constexpr int64_t kChunk = 4;       // tiles whose weights serve every pass

// A weight in tiles: Q4_0 (float16 scales, no mins) or Q4_1 (float32
// scales and mins); `sums` holds Σ x over each block of each row (Q4_1's
// mins multiply it), [R, K / 32].
template <typename S>
struct Weights {
  const uint8_t* qs;
  const S* scale;
  const float* mins;  // Q4_1's, else null
  const float* sums;  // Q4_1's, else null
};

#if defined(__AVX512F__)
constexpr int64_t kAhead = 4;  // blocks prefetched ahead
constexpr int kChains = 2;     // multiply-add chains a block of an output

// Tiles [t, t + TB) of rows [r0, r0 + RB) (RB * TB * kChains chains of
// multiply-adds side by side: 8 for 1 or 2 rows, more from 4).
inline __m512 LoadScales(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 LoadScales(const float* p) { return _mm512_loadu_ps(p); }

template <int RB, int TB, typename S>
void Block(const Weights<S>& wt, const float* x, int64_t K, int64_t t,
           int64_t r0, float* y, int64_t N) {
  constexpr bool mins = std::is_same_v<S, float>;
  const uint8_t* qs = wt.qs;
  const S* scale = wt.scale;
  const int64_t blocks = K / 32;
  const __m512i low4 = _mm512_set1_epi32(15);
  const __m512i two23 = _mm512_set1_epi32(0x4B000000);  // 2^23 as a float
  // 2^23 + 8 for Q4_0 (n - 8), 2^23 for Q4_1 (n).
  const __m512 offset = _mm512_set1_ps(mins ? 8388608.f : 8388616.f);
  __m512 acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int u = 0; u < TB; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 sum[RB][TB][kChains];
    for (int r = 0; r < RB; ++r)
      for (int u = 0; u < TB; ++u)
        for (int c = 0; c < kChains; ++c) sum[r][u][c] = _mm512_setzero_ps();
    const float* xb = x + r0 * K + 32 * b;
#pragma GCC unroll 4
    for (int u = 0; u < TB; ++u) {
      const uint8_t* p = qs + ((t + u) * blocks + b) * kBlockBytes;
      // Past a tile's end is the next tile's start (or a line unused).
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l)
        __builtin_prefetch(p + kAhead * kBlockBytes + 64 * l);
      __builtin_prefetch(scale + ((t + u) * blocks + b + kAhead) * kOutputs);
      if constexpr (mins)
        __builtin_prefetch(wt.mins + ((t + u) * blocks + b + kAhead) *
                                         kOutputs);
    }
#pragma GCC unroll 4
    for (int d = 0; d < 4; ++d) {
      __m512i w[TB];
#pragma GCC unroll 4
      for (int u = 0; u < TB; ++u)
        w[u] = _mm512_loadu_si512(qs + ((t + u) * blocks + b) * kBlockBytes +
                                  64 * d);
#pragma GCC unroll 8
      for (int e = 0; e < 8; ++e) {  // i = e % 4, nibble h = e / 4
        const int i = e % 4, h = e / 4, value = 16 * h + 4 * d + i;
        const int shift = 8 * i + 4 * h;
#pragma GCC unroll 4
        for (int u = 0; u < TB; ++u) {
          const __m512i n = shift ? _mm512_srli_epi32(w[u], shift) : w[u];
          // (n & 15) | 2^23's bits, then - (2^23 + 8): n - 8 exactly.
          const __m512 v = _mm512_sub_ps(
              _mm512_castsi512_ps(
                  _mm512_ternarylogic_epi32(n, low4, two23, 0xEA)),
              offset);
#pragma GCC unroll 8
          for (int r = 0; r < RB; ++r)
            sum[r][u][value % kChains] = _mm512_fmadd_ps(
                v, _mm512_set1_ps(xb[r * K + value]),
                sum[r][u][value % kChains]);
        }
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < TB; ++u) {
      const int64_t at = ((t + u) * blocks + b) * kOutputs;
      const __m512 s = LoadScales(scale + at);
      for (int r = 0; r < RB; ++r)
        acc[r][u] = _mm512_fmadd_ps(
            s, _mm512_add_ps(sum[r][u][0], sum[r][u][1]), acc[r][u]);
      if constexpr (mins) {
        const __m512 m = _mm512_loadu_ps(wt.mins + at);
        for (int r = 0; r < RB; ++r)
          acc[r][u] = _mm512_fmadd_ps(
              m, _mm512_set1_ps(wt.sums[(r0 + r) * blocks + b]), acc[r][u]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int u = 0; u < TB; ++u)
      _mm512_storeu_ps(y + (r0 + r) * N + kOutputs * (t + u), acc[r][u]);
}

// Tiles [t0, t1) of rows [r0, r0 + RB), TB at a time, then one by one.
template <int RB, int TB, typename S>
void Range(const Weights<S>& w, const float* x, int64_t K, int64_t t0,
           int64_t t1, int64_t r0, float* y, int64_t N) {
  int64_t t = t0;
  for (; t + TB <= t1; t += TB) Block<RB, TB>(w, x, K, t, r0, y, N);
  for (; t < t1; ++t) Block<RB, 1>(w, x, K, t, r0, y, N);
}

template <typename S>
void Pass(const Weights<S>& w, const float* x, int64_t K, int64_t t0,
          int64_t t1, int64_t r0, int64_t rows, float* y, int64_t N) {
  switch (rows) {
    case 1: Range<1, 4>(w, x, K, t0, t1, r0, y, N); break;
    case 2: Range<2, 2>(w, x, K, t0, t1, r0, y, N); break;
    case 3: Range<3, 1>(w, x, K, t0, t1, r0, y, N); break;
    case 4: Range<4, 1>(w, x, K, t0, t1, r0, y, N); break;
    case 5: Range<5, 1>(w, x, K, t0, t1, r0, y, N); break;
    case 6: Range<6, 1>(w, x, K, t0, t1, r0, y, N); break;
    case 7: Range<7, 1>(w, x, K, t0, t1, r0, y, N); break;
    default: Range<8, 1>(w, x, K, t0, t1, r0, y, N); break;
  }
}
const char* Isa() { return "avx512"; }
#else
// Output 16 t + j of rows [r0, r0 + rows), tiles [t0, t1): the same sums,
// one value at a time.
inline float ScaleAt(const uint16_t* p) { return F16ToF32(*p); }
inline float ScaleAt(const float* p) { return *p; }

template <typename S>
void Pass(const Weights<S>& w, const float* x, int64_t K, int64_t t0,
          int64_t t1, int64_t r0, int64_t rows, float* y, int64_t N) {
  constexpr bool mins = std::is_same_v<S, float>;
  const int64_t blocks = K / 32;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < kOutputs; ++j) {
        float total = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* p = w.qs + (t * blocks + b) * kBlockBytes + 4 * j;
          float sum[2] = {0.f, 0.f};
          for (int d = 0; d < 4; ++d) {
            for (int e = 0; e < 8; ++e) {
              const int i = e % 4, h = e / 4, value = 16 * h + 4 * d + i;
              const int n = (p[64 * d + i] >> (4 * h)) & 15;
              sum[value % 2] +=
                  x[r * K + 32 * b + value] * float(mins ? n : n - 8);
            }
          }
          const int64_t at = (t * blocks + b) * kOutputs + j;
          total += ScaleAt(w.scale + at) * (sum[0] + sum[1]);
          if constexpr (mins) total += w.mins[at] * w.sums[r * blocks + b];
        }
        y[r * N + kOutputs * t + j] = total;
      }
    }
  }
}
const char* Isa() { return "portable"; }
#endif

// y = x w^T for w in tiles (shapes checked by the handlers).
template <typename S>
void Run(ffi::ThreadPool& pool, const float* x, int64_t R, int64_t K,
         Weights<S> w, int64_t T, float* y) {
  if (R == 0 || T == 0) return;
  const int64_t N = kOutputs * T, blocks = K / 32;
  std::vector<float> sums;
  if constexpr (std::is_same_v<S, float>) {  // Q4_1: Σ x a block, in order
    sums.resize(R * blocks);
    for (int64_t i = 0; i < R * blocks; ++i) {
      float total = 0.f;
      for (int v = 0; v < 32; ++v) total += x[32 * i + v];
      sums[i] = total;
    }
    w.sums = sums.data();
  }
  // Two runs of tiles per thread (as ParallelOutputs hands out outputs);
  // in each, chunks of tiles whose weights stay in cache over the passes of
  // up to kMostRows rows.
  const int64_t parts = std::min<int64_t>(
      T, kTilesPerThread * std::max<int64_t>(1, pool.num_threads()));
  ParallelTiles(pool, parts, [&](int64_t part) {
    const int64_t t0 = part * T / parts, t1 = (part + 1) * T / parts;
    const int64_t chunk = R <= kMostRows ? t1 - t0 : kChunk;
    for (int64_t c = t0; c < t1; c += chunk) {
      const int64_t c1 = std::min(t1, c + chunk);
      for (int64_t r0 = 0; r0 < R; r0 += kMostRows)
        Pass(w, x, K, c, c1, r0, std::min(kMostRows, R - r0), y, N);
    }
  });
}

ffi::Error Q4_0Tiles(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F16> scale,
                     ffi::ResultBuffer<ffi::F32> y) {
  if (!Q4TileShapes(x, qs, scale, y->dimensions()))
    return ffi::Error::InvalidArgument(
        "q4_0 tiles: x [R, K] with K % 32 == 0, qs u8 [T, 8 K] and f16 scale "
        "[T, K / 2] (tiles of 16 outputs), y [R, 16 T]");
  const Weights<uint16_t> w{
      qs.typed_data(), reinterpret_cast<const uint16_t*>(scale.untyped_data()),
      nullptr, nullptr};
  Run(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], w,
      qs.dimensions()[0], y->typed_data());
  return ffi::Error::Success();
}

ffi::Error Q4_1Tiles(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F32> scale,
                     ffi::Buffer<ffi::F32> mins,
                     ffi::ResultBuffer<ffi::F32> y) {
  if (!Q4TileShapes(x, qs, scale, y->dimensions()) ||
      !(mins.dimensions() == scale.dimensions()))
    return ffi::Error::InvalidArgument(
        "q4_1 tiles: x [R, K] with K % 32 == 0, qs u8 [T, 8 K], f32 scale "
        "and mins [T, K / 2] (tiles of 16 outputs), y [R, 16 T]");
  const Weights<float> w{qs.typed_data(), scale.typed_data(),
                         mins.typed_data(), nullptr};
  Run(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], w,
      qs.dimensions()[0], y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// Which code the 4-bit float products on tiles run in this build:
// "avx512" or "portable" (`ops.q4_float_tiles`).
extern "C" const char* pzlm_q4_tiles_isa() { return Isa(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q4_0_tiles, Q4_0Tiles,
                              PZLM_PRODUCT_BINDING_2(ffi::U8, ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q4_1_tiles, Q4_1Tiles,
                              PZLM_PRODUCT_BINDING_3(ffi::U8, ffi::F32,
                                                     ffi::F32));
