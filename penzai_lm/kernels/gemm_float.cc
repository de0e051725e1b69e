// Q4_0 and Q4_1 products of prompts (many rows) with float activations:
// y [R, N] = x [R, K] w^T in float32, for a weight in tiles of 16 outputs
// (matvec_q4_tiles.cc's layout), called through the XLA FFI.
//
// Why: on XLA's float32 GEMM a prompt first had the weight written out
// whole in float32 (dequantize.cc), and the GEMM ran SmolLM2's shapes at
// about half of this CPU's multiply-add peak (docs/cpu-speed.md). Here a
// thread takes a panel of 48 outputs (3 tiles) and K_C values of K at a
// time, decodes that piece of the weight into a float32 buffer that stays
// in L1 (each value as matvec_q4_tiles.cc decodes it, times the block's
// scale), and passes every row of x over it: 8 rows at a time hold 8 x 3
// vectors of sums in registers, one x value broadcast per row and value of
// K, three loads of the panel, 24 multiply-adds.
//
// Arithmetic: output n of row r is Σ_k x_rk w_nk, one multiply-add at a
// time in the order of k, where w is the dequantized weight (Q4_0 (n - 8)
// scale, exact; Q4_1 fma(n, scale, min), as dequantize.cc): the same for
// every row whatever its batch, and a product with the dequantized weight
// that differs from XLA's only in the order of the sums.
//
// Rows pass in chunks of kRowChunk (x's chunk stays in L2 while the panels
// pass), the panels of a chunk split between the threads (the caller and
// XLA's own pool: `PoolTiles`) in contiguous runs. With AVX-512 only;
// other builds keep a plain loop, correct but slow (`ops.float_gemm` says
// which, and the layers keep XLA's GEMM there).
//
// Float32 weights in rows took the same route and were slower than XLA's
// GEMM end to end (docs/cpu-speed.md): their panels are transposes of 48
// rows, whose pages a prefetch could not reach.

#include <cmath>
#include <type_traits>

#include "common.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary

constexpr int64_t kTile = 16;         // outputs per tile and per vector
constexpr int64_t kPanelTiles = 3;    // tiles (vectors) per panel
constexpr int64_t kPanel = kTile * kPanelTiles;  // outputs per panel
constexpr int64_t kDepth = 256;       // most values of K a panel piece
constexpr int64_t kRowChunk = 256;    // rows of x a pass over the panels
constexpr int64_t kBlockBytes = 256;  // a 4-bit block of 32 values of a tile

// A weight in tiles: Q4_0 (float16 scales) or Q4_1 (float32 scales and
// mins).
template <typename S>
struct Q4Tiles {
  const uint8_t* qs;
  const S* scale;
  const float* mins;  // Q4_1's, else null
};

#if defined(__AVX512F__)

inline __m512 LoadScales(const uint16_t* p) {
  return _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 LoadScales(const float* p) { return _mm512_loadu_ps(p); }

template <typename S>
void Pack(const Q4Tiles<S>& w, int64_t K, int64_t n0, int v, int64_t k0,
          int64_t kc, float* panel) {
  constexpr bool mins = std::is_same_v<S, float>;
  const int64_t blocks = K / 32;
  const __m512i low4 = _mm512_set1_epi32(15);
  const __m512i two23 = _mm512_set1_epi32(0x4B000000);  // 2^23 as a float
  const __m512 offset = _mm512_set1_ps(mins ? 8388608.f : 8388616.f);
  for (int u = 0; u < v; ++u) {
    const int64_t t = n0 / kTile + u;
    for (int64_t b = k0 / 32; b < (k0 + kc) / 32; ++b) {
      const int64_t at = (t * blocks + b) * kTile;
      const __m512 s = LoadScales(w.scale + at);
      const __m512 m = mins ? _mm512_loadu_ps(w.mins + at) : s;
      float* out = panel + kPanel * (32 * b - k0) + kTile * u;
      const uint8_t* q = w.qs + (t * blocks + b) * kBlockBytes;
#pragma GCC unroll 4
      for (int d = 0; d < 4; ++d) {
        const __m512i bytes = _mm512_loadu_si512(q + 64 * d);
#pragma GCC unroll 8
        for (int e = 0; e < 8; ++e) {  // value 16 h + 4 d + i
          const int i = e % 4, h = e / 4, shift = 8 * i + 4 * h;
          const __m512i n = shift ? _mm512_srli_epi32(bytes, shift) : bytes;
          // (n & 15) | 2^23's bits, less 2^23 (+ 8): n (- 8) exactly.
          const __m512 value = _mm512_sub_ps(
              _mm512_castsi512_ps(
                  _mm512_ternarylogic_epi32(n, low4, two23, 0xEA)),
              offset);
          _mm512_store_ps(out + kPanel * (16 * h + 4 * d + i),
                          mins ? _mm512_fmadd_ps(value, s, m)
                               : _mm512_mul_ps(value, s));
        }
      }
    }
  }
}

// y[r, 0 .. 16 V) (+)= Σ_k x[r, k] panel[k, 0 .. 16 V) for rows [0, R), k in
// [0, kc): the sums start from y unless `first`.
template <int R, int V>
void Rows(const float* x, int64_t K, int64_t kc, const float* panel,
          float* y, int64_t N, bool first) {
  __m512 c[R][V];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < V; ++u)
      c[r][u] = first ? _mm512_setzero_ps()
                      : _mm512_loadu_ps(y + r * N + kTile * u);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 b[V];
    for (int u = 0; u < V; ++u)
      b[u] = _mm512_load_ps(panel + kPanel * k + kTile * u);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
      for (int u = 0; u < V; ++u) c[r][u] = _mm512_fmadd_ps(a, b[u], c[r][u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < V; ++u)
      _mm512_storeu_ps(y + r * N + kTile * u, c[r][u]);
}

// Piece (n0, v, k0, kc) of the weight, fraction [i / parts, (i + 1) /
// parts) of its cache lines, prefetched into L2: the piece after the one
// the rows pass over, so that reading the weight from memory overlaps the
// multiply-adds.
template <typename S>
void Ahead(const Q4Tiles<S>& w, int64_t K, int64_t n0, int v, int64_t k0,
           int64_t kc, int64_t i, int64_t parts) {
  const int64_t blocks = K / 32, per_tile = kc / 32 * (kBlockBytes / 64);
  const int64_t lines = v * per_tile;
  for (int64_t l = i * lines / parts; l < (i + 1) * lines / parts; ++l) {
    const int64_t t = n0 / kTile + l / per_tile;
    _mm_prefetch(reinterpret_cast<const char*>(
                     w.qs + (t * blocks + k0 / 32) * kBlockBytes +
                     64 * (l % per_tile)),
                 _MM_HINT_T1);
    if (l % 4 == 0) {  // a block's scales (and mins) per its 4 lines
      const int64_t at = (t * blocks + k0 / 32 + l % per_tile / 4) * kTile;
      _mm_prefetch(reinterpret_cast<const char*>(w.scale + at), _MM_HINT_T1);
      if (w.mins)
        _mm_prefetch(reinterpret_cast<const char*>(w.mins + at), _MM_HINT_T1);
    }
  }
}

// Every row of the chunk over one panel piece, 8 at a time, each pass
// prefetching its share of the next piece (`next(i, parts)`).
template <int V, typename Next>
void AllRows(const float* x, int64_t rows, int64_t K, int64_t kc,
             const float* panel, float* y, int64_t N, bool first,
             const Next& next) {
  constexpr int kRows = 8;
  const int64_t passes = (rows + kRows - 1) / kRows;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    next(r / kRows, passes);
    Rows<kRows, V>(x + r * K, K, kc, panel, y + r * N, N, first);
  }
  if (r == rows) return;
  next(r / kRows, passes);
  const float* xr = x + r * K;
  float* yr = y + r * N;
  switch (rows - r) {
    case 1: Rows<1, V>(xr, K, kc, panel, yr, N, first); break;
    case 2: Rows<2, V>(xr, K, kc, panel, yr, N, first); break;
    case 3: Rows<3, V>(xr, K, kc, panel, yr, N, first); break;
    case 4: Rows<4, V>(xr, K, kc, panel, yr, N, first); break;
    case 5: Rows<5, V>(xr, K, kc, panel, yr, N, first); break;
    case 6: Rows<6, V>(xr, K, kc, panel, yr, N, first); break;
    default: Rows<7, V>(xr, K, kc, panel, yr, N, first); break;
  }
}

// Outputs of panels [p0, p1) of rows [0, rows) (x and y at the chunk's
// row), one piece of K_C values at a time.
template <typename W>
void Panels(const W& w, const float* x, int64_t rows, int64_t K, int64_t N,
            int64_t p0, int64_t p1, float* y) {
  alignas(64) thread_local float panel[kDepth * kPanel];
  const auto width = [N](int64_t p) {
    return int(std::min(kPanel, N - p * kPanel) / kTile);
  };
  // K in pieces of equal size (multiples of 32, at most kDepth).
  const int64_t pieces = (K + kDepth - 1) / kDepth;
  const int64_t depth = (K / 32 + pieces - 1) / pieces * 32;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanel;
    const int v = width(p);
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const int64_t kc = std::min(depth, K - k0);
      Pack(w, K, n0, v, k0, kc, panel);
      // The next piece: this panel's next values of K, else the next panel.
      const bool last = k0 + depth >= K;
      const int64_t pn = last ? p + 1 : p, kn = last ? 0 : k0 + depth;
      const auto next = [&](int64_t i, int64_t parts) {
        if (pn < p1)
          Ahead(w, K, pn * kPanel, width(pn), kn, std::min(depth, K - kn), i,
                parts);
      };
      const float* xk = x + k0;
      float* yn = y + n0;
      switch (v) {
        case 1: AllRows<1>(xk, rows, K, kc, panel, yn, N, k0 == 0, next); break;
        case 2: AllRows<2>(xk, rows, K, kc, panel, yn, N, k0 == 0, next); break;
        default: AllRows<3>(xk, rows, K, kc, panel, yn, N, k0 == 0, next); break;
      }
    }
  }
}
const char* Isa() { return "avx512"; }

#else

template <typename S>
float At(const Q4Tiles<S>& w, int64_t K, int64_t n, int64_t k) {
  constexpr bool mins = std::is_same_v<S, float>;
  const int64_t t = n / kTile, j = n % kTile, b = k / 32, value = k % 32;
  const int64_t h = value / 16, d = value % 16 / 4, i = value % 4;
  const uint8_t byte =
      w.qs[(t * (K / 32) + b) * kBlockBytes + 64 * d + 4 * j + i];
  const int q = (byte >> (4 * h)) & 15;
  const int64_t at = (t * (K / 32) + b) * kTile + j;
  if constexpr (mins) return std::fma(float(q), w.scale[at], w.mins[at]);
  else return float(q - 8) * F16ToF32(w.scale[at]);
}

template <typename W>
void Panels(const W& w, const float* x, int64_t rows, int64_t K, int64_t N,
            int64_t p0, int64_t p1, float* y) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = p0 * kPanel; n < std::min(N, p1 * kPanel); ++n) {
      float total = 0.f;
      for (int64_t k = 0; k < K; ++k)
        total = std::fma(x[r * K + k], At(w, K, n, k), total);
      y[r * N + n] = total;
    }
}
const char* Isa() { return "portable"; }

#endif

// y = x w^T (shapes checked by the handlers: N % 16 == 0, K % 32 == 0).
template <typename W>
void Run(ffi::ThreadPool& pool, const W& w, const float* x, int64_t R,
         int64_t K, int64_t N, float* y) {
  if (R == 0 || N == 0) return;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t parts = std::min<int64_t>(
      panels, kTilesPerThread * std::max<int64_t>(1, pool.num_threads()));
  const int64_t chunks = (R + kRowChunk - 1) / kRowChunk;
  PoolTiles(pool, chunks * parts, [&](int64_t item) {
    const int64_t r0 = item / parts * kRowChunk, part = item % parts;
    Panels(w, x + r0 * K, std::min(kRowChunk, R - r0), K, N,
           part * panels / parts, (part + 1) * panels / parts, y + r0 * N);
  });
}

ffi::Error Q4_0Gemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                    ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F16> scale,
                    ffi::ResultBuffer<ffi::F32> y) {
  if (!Q4TileShapes(x, qs, scale, y->dimensions()))
    return ffi::Error::InvalidArgument(
        "gemm q4_0 tiles: x [R, K] with K % 32 == 0, qs u8 [T, 8 K] and f16 "
        "scale [T, K / 2] (tiles of 16 outputs), y [R, 16 T]");
  const Q4Tiles<uint16_t> w{
      qs.typed_data(), reinterpret_cast<const uint16_t*>(scale.untyped_data()),
      nullptr};
  Run(pool, w, x.typed_data(), x.dimensions()[0], x.dimensions()[1],
      kTile * qs.dimensions()[0], y->typed_data());
  return ffi::Error::Success();
}

ffi::Error Q4_1Gemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                    ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F32> scale,
                    ffi::Buffer<ffi::F32> mins,
                    ffi::ResultBuffer<ffi::F32> y) {
  if (!Q4TileShapes(x, qs, scale, y->dimensions()) ||
      !(mins.dimensions() == scale.dimensions()))
    return ffi::Error::InvalidArgument(
        "gemm q4_1 tiles: x [R, K] with K % 32 == 0, qs u8 [T, 8 K], f32 "
        "scale and mins [T, K / 2] (tiles of 16 outputs), y [R, 16 T]");
  const Q4Tiles<float> w{qs.typed_data(), scale.typed_data(),
                         mins.typed_data()};
  Run(pool, w, x.typed_data(), x.dimensions()[0], x.dimensions()[1],
      kTile * qs.dimensions()[0], y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// Which code the 4-bit float GEMMs run in this build: "avx512" or "portable"
// (`ops.float_gemm`).
extern "C" const char* pzlm_float_gemm_isa() { return Isa(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_gemm_q4_0_tiles, Q4_0Gemm,
                              PZLM_PRODUCT_BINDING_2(ffi::U8, ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_gemm_q4_1_tiles, Q4_1Gemm,
                              PZLM_PRODUCT_BINDING_3(ffi::U8, ffi::F32,
                                                     ffi::F32));
