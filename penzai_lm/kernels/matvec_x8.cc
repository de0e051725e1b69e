// Quantized-weight products with int8 activations (llama.cpp's scheme on
// CPU), called through the XLA FFI.
//
// Each row of the activations x: f32[R, K] is quantized once per call to
// int8 blocks of 32 along K as llama.cpp's quantize_row_q8_0 does: d =
// max|x| / 127, q = rint(x * (1 / d)) in float32, and d kept as a float16
// (its block_q8_0.d), then the weights are dotted with it
// in integers, 64 bytes at a time (int8_dot.h: VNNI where the CPU has it),
// and each block's integer sum is scaled by d_w * d_x. Offsets (4-bit
// formats' mins, q8_16's per-group offsets) and the +128 of flipped int8
// weights (int8_dot.h) multiply the blocks' sums of the rounded x,
// d_x * Σ q (llama.cpp's q8_1, whose sums it rounds to float16 too; here
// they are exact, as the flipped weights need), folded into each step's
// lanes. So every product is the float product of the rounded activations
// q * d_x with the weights: it differs from matvec.cc's by the activations'
// rounding, at most d_x / 2 + 127 |d_x - d| <= 0.5625 d per value (d the
// unrounded scale), which the tests bound.
//
// A step is 64 bytes of one output's weights: 128 values of a 4-bit row
// (4 blocks of 32, each 16 bytes of nibbles: its values 0-15 in the low
// nibbles, 16-31 in the high ones, ggml's order) or 64 values of an int8
// row. The quantized activations are laid out per step to match, so a
// step costs one load, the nibble masks, one or two integer dots per row,
// a conversion and one multiply-add: for 4-bit weights the step's low
// nibbles meet the x values 0-15 of its 4 blocks and the high nibbles
// values 16-31, both summed into the same lanes (lanes 4j..4j+3: block j).
//
// Conventions as in matvec.cc (out-major quantized weights, K % 32 == 0):
//   q8:    qs s8[N, K], scale f32[N, K / 32] (q8_0) or f32[N, 1] (one
//          scale per output).
//   q4:    qs u8[N, K / 2], scale and mins f32[N, K / 32], ggml's nibble
//          order; q4_0: the same without mins (they are -8 scale).
//   q8_16: qs s8[N, K], scale and mins f32[N, K / 16].
// A row of x whose block holds a NaN or an infinity gives NaN outputs.

#include <cmath>
#include <vector>

#include "common.h"
#include "gemm_x8.h"
#include "int8_dot.h"
#include "q8_blocks.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary
using namespace pzlm::x8;  // NOLINT

// The cache lines of n floats at p (a row's scales or offsets: a stream
// of their own, short runs the hardware prefetchers miss).
inline void PrefetchFloats(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
  __builtin_prefetch(p + n - 1);
}

// How a format's step meets the activations: 4-bit steps take 128 values,
// the step's 4 blocks' values 0-15 then their values 16-31 ("split");
// int8 steps take 64 values in order.
enum class Order { kSplit, kPlain };

// The activations, quantized: per row, the int8 values laid out by steps
// (zeros past K) and, per step, two sets of 16 lane factors: `Lanes`, each
// lane's block's d_x, and `Sums`, the sums of the rounded values
// d_x * Σ q of each lane's block of 32 (split order) or group of 16
// (plain), divided by the lanes that share it (4), so that an offset per
// block or group times these lanes adds up to offset * d_x * Σ q.
class QuantizedX {
 public:
  QuantizedX(const float* x, int64_t R, int64_t K, Order order)
      : K_(K), order_(order),
        step_values_(order == Order::kSplit ? 128 : 64),
        steps_((K + step_values_ - 1) / step_values_),
        q_(R * steps_ * step_values_, 0), lanes_(R * steps_ * 16, 0.f),
        sums_(R * steps_ * 16, 0.f), totals_(R, 0.f) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t b = 0; b < K / 32; ++b) Block(x + r * K + 32 * b, r, b);
  }
  int64_t steps() const { return steps_; }
  int64_t K() const { return K_; }
  // Step s of row r: 64 or 128 bytes (Order::kSplit: the low half first).
  const int8_t* Q(int64_t r, int64_t s) const {
    return q_.data() + (r * steps_ + s) * step_values_;
  }
  Floats Lanes(int64_t r, int64_t s) const {
    return LoadFloats(lanes_.data() + (r * steps_ + s) * 16);
  }
  Floats Sums(int64_t r, int64_t s) const {
    return LoadFloats(sums_.data() + (r * steps_ + s) * 16);
  }
  // d_x * Σ q over the whole row.
  float Total(int64_t r) const { return totals_[r]; }

 private:
  void Block(const float* x, int64_t r, int64_t b) {
    int8_t q[32];
    int32_t half[2];
    const float d = QuantizeBlock(x, q, half);
    totals_[r] += d * float(half[0] + half[1]);
    // Where the block's values go, and its lanes in the step.
    const int64_t s = 32 * b / step_values_;
    const int64_t j = b - s * (step_values_ / 32);  // block within the step
    int8_t* step = q_.data() + (r * steps_ + s) * step_values_;
    float* lanes = lanes_.data() + (r * steps_ + s) * 16;
    float* sums = sums_.data() + (r * steps_ + s) * 16;
    if (order_ == Order::kSplit) {
      std::memcpy(step + 16 * j, q, 16);
      std::memcpy(step + 64 + 16 * j, q + 16, 16);
      for (int l = 0; l < 4; ++l) {
        lanes[4 * j + l] = d;
        sums[4 * j + l] = d * float(half[0] + half[1]) / 4;
      }
    } else {
      std::memcpy(step + 32 * j, q, 32);
      for (int l = 0; l < 8; ++l) {
        lanes[8 * j + l] = d;
        sums[8 * j + l] = d * float(half[l / 4]) / 4;
      }
    }
  }

  int64_t K_;
  Order order_;
  int64_t step_values_, steps_;
  std::vector<int8_t> q_;
  std::vector<float> lanes_, sums_, totals_;
};

// The per-row lane factors of one step, loaded once for every output;
// flip = -128 * sums (what flipped int8 weights take off), centered = -8 *
// sums (Q4_0's offsets, before its scale).
struct RowStep {
  Floats lanes, sums, flip, centered;
};

// A format: its step's weights decoded once per output (`Decode`), their
// factors (`Factors`), and how one row's integer dot with them adds to the
// output's lanes (`Add`). Then per output a final factor (`Final`) and a
// term per row (`RowTerm`) outside the lanes.

// int8 weights [N, K], read 64 values a step (flipped: int8_dot.h).
struct Int8Rows {
  static constexpr Order kOrder = Order::kPlain;
  const int8_t* qs;
  int64_t K;
  struct Decoded { Bytes w; };
  int64_t RowBytes() const { return K; }
  const uint8_t* Step(int64_t n, int64_t s) const {
    return reinterpret_cast<const uint8_t*>(qs + n * K + 64 * s);
  }
  Decoded Decode(const uint8_t* p, int valid_bytes) const {
    return {Signed(valid_bytes == 64 ? LoadBytes(p)
                                     : LoadBytesN(p, valid_bytes))};
  }
};

// int8 weights with one scale per block of 32 (q8_0), or per output
// (kChannel). Flipped weights (int8_dot.h) add 128 Σ x, taken off with
// -128 * the sums' lanes under the same scales.
template <bool kChannel>
struct Q8W : Int8Rows {
  const float* scale;
  struct Factors { Floats scale; };
  void PrefetchFactors(int64_t n) const {
    if (!kChannel) PrefetchFloats(scale + n * (K / 32), K / 32);
  }
  Factors Get(int64_t n, int64_t s, int valid_values) const {
    if (kChannel) return {NoFloats()};
    return {Spread<2>(scale + n * (K / 32) + 2 * s, valid_values / 32)};
  }
  Floats Add(Floats acc, const Decoded& w, const Factors& f, const int8_t* x,
             const RowStep& row) const {
    Floats dot = ToFloats(DotSigned(NoInts(), w.w, LoadBytes(x)));
    if (kChannel) return Fma(dot, row.lanes, acc);
    Floats t = kFlip ? Fma(dot, row.lanes, row.flip) : Mul(dot, row.lanes);
    return Fma(f.scale, t, acc);
  }
  float RowTerm(const QuantizedX& x, int64_t r) const {
    return kChannel && kFlip ? -128.f * x.Total(r) : 0.f;
  }
  float Final(int64_t n) const { return kChannel ? scale[n] : 1.f; }
};

// 4-bit weights: w = nibble * scale + min, blocks of 32. kCentered: Q4_0,
// whose min is -8 scale: the scale multiplies the dot less 8 times the
// block's sum of x (the row's `centered` lanes), and `mins` is not read.
template <bool kCentered>
struct Q4W {
  static constexpr Order kOrder = Order::kSplit;
  const uint8_t* qs;
  const float* scale;
  const float* mins;  // unused (may be null) where kCentered
  int64_t K;
  struct Decoded { Bytes low, high; };
  struct Factors { Floats scale, min; };
  int64_t RowBytes() const { return K / 2; }
  void PrefetchFactors(int64_t n) const {
    PrefetchFloats(scale + n * (K / 32), K / 32);
    if (!kCentered) PrefetchFloats(mins + n * (K / 32), K / 32);
  }
  const uint8_t* Step(int64_t n, int64_t s) const {
    return qs + n * (K / 2) + 64 * s;
  }
  Decoded Decode(const uint8_t* p, int valid_bytes) const {
    Bytes b = valid_bytes == 64 ? LoadBytes(p) : LoadBytesN(p, valid_bytes);
    return {Low4(b), High4(b)};
  }
  Factors Get(int64_t n, int64_t s, int valid_values) const {
    const int64_t at = n * (K / 32) + 4 * s;
    const Floats d = Spread<4>(scale + at, valid_values / 32);
    return {d, kCentered ? d : Spread<4>(mins + at, valid_values / 32)};
  }
  Floats Add(Floats acc, const Decoded& w, const Factors& f, const int8_t* x,
             const RowStep& row) const {
    Ints i = DotUS(DotUS(NoInts(), w.low, LoadBytes(x)), w.high,
                   LoadBytes(x + 64));
    if (kCentered)
      return Fma(f.scale, Fma(ToFloats(i), row.lanes, row.centered), acc);
    acc = Fma(f.scale, Mul(ToFloats(i), row.lanes), acc);
    return Fma(f.min, row.sums, acc);
  }
  float RowTerm(const QuantizedX&, int64_t) const { return 0.f; }
  float Final(int64_t) const { return 1.f; }
};

// int8 groups of 16, w = q * scale + min per group (the kept K-quants).
struct Q8G16W : Int8Rows {
  const float* scale;
  const float* mins;
  struct Factors { Floats scale, min; };
  void PrefetchFactors(int64_t n) const {
    PrefetchFloats(scale + n * (K / 16), K / 16);
    PrefetchFloats(mins + n * (K / 16), K / 16);
  }
  Factors Get(int64_t n, int64_t s, int valid_values) const {
    const int64_t at = n * (K / 16) + 4 * s;
    return {Spread<4>(scale + at, valid_values / 16),
            Spread<4>(mins + at, valid_values / 16)};
  }
  Floats Add(Floats acc, const Decoded& w, const Factors& f, const int8_t* x,
             const RowStep& row) const {
    Floats dot = ToFloats(DotSigned(NoInts(), w.w, LoadBytes(x)));
    Floats t = kFlip ? Fma(dot, row.lanes, row.flip) : Mul(dot, row.lanes);
    return Fma(f.min, row.sums, Fma(f.scale, t, acc));
  }
  float RowTerm(const QuantizedX&, int64_t) const { return 0.f; }
  float Final(int64_t) const { return 1.f; }
};

// One step s of outputs [n0, n0 + OUTS) and rows [r0, r0 + RB), added to
// acc; kTail: the last step, of `valid` values (< a whole step).
template <int RB, int OUTS, bool kTail, typename W>
inline void Step(const W& w, const QuantizedX& x, int64_t r0, int64_t n0,
                 int64_t s, int valid, Floats (&acc)[RB][OUTS]) {
  const int bytes = W::kOrder == Order::kSplit ? valid / 2 : valid;
  RowStep rows[RB];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) {
    const Floats sums = x.Sums(r0 + r, s);
    rows[r] = {x.Lanes(r0 + r, s), sums, Mul(sums, Splat(-128.f)),
               Mul(sums, Splat(-8.f))};
  }
#pragma GCC unroll 16
  for (int o = 0; o < OUTS; ++o) {
    const uint8_t* p = w.Step(n0 + o, s);
    if (!kTail) __builtin_prefetch(p + 2 * OUTS * w.RowBytes());
    const typename W::Decoded wv = w.Decode(p, kTail ? bytes : 64);
    const typename W::Factors f = w.Get(n0 + o, s, valid);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r)
      acc[r][o] = w.Add(acc[r][o], wv, f, x.Q(r0 + r, s), rows[r]);
  }
}

// Outputs [n0, n0 + OUTS) of rows [r0, r0 + RB).
template <int RB, int OUTS, typename W>
void Block(const W& w, const QuantizedX& x, float* y, int64_t N, int64_t r0,
           int64_t n0) {
  Floats acc[RB][OUTS];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int o = 0; o < OUTS; ++o) acc[r][o] = NoFloats();
  // The next outputs' factors, to be in cache when their block starts.
  for (int o = 0; o < OUTS; ++o) w.PrefetchFactors(n0 + OUTS + o);
  constexpr int kValues = W::kOrder == Order::kSplit ? 128 : 64;
  const int64_t whole = x.K() / kValues;
  for (int64_t s = 0; s < whole; ++s)
    Step<RB, OUTS, false>(w, x, r0, n0, s, kValues, acc);
  if (x.K() % kValues)
    Step<RB, OUTS, true>(w, x, r0, n0, whole, int(x.K() % kValues), acc);
  for (int r = 0; r < RB; ++r) {
    float total[OUTS];
    Totals<OUTS>(acc[r], total);
    const float term = w.RowTerm(x, r0 + r);
    for (int o = 0; o < OUTS; ++o)
      y[(r0 + r) * N + n0 + o] = (total[o] + term) * w.Final(n0 + o);
  }
}

// Blocks of kOuts outputs for several rows; a single row takes one output
// at a time, reading one run of weights front to back (matvec.cc): on an
// AMD EPYC (Zen 4) int8 and Q8_0 products at one row took 8.0-8.4 ms a
// SmolLM2 step against 10.0-10.8 in blocks of 4, 4-bit ones the same. With
// more rows the 4-bit products are compute-bound, and blocks of 4 won (8
// rows: 12.9-13.9 ms against 16.4-17.4). Each output's sum runs in the same
// order either way.
constexpr int kOuts = 4;
constexpr int kRowPass = 4;

template <int RB, typename W>
void Range(const W& w, const QuantizedX& x, float* y, int64_t N, int64_t r0,
           int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (RB > 1)
    for (; n + kOuts <= n1; n += kOuts) Block<RB, kOuts>(w, x, y, N, r0, n);
  for (; n < n1; ++n) Block<RB, 1>(w, x, y, N, r0, n);
}

template <typename W>
void Product(ffi::ThreadPool& pool, const W& w, const float* xf, float* y,
             int64_t R, int64_t K, int64_t N) {
  const QuantizedX x(xf, R, K, W::kOrder);
  ParallelOutputs(pool, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < R; r0 += kRowPass) {
      switch (std::min<int64_t>(kRowPass, R - r0)) {
        case 1: Range<1>(w, x, y, N, r0, n0, n1); break;
        case 2: Range<2>(w, x, y, N, r0, n0, n1); break;
        case 3: Range<3>(w, x, y, N, r0, n0, n1); break;
        default: Range<4>(w, x, y, N, r0, n0, n1); break;
      }
    }
  });
}

// Prompt-sized products go to the AMX tiles where this build and process
// have them (gemm_x8.cc); true if they did.
bool OnTiles(ffi::ThreadPool& pool, const gemm_x8::Weights& w,
             const float* x, float* y, int64_t R, int64_t K, int64_t N) {
  return R >= gemm_x8::kGemmRows && gemm_x8::Product(pool, w, x, y, R, K, N);
}

ffi::Error Q8X8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                ffi::Buffer<ffi::S8> qs, ffi::Buffer<ffi::F32> scale,
                ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = qs.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [R, K]");
  const int64_t R = xd[0], K = xd[1];
  if (K % 32 != 0 || qd.size() != 2 || qd[1] != K || sd.size() != 2 ||
      sd[0] != qd[0] || (sd[1] != 1 && sd[1] * 32 != K))
    return ffi::Error::InvalidArgument(
        "q8_x8: K % 32 == 0, qs [N, K], scale [N, K / 32] or [N, 1]");
  const gemm_x8::Layout layout =
      sd[1] == 1 ? gemm_x8::Layout::kQ8Channel : gemm_x8::Layout::kQ8;
  if (OnTiles(pool, {layout, qs.typed_data(), scale.typed_data(), nullptr},
              x.typed_data(), y->typed_data(), R, K, qd[0]))
    return ffi::Error::Success();
  if (sd[1] == 1) {
    Q8W<true> w{{qs.typed_data(), K}, scale.typed_data()};
    Product(pool, w, x.typed_data(), y->typed_data(), R, K, qd[0]);
  } else {
    Q8W<false> w{{qs.typed_data(), K}, scale.typed_data()};
    Product(pool, w, x.typed_data(), y->typed_data(), R, K, qd[0]);
  }
  return ffi::Error::Success();
}

// The 4-bit products; mins null: Q4_0, whose offsets (-8 scales) are
// derived (on the tiles the nibbles go in as q - 8).
template <bool kCentered>
void Q4Product(ffi::ThreadPool& pool, const float* x, const uint8_t* qs,
               const float* scale, const float* mins, float* y, int64_t R,
               int64_t K, int64_t N) {
  if (OnTiles(pool, {gemm_x8::Layout::kQ4, qs, scale, mins}, x, y, R, K, N))
    return;
  Product(pool, Q4W<kCentered>{qs, scale, mins, K}, x, y, R, K, N);
}

ffi::Error Q4X8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F32> scale,
                ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y) {
  if (!Q4Shapes(x, qs, scale) ||
      !(mins.dimensions() == scale.dimensions()))
    return ffi::Error::InvalidArgument(
        "q4_x8: x [R, K], K % 32 == 0, qs [N, K / 2], scale and mins"
        " [N, K / 32]");
  Q4Product<false>(pool, x.typed_data(), qs.typed_data(), scale.typed_data(),
                   mins.typed_data(), y->typed_data(), x.dimensions()[0],
                   x.dimensions()[1], qs.dimensions()[0]);
  return ffi::Error::Success();
}

ffi::Error Q4CenteredX8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F32> scale,
                        ffi::ResultBuffer<ffi::F32> y) {
  if (!Q4Shapes(x, qs, scale))
    return ffi::Error::InvalidArgument(
        "q4_0_x8: x [R, K], K % 32 == 0, qs [N, K / 2], scale [N, K / 32]");
  Q4Product<true>(pool, x.typed_data(), qs.typed_data(), scale.typed_data(),
                  nullptr, y->typed_data(), x.dimensions()[0],
                  x.dimensions()[1], qs.dimensions()[0]);
  return ffi::Error::Success();
}

ffi::Error Q8G16X8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                   ffi::Buffer<ffi::S8> qs, ffi::Buffer<ffi::F32> scale,
                   ffi::Buffer<ffi::F32> mins,
                   ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = qs.dimensions(), sd = scale.dimensions(),
       md = mins.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [R, K]");
  const int64_t R = xd[0], K = xd[1];
  if (K % 32 != 0 || qd.size() != 2 || qd[1] != K || sd.size() != 2 ||
      sd[0] != qd[0] || sd[1] * 16 != K || md.size() != 2 || md[0] != sd[0] ||
      md[1] != sd[1])
    return ffi::Error::InvalidArgument(
        "q8_16_x8: K % 32 == 0, qs [N, K], scale and mins [N, K / 16]");
  if (OnTiles(pool, {gemm_x8::Layout::kQ8G16, qs.typed_data(),
                     scale.typed_data(), mins.typed_data()},
              x.typed_data(), y->typed_data(), R, K, qd[0]))
    return ffi::Error::Success();
  Q8G16W w{{qs.typed_data(), K}, scale.typed_data(), mins.typed_data()};
  Product(pool, w, x.typed_data(), y->typed_data(), R, K, qd[0]);
  return ffi::Error::Success();
}

}  // namespace

// The instructions the int8 products use in this build (int8_dot.h).
extern "C" const char* pzlm_int8_dot_isa() { return pzlm::x8::Isa(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q8_x8, Q8X8,
                              PZLM_PRODUCT_BINDING_2(ffi::S8, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_matvec_q4_x8, Q4X8,
    PZLM_PRODUCT_BINDING_3(ffi::U8, ffi::F32, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_matvec_q8_16_x8, Q8G16X8,
    PZLM_PRODUCT_BINDING_3(ffi::S8, ffi::F32, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q4_0_x8, Q4CenteredX8,
                              PZLM_PRODUCT_BINDING_2(ffi::U8, ffi::F32));
