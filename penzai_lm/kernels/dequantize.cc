// Quantized weights written out as float32 [N, K], for prompts on XLA's
// GEMM (penzai_lm.quantization.QuantizedLinear on CPU, 4-bit layouts:
// XLA:CPU's own dequantization of them is several times slower, figures in
// docs/design.md). Each value is decoded as the float products decode it
// (weight_formats.h) and stored, 16 outputs per tile of work.
//
// Layouts (out-major, as matvec.cc's products read them):
//   q8:    qs s8[N, K], scale f32[N, K / block] -> qs * scale
//   q8_16: qs s8[N, K], scale and mins f32[N, K / 16] -> qs * scale + min
//   q4:    qs u8[N, K / 2], scale and mins f32[N, K / 32] -> nibble *
//          scale + min (ggml's nibble order)
//   q4_0 and q8_0 in tiles of 16 outputs (matvec_tiles.cc): qs u8[N / 16,
//          8 K] or s8[N / 16, 16 K], scale f16[N / 16, K / 2] -> nibble *
//          scale - 8 scale, or q * scale; q5_0 in tiles: qs u8[N / 16,
//          10 K], scale f16[N / 16, K / 2] -> (value - 16) * scale; q4_1 in
//          tiles: qs u8[N / 16, 8 K], scale and mins f32[N / 16, K / 2] ->
//          nibble * scale + min; q8_16 in tiles: qs s8[N / 16, 16 K], scale
//          and mins f32[N / 16, K] -> q * scale + min
// Each value is one multiply, or one fused multiply-add with the offset
// (as XLA computes `formats.dequantize` for the 4-bit layouts; its q8_16
// may round the product first: 1 ulp).

#include <algorithm>

#include "common.h"
#include "float_vec.h"
#include "weight_formats.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary

template <typename W>
void Write(ffi::ThreadPool& pool, const W& w, float* out, int64_t N,
           int64_t K) {
  constexpr int kVecs = W::kStep / 16;
  ParallelTiles(pool, (N + 15) / 16, [&](int64_t t) {
    for (int64_t n = 16 * t; n < std::min(N, 16 * t + 16); ++n) {
      const auto r = w.row(n);
      const float s = w.Scale(r);  // a per-output scale (else 1)
      float* o = out + n * K;
      int64_t k = 0;
      for (; k + W::kStep <= K; k += W::kStep) {
        VF v[kVecs];
        w.Get(r, k, v);
        for (int j = 0; j < kVecs; ++j) StoreF(o + k + 16 * j, v[j] * Splat(s));
      }
      for (; k < K; ++k) o[k] = w.At(r, k) * s;
    }
  });
}

ffi::Error Q8(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> qs,
              ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = qs.dimensions(), sd = scale.dimensions();
  if (qd.size() != 2 || sd.size() != 2 || sd[0] != qd[0] || sd[1] == 0 ||
      qd[1] % sd[1] != 0)
    return ffi::Error::InvalidArgument(
        "dequantize q8: qs [N, K], scale [N, K / block]");
  const int64_t N = qd[0], K = qd[1], block = K / sd[1];
  if (block == K) {
    Write(pool, Q8Channel{{qs.typed_data(), scale.typed_data(), K}},
          out->typed_data(), N, K);
  } else if (block == 32) {
    Write(pool, Q8Block32{{qs.typed_data(), scale.typed_data(), K}},
          out->typed_data(), N, K);
  } else {
    Write(pool, Q8Any{{qs.typed_data(), scale.typed_data(), K}, block},
          out->typed_data(), N, K);
  }
  return ffi::Error::Success();
}

ffi::Error Q8Groups16(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> qs,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> mins,
                      ffi::ResultBuffer<ffi::F32> out) {
  auto qd = qs.dimensions(), sd = scale.dimensions(), md = mins.dimensions();
  if (qd.size() != 2 || qd[1] % 16 != 0 || sd.size() != 2 ||
      sd[0] != qd[0] || sd[1] * 16 != qd[1] || md.size() != 2 ||
      md[0] != sd[0] || md[1] != sd[1])
    return ffi::Error::InvalidArgument(
        "dequantize q8_16: K % 16 == 0, qs [N, K], scale and mins [N, K / 16]");
  Write(pool,
        Q8Group16{{qs.typed_data(), scale.typed_data(), qd[1]},
                  mins.typed_data()},
        out->typed_data(), qd[0], qd[1]);
  return ffi::Error::Success();
}

ffi::Error Q4Blocks(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> qs,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> mins,
                    ffi::ResultBuffer<ffi::F32> out) {
  auto qd = qs.dimensions(), sd = scale.dimensions(), md = mins.dimensions();
  if (qd.size() != 2 || sd.size() != 2 || sd[0] != qd[0] ||
      sd[1] * 16 != qd[1] || md.size() != 2 || md[0] != sd[0] ||
      md[1] != sd[1])
    return ffi::Error::InvalidArgument(
        "dequantize q4: qs [N, K / 2], scale and mins [N, K / 32]");
  const int64_t K = 2 * qd[1];
  Write(pool, Q4{qs.typed_data(), scale.typed_data(), mins.typed_data(), K},
        out->typed_data(), qd[0], K);
  return ffi::Error::Success();
}

// Q4_0 (kInt8 false), Q8_0 and Q5_0 (kFive) in tiles of 16 outputs
// (matvec_tiles.cc): the same values as their rows give.
template <bool kInt8, ffi::DataType Q, bool kFive = false>
ffi::Error Tiles(ffi::ThreadPool pool, ffi::Buffer<Q> qs,
                 ffi::Buffer<ffi::F16> scale, ffi::ResultBuffer<ffi::F32> out) {
  constexpr int64_t kPerValue = kInt8 ? 16 : kFive ? 10 : 8;  // bytes per K
  auto qd = qs.dimensions(), sd = scale.dimensions(), od = out->dimensions();
  if (qd.size() != 2 || qd[1] % (32 * kPerValue) != 0 || sd.size() != 2 ||
      sd[0] != qd[0] || sd[1] * 2 * kPerValue != qd[1] || od.size() != 2 ||
      od[0] != 16 * qd[0] || od[1] * kPerValue != qd[1])
    return ffi::Error::InvalidArgument(
        "dequantize tiles: qs [T, 8 K] (Q4_0), [T, 16 K] (Q8_0) or [T, 10 K] "
        "(Q5_0), f16 scale [T, K / 2], out [16 T, K]");
  const int64_t K = qd[1] / kPerValue;
  Write(pool,
        BlockTiles<kInt8, false, kFive>{reinterpret_cast<const uint8_t*>(qs.untyped_data()),
                          reinterpret_cast<const uint16_t*>(
                              scale.untyped_data()), nullptr, K},
        out->typed_data(), 16 * qd[0], K);
  return ffi::Error::Success();
}

// Q4_1 (kInt8 false) and q8_16 in tiles of 16 outputs, float32 scales and
// offsets: one a block of 32 values (Q4_1) or of 16 (q8_16).
template <bool kInt8, ffi::DataType Q>
ffi::Error TilesWithMins(ffi::ThreadPool pool, ffi::Buffer<Q> qs,
                         ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::F32> mins,
                         ffi::ResultBuffer<ffi::F32> out) {
  constexpr int64_t kPerValue = kInt8 ? 16 : 8;  // tile bytes per K
  auto qd = qs.dimensions(), sd = scale.dimensions(), md = mins.dimensions(),
       od = out->dimensions();
  const int64_t K = qd.size() == 2 ? qd[1] / kPerValue : 0;
  if (qd.size() != 2 || qd[1] % (32 * kPerValue) != 0 || sd.size() != 2 ||
      sd[0] != qd[0] || sd[1] != (kInt8 ? K : K / 2) || md.size() != 2 ||
      md[0] != sd[0] || md[1] != sd[1] || od.size() != 2 ||
      od[0] != 16 * qd[0] || od[1] != K)
    return ffi::Error::InvalidArgument(
        "dequantize tiles: qs [T, 8 K] (Q4_1) or [T, 16 K] (q8_16), f32 "
        "scale and mins [T, K / 2] (Q4_1) or [T, K] (q8_16), out [16 T, K]");
  Write(pool,
        BlockTiles<kInt8, true>{
            reinterpret_cast<const uint8_t*>(qs.untyped_data()),
            scale.typed_data(), mins.typed_data(), K},
        out->typed_data(), 16 * qd[0], K);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_dequantize_q4_0_tiles, (Tiles<false, ffi::U8>),
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U8>>()
        .Arg<ffi::Buffer<ffi::F16>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_dequantize_q8_0_tiles, (Tiles<true, ffi::S8>),
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::S8>>()
        .Arg<ffi::Buffer<ffi::F16>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_dequantize_q5_0_tiles, (Tiles<false, ffi::U8, true>),
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U8>>()
        .Arg<ffi::Buffer<ffi::F16>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_dequantize_q4_1_tiles, (TilesWithMins<false, ffi::U8>),
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U8>>()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_dequantize_q8_16_tiles, (TilesWithMins<true, ffi::S8>),
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::S8>>()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_dequantize_q8, Q8,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::S8>>()
        .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_dequantize_q8_16, Q8Groups16,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::S8>>()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    pzlm_dequantize_q4, Q4Blocks,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U8>>()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>());
