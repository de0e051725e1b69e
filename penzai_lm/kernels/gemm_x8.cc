// Prompt-sized products with int8 activations on Intel AMX tiles.
//
// matvec_x8.cc's products keep one output's K values in a vector's lanes:
// at decoding's few rows they stream the weights at memory speed, but a
// prompt's hundred rows make them compute-bound. Here the weights of 16
// outputs at a time are repacked into AMX's B-tile layout (group g: G / 4
// tile rows of 64 bytes, row i holding the values 4i..4i+3 of the group for
// each of the 16 outputs), and every 16 rows of quantized activations meet
// them in one `tdpbssd` per group of G values (G = 32, or 16 for q8_16's
// groups): a 16 x 16 tile of int32 sums, each scaled by its row's block
// scale d_x and its output's group scale, plus its output's group offset
// times the row's d_x * Σ q of that group, as in matvec_x8.cc. The weights
// are read in place, as the loaders keep them: the repacked strip (16 x K
// bytes) lives in a thread's scratch while all rows pass over it.
//
// Tiles: 0, 1 hold activations (16 rows x G bytes), 2, 3 weights (G / 4
// rows x 64 bytes), 4, 5 sums (16 x 16 int32); two groups are in flight at
// a time. Rows are padded to a multiple of 16 with zero rows, and a last
// strip of fewer than 16 outputs with zero weights and scales; neither is
// written out.
//
// Linux lends a process the tile registers only when it asks
// (arch_prctl(ARCH_REQ_XCOMP_PERM)); where the build has no AMX or the
// kernel refuses, Available() is false and the callers keep their own
// path.

#include "gemm_x8.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "q8_blocks.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && \
    defined(__AVX512F__) && defined(__linux__)
#define PZLM_AMX 1
#endif

namespace pzlm {
namespace gemm_x8 {

#if defined(PZLM_AMX)
namespace {

bool AskForTiles() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig Config(int G) {
  TileConfig c;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = G;
  for (int t : {2, 3}) c.rows[t] = G / 4, c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = 16, c.colsb[t] = 64;
  return c;
}

// x f32[R, K] quantized: q int8[Rp, K] (Rp: R rounded up to 16; zero rows
// past R), d f32[Rp, K / 32] the blocks' scales, sums f32[Rp, K / G] each
// group's d * Σ q.
struct Activations {
  int64_t R, Rp, K, G;
  std::vector<int8_t> q;
  std::vector<float> d, sums;

  Activations(const float* x, int64_t R_, int64_t K_, int64_t G_)
      : R(R_), Rp((R_ + 15) / 16 * 16), K(K_), G(G_), q(Rp * K, 0),
        d(Rp * (K / 32), 0.f), sums(Rp * (K / G), 0.f) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t b = 0; b < K / 32; ++b) {
        int32_t half[2];
        const float db = QuantizeBlock(x + r * K + 32 * b,
                                       q.data() + r * K + 32 * b, half);
        d[r * (K / 32) + b] = db;
        if (G == 32) {
          sums[r * (K / 32) + b] = db * float(half[0] + half[1]);
        } else {
          sums[r * (K / 16) + 2 * b] = db * float(half[0]);
          sums[r * (K / 16) + 2 * b + 1] = db * float(half[1]);
        }
      }
  }
};

// r[0..16) (rows of 16 dwords) transposed in place: r[j] becomes column j.
inline void Transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // s[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3.
  __m512i s[16];
  for (int i = 0; i < 4; ++i) {
    s[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    s[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    s[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    s[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i u0 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0x44);
    const __m512i u1 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
}

// The weights of outputs [n0, n0 + 16) in tile layout, with their scales
// and offsets per group ([group][16]).
struct Strip {
  std::vector<int8_t> b;
  std::vector<int8_t> rows;  // 4-bit outputs' values, unpacked: [16][K]
  std::vector<float> scale, mins;
  bool offsets = false;  // whether mins are to be added

  void Pack(const Weights& w, int64_t K, int64_t N, int64_t G, int64_t n0) {
    const int64_t groups = K / G;
    const int outs = int(std::min<int64_t>(16, N - n0));
    b.resize(16 * K);
    scale.assign(16 * groups, 0.f);
    mins.assign(16 * groups, 0.f);
    // The outputs' K values, row-major [16][K].
    const int8_t* values;
    // Q4_0's offsets are -8 scales (or not given: kQ4 without mins): then
    // its nibbles go in as q - 8 and the strip has no offsets to add.
    offsets = w.mins != nullptr;
    if (w.layout == Layout::kQ4) {
      bool centered = true;
      for (int o = 0; o < outs && centered && w.mins; ++o)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t at = (n0 + o) * groups + g;
          if (w.mins[at] != -8.f * w.scale[at]) {
            centered = false;
            break;
          }
        }
      offsets = !centered;
      const __m128i eight = _mm_set1_epi8(centered ? 8 : 0);
      rows.resize(16 * K);
      const __m128i low = _mm_set1_epi8(15);
      for (int o = 0; o < outs; ++o) {
        const uint8_t* p =
            static_cast<const uint8_t*>(w.qs) + (n0 + o) * (K / 2);
        int8_t* dst = rows.data() + o * K;
        for (int64_t blk = 0; blk < K / 32; ++blk) {  // ggml's nibble order
          const __m128i v = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(p + 16 * blk));
          _mm_storeu_si128(
              reinterpret_cast<__m128i*>(dst + 32 * blk),
              _mm_sub_epi8(_mm_and_si128(v, low), eight));
          _mm_storeu_si128(
              reinterpret_cast<__m128i*>(dst + 32 * blk + 16),
              _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), low), eight));
        }
      }
      values = rows.data();
    } else {
      values = static_cast<const int8_t*>(w.qs) + n0 * K;
    }
    // Value k of output o goes to tile row k / 4, bytes 4o + k % 4: 16 x 16
    // dwords at a time, transposed (K % 64 == 32: a last half chunk).
    for (int64_t k = 0; k < K; k += 64) {
      const int dwords = int(std::min<int64_t>(16, (K - k) / 4));
      const __mmask16 mask = __mmask16((1u << dwords) - 1);
      __m512i r[16];
      for (int o = 0; o < 16; ++o)
        r[o] = o < outs ? _mm512_maskz_loadu_epi32(mask, values + o * K + k)
                        : _mm512_setzero_si512();
      Transpose16(r);
      for (int j = 0; j < dwords; ++j)
        _mm512_storeu_si512(b.data() + (k / 4 + j) * 64, r[j]);
    }
    const bool channel = w.layout == Layout::kQ8Channel;
    for (int o = 0; o < outs; ++o) {
      const int64_t n = n0 + o;
      for (int64_t g = 0; g < groups; ++g) {
        scale[16 * g + o] = w.scale[channel ? n : n * groups + g];
        if (offsets) mins[16 * g + o] = w.mins[n * groups + g];
      }
    }
  }
};

// Prefetches part `part` of `parts` of the weights and factors of outputs
// [n0, n0 + 16) into L2: a strip read from memory while another strip's
// rows run, instead of stalling its packing.
inline void PrefetchStrip(const Weights& w, int64_t K, int64_t N, int64_t G,
                          int64_t n0, int64_t part, int64_t parts) {
  if (n0 >= N) return;
  const int64_t outs = std::min<int64_t>(16, N - n0);
  const int64_t row = w.layout == Layout::kQ4 ? K / 2 : K;
  const int64_t groups = w.layout == Layout::kQ8Channel ? 1 : K / G;
  const char* qs = static_cast<const char*>(w.qs) + n0 * row;
  const int64_t lines = (outs * row + 63) / 64;
  const int64_t per = (lines + parts - 1) / parts;
  for (int64_t l = part * per; l < std::min(lines, (part + 1) * per); ++l)
    _mm_prefetch(qs + 64 * l, _MM_HINT_T1);
  if (part == 0) {
    const int64_t factors = outs * groups * 4;
    for (int64_t b = 0; b < factors; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w.scale + n0 * groups) + b,
                   _MM_HINT_T1);
      if (w.mins)
        _mm_prefetch(reinterpret_cast<const char*>(w.mins + n0 * groups) + b,
                     _MM_HINT_T1);
    }
  }
}

// acc[r] += (the int32 tile c) * d_x[r] * scale + sums[r] * mins, for
// group g of rows [m0, m0 + 16).
template <bool kMins>
inline void Scale(const Activations& x, const Strip& s, const int32_t* c,
                  int64_t m0, int64_t g, __m512* acc) {
  const int64_t blocks = x.K / 32, groups = x.K / x.G;
  const __m512 dw = _mm512_loadu_ps(s.scale.data() + 16 * g);
  const float* dx = x.d.data() + m0 * blocks + g * x.G / 32;
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + 16 * r));
    acc[r] = _mm512_fmadd_ps(
        sums, _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * blocks])), acc[r]);
  }
  if (kMins) {
    const __m512 mw = _mm512_loadu_ps(s.mins.data() + 16 * g);
    const float* sx = x.sums.data() + m0 * groups + g;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sx[r * groups]), mw, acc[r]);
  }
}

// Rows [m0, m0 + 16) of the strip's outputs: first every group's tile of
// int32 sums into c (the tile unit's work, back to back, rotating over the
// tile registers so that one group's load does not wait on the last one's
// store), then their scaling (the vector units').
template <bool kMins>
void Rows(const Activations& x, const Strip& s, int32_t* c, float* y,
          int64_t N, int64_t n0, int64_t m0) {
  const int64_t K = x.K, G = x.G, groups = K / G;
  const int8_t* a = x.q.data() + m0 * K;
  const int8_t* b = s.b.data();
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    _tile_loadd(0, a + g * G, K);
    _tile_loadd(2, b + g * G * 16, 64);
    _tile_zero(4);
    _tile_dpbssd(4, 0, 2);
    _tile_loadd(1, a + (g + 1) * G, K);
    _tile_loadd(3, b + (g + 1) * G * 16, 64);
    _tile_zero(5);
    _tile_dpbssd(5, 1, 3);
    _tile_stored(4, c + 256 * g, 64);
    _tile_stored(5, c + 256 * (g + 1), 64);
  }
  if (g < groups) {
    _tile_loadd(0, a + g * G, K);
    _tile_loadd(2, b + g * G * 16, 64);
    _tile_zero(4);
    _tile_dpbssd(4, 0, 2);
    _tile_stored(4, c + 256 * g, 64);
  }
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (g = 0; g < groups; ++g) Scale<kMins>(x, s, c + 256 * g, m0, g, acc);
  const int outs = int(std::min<int64_t>(16, N - n0));
  const __mmask16 mask = __mmask16((1u << outs) - 1);
  for (int r = 0; r < 16 && m0 + r < x.R; ++r)
    _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, mask, acc[r]);
}

}  // namespace

bool Available() {
  static const bool ok = AskForTiles();
  return ok;
}

bool Product(ffi::ThreadPool& pool, const Weights& w, const float* x,
             float* y, int64_t R, int64_t K, int64_t N) {
  if (!Available()) return false;
  const int64_t G = w.layout == Layout::kQ8G16 ? 16 : 32;
  const Activations a(x, R, K, G);
  const TileConfig config = Config(int(G));
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  ParallelTiles(pool, (N + 15) / 16, [&](int64_t t) {
    thread_local Strip strip;
    thread_local std::vector<int32_t> sums;
    sums.resize(256 * (K / G));
    _tile_loadconfig(&config);
    strip.Pack(w, K, N, G, 16 * t);
    for (int64_t m0 = 0; m0 < a.Rp; m0 += 16) {
      // This thread's next strip, most likely (the tiles are dealt out in
      // order to the threads that ask).
      PrefetchStrip(w, K, N, G, 16 * (t + threads), m0 / 16, a.Rp / 16);
      if (strip.offsets)
        Rows<true>(a, strip, sums.data(), y, N, 16 * t, m0);
      else
        Rows<false>(a, strip, sums.data(), y, N, 16 * t, m0);
    }
    _tile_release();
  });
  return true;
}

#else  // no AMX in this build

bool Available() { return false; }

bool Product(ffi::ThreadPool&, const Weights&, const float*, float*, int64_t,
             int64_t, int64_t) {
  return false;
}

#endif

const char* Isa() { return Available() ? "amx" : "none"; }

}  // namespace gemm_x8
}  // namespace pzlm

extern "C" const char* pzlm_int8_gemm_isa() { return pzlm::gemm_x8::Isa(); }
