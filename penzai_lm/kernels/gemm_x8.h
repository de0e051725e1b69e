// The prompt-sized products with int8 activations on AMX (gemm_x8.cc),
// called by matvec_x8.cc's handlers for kGemmRows rows or more.

#ifndef PENZAI_LM_KERNELS_GEMM_X8_H_
#define PENZAI_LM_KERNELS_GEMM_X8_H_

#include <cstdint>

#include "common.h"

namespace pzlm {
namespace gemm_x8 {

// Rows from which a product goes to the tiles (a tile holds 16 rows; ops.py's
// GEMM_ROWS mirrors it).
constexpr int64_t kGemmRows = 17;

// The weight layouts (matvec_x8.cc's), out-major [N, K], K % 32 == 0:
//   kQ8:        qs s8[N, K], scale f32[N, K / 32]
//   kQ8Channel: qs s8[N, K], scale f32[N, 1]
//   kQ4:        qs u8[N, K / 2] (ggml's nibble order), scale and mins
//               f32[N, K / 32] (mins null: Q4_0, mins = -8 scale)
//   kQ8G16:     qs s8[N, K], scale and mins f32[N, K / 16]
enum class Layout { kQ8, kQ8Channel, kQ4, kQ8G16 };

struct Weights {
  Layout layout;
  const void* qs;
  const float* scale;
  const float* mins;  // null for kQ8 and kQ8Channel (and Q4_0's kQ4)
};

// Whether this build has the tile path and the kernel let this process use
// the tiles (Linux's arch_prctl permission, asked for once).
bool Available();

// y f32[R, N] = the product of x f32[R, K], quantized to int8 blocks of 32
// (q8_blocks.h), with w, as matvec_x8.cc's products compute it (the same
// integers; the float scaling summed in another order). Returns false,
// touching nothing, where the tiles are not Available().
bool Product(ffi::ThreadPool& pool, const Weights& w, const float* x,
             float* y, int64_t R, int64_t K, int64_t N);

// "amx" where Available(), else "none".
const char* Isa();

}  // namespace gemm_x8
}  // namespace pzlm

#endif  // PENZAI_LM_KERNELS_GEMM_X8_H_
