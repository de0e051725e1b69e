// Q4_0, Q8_0, Q4_1, Q5_0 and q8_16 products with int8 activations, on
// weights repacked in tiles of 16 outputs (as llama.cpp repacks them for its CPU products),
// called through the XLA FFI.
//
// Why: in the out-major layout (matvec_x8.cc) a 64-byte step holds 4
// blocks of one output (2 of int8), so every step converts its integer
// sums, spreads the blocks' scales across the lanes and takes two
// multiply-adds, and every output ends in a sum across lanes. In a tile,
// lane j of every vector belongs to output j: a block of 32 values of 16
// outputs is 4 loads (8 of int8) and 8 integer dots against broadcast
// activations, then one conversion and two multiply-adds for all 16
// outputs, no sums across lanes, and a thread reads its tiles as one
// stream. Measured in docs/cpu-speed.md.
//
// Layout (`penzai_lm.kernels.tiles` writes it; T = N / 16 tiles, tile t
// holds outputs 16 t .. 16 t + 15, lane j output 16 t + j; P bytes a block
// of 32 values: 16 for Q4_0 and Q4_1, 32 for Q8_0 and q8_16, 20 for Q5_0):
//   qs:    u8 (Q4_0, Q4_1, Q5_0) or s8 (Q8_0, q8_16) [T, K / 32 * 16 P]: byte
//          16 P b + 64 d + 4 j + i of tile t is byte 4 d + i of block b of
//          output 16 t + j (4-bit values in ggml's nibble order: the low
//          nibble is value 4 d + i of the block, the high nibble value
//          16 + 4 d + i; Q5_0's 5th bits in its last 4 bytes, d = 4: bit e
//          of byte i is the 5th bit of value 4 e + i);
//   scale: f16[T, K / 32 * 16]: 16 b + j is block b's scale of output
//          16 t + j (the formats' scales are float16s: 18 bytes a block of
//          Q4_0, 34 of Q8_0, as in llama.cpp's files); Q4_1's f32 (its
//          rows from Q4_K blocks hold products of two scales); q8_16's
//          f32[T, K / 16 * 16], one a group of 16 values;
//   mins:  Q4_1 and q8_16 only, f32, laid out as scale.
// Q4_0: w = (nibble - 8) * scale; Q8_0: w = q * scale; Q4_1: w = nibble *
// scale + min; Q5_0: w = (5-bit value - 16) * scale; q8_16 (K-quants
// kept): w = q * scale + min, per group of 16.
//
// The activations are quantized as matvec_x8.cc quantizes them (llama.cpp's
// quantize_row_q8_0), so the product is the float product of the rounded
// activations with the weights, as there; the two differ only in the order
// of the float sums. A row of x whose block holds a NaN or an infinity gives
// NaN outputs.

#include <vector>

#include "common.h"
#include "int8_dot.h"
#include "q8_blocks.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary
using namespace pzlm::x8;  // NOLINT

constexpr int64_t kOutputs = 16;  // outputs per tile (lanes)
constexpr int64_t kRowPass = 4;   // rows per pass over a chunk of tiles
constexpr int64_t kChunk = 4;     // tiles whose weights serve every pass
constexpr int64_t kAhead = 4;     // blocks prefetched ahead

// The formats: a block of a tile is kDwords 64-byte vectors of weights,
// which `Decode` makes into 8 vectors, vector e meeting the activations'
// bytes 4 e .. 4 e + 3 of the block; `kOffset` times d_x Σ q is what the
// block's dot takes off (Q4_0: its offsets, -8 scale; Q8_0 with flipped
// weights, int8_dot.h: the 128 Σ q they add); with `kMins` the block's
// offsets multiply d_x Σ q. `kGroups` scales (and offsets) a block: 2 for
// q8_16, whose groups are values 0-15 and 16-31. `S` is a scale's type
// (float16 bits or float).
inline Floats LoadScales(const uint16_t* p) { return LoadHalves(p); }
inline Floats LoadScales(const float* p) { return LoadFloats(p); }

struct Q4_0 {
  using S = uint16_t;
  static constexpr bool kMins = false;
  static constexpr int kGroups = 1;
  static constexpr int kDwords = 4;
  static constexpr float kOffset = -8.f;
  static void Decode(const uint8_t* p, Bytes (&v)[8]) {
#pragma GCC unroll 4
    for (int d = 0; d < 4; ++d) {
      const Bytes w = LoadBytes(p + 64 * d);
      v[d] = Low4(w);  // values 4 d .. 4 d + 3
      v[4 + d] = High4(w);  // values 16 + 4 d ..
    }
  }
  static Ints Dot(Ints acc, Bytes w, Bytes x) { return DotUS(acc, w, x); }
};
struct Q4_1 : Q4_0 {
  using S = float;
  static constexpr bool kMins = true;
  static constexpr float kOffset = 1.f;
};
struct Q5_0 : Q4_0 {  // Q4_0's nibbles, then a vector of 5th bits
  static constexpr int kDwords = 5;
  static constexpr float kOffset = -16.f;
  static void Decode(const uint8_t* p, Bytes (&v)[8]) {
    Q4_0::Decode(p, v);
    const Bytes high = LoadBytes(p + 256);
#pragma GCC unroll 8
    for (int e = 0; e < 8; ++e) v[e] = WithBit4(v[e], high, e);
  }
};
struct Q8_0 {
  using S = uint16_t;
  static constexpr bool kMins = false;
  static constexpr int kGroups = 1;
  static constexpr int kDwords = 8;
  static constexpr float kOffset = kFlip ? -128.f : 0.f;
  static void Decode(const uint8_t* p, Bytes (&v)[8]) {
#pragma GCC unroll 8
    for (int d = 0; d < 8; ++d) v[d] = Signed(LoadBytes(p + 64 * d));
  }
  static Ints Dot(Ints acc, Bytes w, Bytes x) { return DotSigned(acc, w, x); }
};
struct Q8_16 : Q8_0 {
  using S = float;
  static constexpr bool kMins = true;
  static constexpr int kGroups = 2;
};

// Each row of x quantized per block of 32: the values in order, d, the
// format's offset times d Σ q, and d Σ q of each half (exact: d is a
// float16 and |Σ q| <= 4064).
class QuantizedRows {
 public:
  QuantizedRows(const float* x, int64_t R, int64_t K, float offset)
      : blocks_(K / 32), q_(R * K), d_(R * blocks_), c_(R * blocks_),
        h_(2 * R * blocks_) {
    for (int64_t i = 0; i < R * blocks_; ++i) {
      int32_t half[2];
      d_[i] = QuantizeBlock(x + 32 * i, q_.data() + 32 * i, half);
      c_[i] = offset * d_[i] * float(half[0] + half[1]);
      h_[2 * i] = d_[i] * float(half[0]);
      h_[2 * i + 1] = d_[i] * float(half[1]);
    }
  }
  // d Σ q over values 16 g .. 16 g + 15 of block b.
  float H(int64_t r, int64_t b, int g) const {
    return h_[2 * (r * blocks_ + b) + g];
  }
  const int8_t* Q(int64_t r, int64_t b) const {
    return q_.data() + 32 * (r * blocks_ + b);
  }
  float D(int64_t r, int64_t b) const { return d_[r * blocks_ + b]; }
  float C(int64_t r, int64_t b) const { return c_[r * blocks_ + b]; }

 private:
  int64_t blocks_;
  std::vector<int8_t> q_;
  std::vector<float> d_, c_, h_;
};

// Tile t's 16 outputs of rows [r0, r0 + RB), written to y [R, 16 T].
template <typename F>
struct Weights {
  const uint8_t* qs;
  const typename F::S* scale;
  const float* mins;  // Q4_1's, else null
};

template <typename F, int RB>
void Tile(const Weights<F>& w, const QuantizedRows& x, int64_t blocks,
          int64_t t, int64_t r0, float* y, int64_t N) {
  constexpr int64_t kBlockBytes = 64 * F::kDwords;
  constexpr int64_t kScales = kOutputs * F::kGroups;  // a block's
  const uint8_t* p = w.qs + t * blocks * kBlockBytes;
  const typename F::S* s = w.scale + t * blocks * kScales;
  const float* m = F::kMins ? w.mins + t * blocks * kScales : nullptr;
  Floats acc[RB];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) acc[r] = NoFloats();
  for (int64_t b = 0; b < blocks;
       ++b, p += kBlockBytes, s += kScales, m += F::kMins ? kScales : 0) {
    // Past the tile's end is the next tile's start (or a line unused).
#pragma GCC unroll 8
    for (int l = 0; l < F::kDwords; ++l)
      __builtin_prefetch(p + kAhead * kBlockBytes + 64 * l);
    for (int g = 0; g < F::kGroups; ++g) {
      __builtin_prefetch(s + kAhead * kScales + kOutputs * g);
      if constexpr (F::kMins)
        __builtin_prefetch(m + kAhead * kScales + kOutputs * g);
    }
    Bytes v[8];
    F::Decode(p, v);
    if constexpr (F::kGroups == 2) {  // q8_16: values 0-15, then 16-31
      const Floats s0 = LoadScales(s), s1 = LoadScales(s + kOutputs);
      const Floats m0 = LoadFloats(m), m1 = LoadFloats(m + kOutputs);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const int8_t* q = x.Q(r0 + r, b);
        Ints i0 = NoInts(), i1 = NoInts();
#pragma GCC unroll 4
        for (int e = 0; e < 4; ++e) {
          i0 = F::Dot(i0, v[e], Broadcast4(q + 4 * e));
          i1 = F::Dot(i1, v[4 + e], Broadcast4(q + 16 + 4 * e));
        }
        const Floats d = Splat(x.D(r0 + r, b));
        const float h0 = x.H(r0 + r, b, 0), h1 = x.H(r0 + r, b, 1);
        acc[r] = Fma(s0, Fma(ToFloats(i0), d, Splat(F::kOffset * h0)),
                     acc[r]);
        acc[r] = Fma(s1, Fma(ToFloats(i1), d, Splat(F::kOffset * h1)),
                     acc[r]);
        acc[r] = Fma(m0, Splat(h0), Fma(m1, Splat(h1), acc[r]));
      }
      continue;
    }
    const Floats scales = LoadScales(s);
    Floats offsets = NoFloats();
    if constexpr (F::kMins) offsets = LoadFloats(m);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const int8_t* q = x.Q(r0 + r, b);
      Ints i0 = NoInts(), i1 = NoInts();
#pragma GCC unroll 4
      for (int e = 0; e < 8; e += 2) {
        i0 = F::Dot(i0, v[e], Broadcast4(q + 4 * e));
        i1 = F::Dot(i1, v[e + 1], Broadcast4(q + 4 * e + 4));
      }
      const Floats dot = Add(ToFloats(i0), ToFloats(i1));
      if constexpr (F::kMins) {
        acc[r] = Fma(scales, Mul(dot, Splat(x.D(r0 + r, b))), acc[r]);
        acc[r] = Fma(offsets, Splat(x.C(r0 + r, b)), acc[r]);
      } else {
        const Floats t = Fma(dot, Splat(x.D(r0 + r, b)),
                             Splat(x.C(r0 + r, b)));
        acc[r] = Fma(scales, t, acc[r]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    StoreFloats(y + (r0 + r) * N + kOutputs * t, acc[r]);
}

// Tiles [t0, t1) of every row, in chunks whose weights stay in cache over
// the passes of 4 rows.
template <typename F>
void Tiles(const Weights<F>& w, const QuantizedRows& x, int64_t R,
           int64_t blocks, int64_t t0, int64_t t1, float* y, int64_t N) {
  for (int64_t c = t0; c < t1; c += kChunk) {
    const int64_t c1 = std::min(t1, c + kChunk);
    for (int64_t r0 = 0; r0 < R; r0 += kRowPass) {
      for (int64_t t = c; t < c1; ++t) {
        switch (std::min(kRowPass, R - r0)) {
          case 1: Tile<F, 1>(w, x, blocks, t, r0, y, N); break;
          case 2: Tile<F, 2>(w, x, blocks, t, r0, y, N); break;
          case 3: Tile<F, 3>(w, x, blocks, t, r0, y, N); break;
          default: Tile<F, 4>(w, x, blocks, t, r0, y, N); break;
        }
      }
    }
  }
}

// y = x w^T for w in tiles (validated by the handlers below).
template <typename F>
void Run(ffi::ThreadPool& pool, const float* x, int64_t R, int64_t K,
         const Weights<F>& w, int64_t T, float* y) {
  const QuantizedRows rows(x, R, K, F::kOffset);
  // Two runs of tiles per thread (as ParallelOutputs hands out outputs).
  const int64_t parts = std::min<int64_t>(
      T, kTilesPerThread * std::max<int64_t>(1, pool.num_threads()));
  const auto body = [&](int64_t part) {
    Tiles<F>(w, rows, R, K / 32, part * T / parts, (part + 1) * T / parts, y,
             kOutputs * T);
  };
  // A prompt's products on XLA's own threads (`PoolTiles`), a decode
  // step's on the kernels' workers, which start sooner on short calls.
  if (R > kPromptRows)
    PoolTiles(pool, parts, body);
  else
    ParallelTiles(pool, parts, body);
}

// Whether x [R, K] (K % 32 == 0), qs [T, 2 kDwords K], scale [T, kGroups
// K / 2] and y [R, 16 T] are a product of format F in tiles.
template <typename F, typename Dims>
bool Fits(const Dims& xd, const Dims& qd, const Dims& sd, const Dims& yd) {
  return xd.size() == 2 && xd[1] % 32 == 0 && qd.size() == 2 &&
         qd[1] == 2 * F::kDwords * xd[1] && sd.size() == 2 &&
         sd[0] == qd[0] && 2 * sd[1] == F::kGroups * xd[1] &&
         yd.size() == 2 && yd[0] == xd[0] && yd[1] == kOutputs * qd[0];
}

template <typename F, ffi::DataType Q>
ffi::Error Product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                   ffi::Buffer<Q> qs, ffi::Buffer<ffi::F16> scale,
                   ffi::ResultBuffer<ffi::F32> y) {
  if (!Fits<F>(x.dimensions(), qs.dimensions(), scale.dimensions(),
               y->dimensions()))
    return ffi::Error::InvalidArgument(
        "tiles: x [R, K] with K % 32 == 0, qs [T, 8 K] (Q4_0), [T, 16 K] "
        "(Q8_0) or [T, 10 K] (Q5_0) and f16 scale [T, K / 2] (tiles of 16 "
        "outputs), y [R, 16 T]");
  const Weights<F> w{reinterpret_cast<const uint8_t*>(qs.untyped_data()),
                     reinterpret_cast<const uint16_t*>(scale.untyped_data()),
                     nullptr};
  Run<F>(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], w,
         qs.dimensions()[0], y->typed_data());
  return ffi::Error::Success();
}

// Q4_1 and q8_16: float32 scales and offsets, K / 2 (Q4_1) or K (q8_16)
// of each a tile.
template <typename F, ffi::DataType Q>
ffi::Error ProductMins(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<Q> qs, ffi::Buffer<ffi::F32> scale,
                       ffi::Buffer<ffi::F32> mins,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto sd = scale.dimensions(), md = mins.dimensions();
  if (!Fits<F>(x.dimensions(), qs.dimensions(), sd, y->dimensions()) ||
      md.size() != 2 || md[0] != sd[0] || md[1] != sd[1])
    return ffi::Error::InvalidArgument(
        "tiles: x [R, K] with K % 32 == 0, qs [T, 8 K] (Q4_1) or [T, 16 K] "
        "(q8_16), f32 scale and mins [T, K / 2] (Q4_1) or [T, K] (q8_16) "
        "(tiles of 16 outputs), y [R, 16 T]");
  const Weights<F> w{reinterpret_cast<const uint8_t*>(qs.untyped_data()),
                     scale.typed_data(), mins.typed_data()};
  Run<F>(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], w,
         qs.dimensions()[0], y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q4_0_x8_tiles,
                              (Product<Q4_0, ffi::U8>),
                              PZLM_PRODUCT_BINDING_2(ffi::U8, ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q8_0_x8_tiles,
                              (Product<Q8_0, ffi::S8>),
                              PZLM_PRODUCT_BINDING_2(ffi::S8, ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q5_0_x8_tiles,
                              (Product<Q5_0, ffi::U8>),
                              PZLM_PRODUCT_BINDING_2(ffi::U8, ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q4_1_x8_tiles,
                              (ProductMins<Q4_1, ffi::U8>),
                              PZLM_PRODUCT_BINDING_3(ffi::U8, ffi::F32,
                                                     ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q8_16_x8_tiles,
                              (ProductMins<Q8_16, ffi::S8>),
                              PZLM_PRODUCT_BINDING_3(ffi::S8, ffi::F32,
                                                     ffi::F32));
