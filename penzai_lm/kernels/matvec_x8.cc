// Quantized-weight products with int8 activations (llama.cpp's scheme on
// CPU), called through the XLA FFI.
//
// Each row of the activations x: f32[R, K] is quantized once per call to
// int8 blocks of 32 along K (q8_0's rule: d = max|x| / 127, q = rint(x / d),
// computed as x * (1 / d) in float32), then every block of weights is
// dotted with it in integers (int8_dot.h: VNNI where the CPU has it) and
// the block's sum scaled by d_w * d_x; 4-bit weights' offsets multiply the
// block's sum of the rounded x, d_x * Σ q (llama.cpp's q8_1). So every
// product is the float product of the rounded activations q * d_x with the
// weights: it differs from matvec.cc's by the activations' rounding, at
// most d_x / 2 = max|x| / 254 per value, which the tests bound.
//
// Conventions as in matvec.cc (out-major quantized weights, K % 32 == 0):
//   q8:  qs s8[N, K], scale f32[N, K / 32] (q8_0) or f32[N, 1] (one scale
//        per output).
//   q4:  qs u8[N, K / 2], scale and mins f32[N, K / 32], ggml's nibble
//        order.
// A row of x whose block holds a NaN or an infinity gives NaN outputs.

#include <cmath>
#include <vector>

#include "common.h"
#include "int8_dot.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary
using namespace pzlm::x8;  // NOLINT

// The activations, quantized: per row, K int8 values (zeros past K, up to a
// whole step of 64), and per block of 32 the sum of its rounded values
// s = d * Σ q and its scale d on the block's 8 lanes of a step (dl: 16
// floats per step).
struct QuantizedX {
  int64_t R, K, steps;
  std::vector<int8_t> q;
  std::vector<float> s, dl;

  QuantizedX(const float* x, int64_t R_, int64_t K_)
      : R(R_), K(K_), steps((K_ + 63) / 64), q(R_ * steps * 64, 0),
        s(R_ * steps * 2, 0.f), dl(R_ * steps * 16, 0.f) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t b = 0; b < K / 32; ++b) Block(x + r * K + 32 * b, r, b);
    }
  }
  const int8_t* Q(int64_t r, int64_t step) const {
    return q.data() + (r * steps + step) * 64;
  }
  const float* Lanes(int64_t r, int64_t step) const {
    return dl.data() + (r * steps + step) * 16;
  }
  const float* Sums(int64_t r) const { return s.data() + r * steps * 2; }

 private:
  void Block(const float* x, int64_t r, int64_t b) {
    float amax = 0.f;
    bool finite = true;
    for (int j = 0; j < 32; ++j) {
      finite = finite && std::isfinite(x[j]);
      amax = std::max(amax, std::fabs(x[j]));
    }
    const float db = finite ? amax / 127.f : NAN;
    const float inv = finite && amax > 0.f ? 1.f / db : 0.f;
    int8_t* qb = q.data() + r * steps * 64 + 32 * b;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      float v = std::nearbyint(x[j] * inv);
      qb[j] = int8_t(std::min(127.f, std::max(-127.f, v)));
      sum += qb[j];
    }
    s[r * steps * 2 + b] = db * float(sum);
    float* lanes = dl.data() + r * steps * 16 + 8 * b;
    for (int j = 0; j < 8; ++j) lanes[j] = db;
  }
};

// int8 weights, q8_0 blocks (blocks == K / 32) or one scale per output
// (blocks == 1).
struct Q8W {
  const int8_t* qs;
  const float* scale;
  int64_t K, blocks;
  static constexpr int kBytesPerStep = 64;
  int64_t RowBytes() const { return K; }
  const uint8_t* Step(int64_t n, int64_t step) const {
    return reinterpret_cast<const uint8_t*>(qs + n * K + 64 * step);
  }
  // The step's lanes' weight scales (1 for per-output scales).
  Floats Scales(int64_t n, int64_t step, int64_t valid_blocks) const {
    if (blocks == 1) return BlockLanes(kOnes);
    const float* p = scale + n * blocks + 2 * step;
    if (valid_blocks == 2) return BlockLanes(p);
    const float t[2] = {p[0], 0.f};
    return BlockLanes(t);
  }
  Floats Dot(SignedBytes w, Bytes x) const { return DotS8(w, x); }
  SignedBytes Decode(const uint8_t* p) const { return Split(LoadBytes(p)); }
  float Offset(int64_t, const QuantizedX&, int64_t) const { return 0.f; }
  float Final(int64_t n) const { return blocks == 1 ? scale[n] : 1.f; }
  static constexpr float kOnes[2] = {1.f, 1.f};
};

// 4-bit weights: w = nibble * scale + min, blocks of 32.
struct Q4W {
  const uint8_t* qs;
  const float* scale;
  const float* mins;
  int64_t K;
  static constexpr int kBytesPerStep = 32;
  int64_t RowBytes() const { return K / 2; }
  const uint8_t* Step(int64_t n, int64_t step) const {
    return qs + n * (K / 2) + 32 * step;
  }
  Floats Scales(int64_t n, int64_t step, int64_t valid_blocks) const {
    const float* p = scale + n * (K / 32) + 2 * step;
    if (valid_blocks == 2) return BlockLanes(p);
    const float t[2] = {p[0], 0.f};
    return BlockLanes(t);
  }
  Floats Dot(Bytes w, Bytes x) const { return DotU4(w, x); }
  Bytes Decode(const uint8_t* p) const { return Nibbles(p); }
  // Σ_b min[n, b] * s[r, b] (the rounded x's block sums).
  float Offset(int64_t n, const QuantizedX& x, int64_t r) const {
    const float* m = mins + n * (K / 32);
    const float* s = x.Sums(r);
    float t = 0.f;
    for (int64_t b = 0; b < K / 32; ++b) t += m[b] * s[b];
    return t;
  }
  float Final(int64_t) const { return 1.f; }
};

// Outputs [n0, n0 + OUTS) of rows [r0, r0 + RB).
template <int RB, int OUTS, typename W>
void Block(const W& w, const QuantizedX& x, float* y, int64_t N, int64_t r0,
           int64_t n0) {
  Floats acc[RB][OUTS];
  for (auto& a : acc) for (auto& b : a) b = Zero();
  const int64_t whole = x.K / 64;
  for (int64_t step = 0; step < x.steps; ++step) {
    decltype(w.Decode(nullptr)) wv[OUTS];
    Floats ws[OUTS];
    for (int o = 0; o < OUTS; ++o) {
      const uint8_t* p = w.Step(n0 + o, step);
      if (step < whole) {
        __builtin_prefetch(p + 2 * OUTS * w.RowBytes());
        wv[o] = w.Decode(p);
        ws[o] = w.Scales(n0 + o, step, 2);
      } else {  // Half a step: the last block, padded with zeros.
        alignas(64) uint8_t pad[64] = {};
        std::memcpy(pad, p, W::kBytesPerStep / 2);
        wv[o] = w.Decode(pad);
        ws[o] = w.Scales(n0 + o, step, 1);
      }
    }
    for (int r = 0; r < RB; ++r) {
      Bytes xv = LoadBytes(x.Q(r0 + r, step));
      Floats xd = LoadFloats(x.Lanes(r0 + r, step));
      for (int o = 0; o < OUTS; ++o) {
        acc[r][o] = Fma(w.Dot(wv[o], xv), Mul(ws[o], xd), acc[r][o]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int o = 0; o < OUTS; ++o) {
      y[(r0 + r) * N + n0 + o] = Total(acc[r][o]) * w.Final(n0 + o) +
                                 w.Offset(n0 + o, x, r0 + r);
    }
  }
}

constexpr int kOuts = 4;
constexpr int kRowPass = 4;

template <int RB, typename W>
void Range(const W& w, const QuantizedX& x, float* y, int64_t N, int64_t r0,
           int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kOuts <= n1; n += kOuts) Block<RB, kOuts>(w, x, y, N, r0, n);
  for (; n < n1; ++n) Block<RB, 1>(w, x, y, N, r0, n);
}

template <typename W>
void Product(ffi::ThreadPool& pool, const W& w, const float* xf, float* y,
             int64_t R, int64_t K, int64_t N) {
  const QuantizedX x(xf, R, K);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t tile = std::clamp<int64_t>(N / (8 * threads) / 4 * 4, 4, 64);
  ParallelTiles(pool, (N + tile - 1) / tile, [&](int64_t t) {
    int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
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
  Q8W w{qs.typed_data(), scale.typed_data(), K, sd[1]};
  Product(pool, w, x.typed_data(), y->typed_data(), R, K, qd[0]);
  return ffi::Error::Success();
}

ffi::Error Q4X8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F32> scale,
                ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = qs.dimensions(), sd = scale.dimensions(),
       md = mins.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [R, K]");
  const int64_t R = xd[0], K = xd[1];
  if (K % 32 != 0 || qd.size() != 2 || qd[1] * 2 != K || sd.size() != 2 ||
      sd[0] != qd[0] || sd[1] * 32 != K || md.size() != 2 || md[0] != sd[0] ||
      md[1] != sd[1])
    return ffi::Error::InvalidArgument(
        "q4_x8: K % 32 == 0, qs [N, K / 2], scale and mins [N, K / 32]");
  Q4W w{qs.typed_data(), scale.typed_data(), mins.typed_data(), K};
  Product(pool, w, x.typed_data(), y->typed_data(), R, K, qd[0]);
  return ffi::Error::Success();
}

}  // namespace

// The instructions the int8 products use in this build (int8_dot.h).
extern "C" const char* pzlm_int8_dot_isa() { return pzlm::x8::Isa(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q8_x8, Q8X8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q4_x8, Q4X8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
