// Shared by the CPU kernels (matvec.cc, attention.cc, sampler.cc): 16-lane
// vectors, an exp for non-positive arguments, conversions of 16-bit and
// 8-bit values to float32 in registers, and the kernels' worker threads.
// One library holds every kernel, so one set of workers serves them all
// (inline functions share their statics).

#ifndef PENZAI_LM_KERNELS_COMMON_H_
#define PENZAI_LM_KERNELS_COMMON_H_

#include <algorithm>
#include <cstdlib>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace pzlm {


inline float Bf16ToF32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float F16ToF32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: normalize
    int e = -1;
    do { ++e; man <<= 1; } while ((man & 0x400) == 0);
    u = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 16-lane vectors: explicit, because GCC does not vectorize the scalar
// conversions. Without AVX-512, GCC keeps a 64-byte vector in memory, not
// in a pair of AVX2 registers: matvec.cc's products use two 8-lane halves
// there (its VF).
typedef float V16 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef int8_t I8x16 __attribute__((vector_size(16)));
typedef uint8_t U8x16 __attribute__((vector_size(16)));

template <typename V>
inline V LoadAs(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline V16 Load(const float* p) { return LoadAs<V16>(p); }
inline void Store(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }

inline float Sum(V16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0;
  for (int j = 0; j < 16; ++j) s += v[j];
  return s;
#endif
}

// exp(x) for x <= 0 (Cephes' expf polynomial; ~1 ulp): softmax, tanh and
// the sampler only need non-positive arguments. Below -87 it returns
// exp(-87), not 0.
inline V16 ExpNonPositive(V16 x) {
  x = x < -87.f ? V16{} - 87.f : x;
  I32x16 n = __builtin_convertvector(x * 1.44269504f - 0.5f, I32x16);
  V16 nf = __builtin_convertvector(n, V16);
  V16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  V16 y = V16{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  I32x16 bits = (n + 127) << 23;
  return y * LoadAs<V16>(&bits);
}

// 16 values of a weight or cache as float32, in registers (the loads of
// weight_formats.h and attention.cc).
inline V16 Cvt16(const float* p) { return Load(p); }
inline V16 Cvt16(const uint16_t* p) {  // bf16: the high half of a float
#if defined(__AVX512F__)
  return (V16)_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(p))), 16));
#else
  U32x16 u = __builtin_convertvector(LoadAs<U16x16>(p), U32x16) << 16;
  return LoadAs<V16>(&u);
#endif
}
// 16 int8 / uint8 values as floats. GCC scalarizes __builtin_convertvector
// from 8-bit lanes (60 instructions where AVX-512 needs 2), hence the
// intrinsics.
inline V16 CvtS8(const int8_t* p) {
#if defined(__AVX512F__)
  return (V16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(
      __builtin_convertvector(LoadAs<I8x16>(p), I32x16), V16);
#endif
}
inline V16 CvtU8(U8x16 b) {
#if defined(__AVX512F__)
  return (V16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)b));
#else
  return __builtin_convertvector(__builtin_convertvector(b, I32x16), V16);
#endif
}
struct Half { uint16_t bits; };
inline V16 Cvt16(const Half* h) {
#if defined(__AVX512F__)
  return (V16)_mm512_cvtph_ps(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(h)));
#elif defined(__F16C__)
  const __m128i* p = reinterpret_cast<const __m128i*>(h);
  __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(p));
  __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
  V16 v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
#else
  V16 v;
  for (int j = 0; j < 16; ++j) v[j] = F16ToF32(h[j].bits);
  return v;
#endif
}
inline float ToF32(float v) { return v; }
inline float ToF32(uint16_t v) { return Bf16ToF32(v); }
inline float ToF32(Half v) { return F16ToF32(v.bits); }

// Worker threads of the kernels. XLA's intra-op pool wakes its threads too
// slowly for products this short: a 576x1536 float32 product takes ~0.3 ms,
// and its helper task got 6% of the tiles. These workers spin briefly
// between calls (a decode step calls the kernels back to back), then sleep,
// so a busy machine does not lose a core to spinning (llama.cpp's spinning
// threads decoded 50x slower here while another process held a core).
// Prompt-sized calls run on XLA's pool instead (`PoolTiles`).
class Workers {
 public:
  static Workers& Get(int64_t threads) {
    // PENZAI_LM_KERNEL_THREADS (a benchmark knob) overrides XLA's count
    // for these workers only: prompt-sized calls run on XLA's own pool
    // (`PoolTiles`), whose size XLA sets.
    static Workers* workers = new Workers([threads] {
      const char* env = std::getenv("PENZAI_LM_KERNEL_THREADS");
      return env ? std::max(1, std::atoi(env)) : threads;
    }());  // lives for the process
    return *workers;
  }

  // Runs body(t) for t in [0, n_tiles) on the caller and the workers.
  template <typename Body>
  void Run(int64_t n_tiles, const Body& body) {
    // One job at a time: XLA may run independent kernel calls at once, and
    // those run on their own threads.
    if (threads_.empty() || n_tiles < 2 || busy_.exchange(true)) {
      for (int64_t t = 0; t < n_tiles; ++t) body(t);
      return;
    }
    auto job = std::make_shared<Job>();
    job->n_tiles = n_tiles;
    job->body = [&body](int64_t t) { body(t); };
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load()) cv_.notify_all();
    job->Work();
    for (int spins = 0;
         job->done.load(std::memory_order_acquire) < n_tiles; ++spins) {
      if (spins > 64) std::this_thread::yield();
    }
    busy_.store(false);
  }

 private:
  struct Job {
    int64_t n_tiles = 0;
    std::function<void(int64_t)> body;
    std::atomic<int64_t> next{0}, done{0};
    void Work() {
      for (int64_t t; (t = next.fetch_add(1)) < n_tiles;) {
        body(t);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };

  explicit Workers(int64_t threads) {
    for (int64_t i = 1; i < threads; ++i) {
      threads_.emplace_back([this] { Loop(); });
      threads_.back().detach();
    }
  }

  void Loop() {
    uint64_t seen = generation_.load();
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen;
           ++spins) {
        if (spins < 2000) continue;
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(mu_);
          sleeping_.fetch_add(1);
          cv_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        job = current_;
        seen = generation_.load();
      }
      job->Work();
    }
  }

  static constexpr std::chrono::microseconds kSpin{300};
  std::vector<std::thread> threads_;
  std::atomic<bool> busy_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
  std::shared_ptr<Job> current_;
};

// Runs body(tile) for every tile in [0, n_tiles) on the caller and workers
// (as many threads as XLA's intra-op pool has).
template <typename Body>
void ParallelTiles(ffi::ThreadPool& pool, int64_t n_tiles, Body body) {
  Workers::Get(std::max<int64_t>(1, pool.num_threads())).Run(n_tiles, body);
}

// Rows from which a product is a prompt's (`PoolTiles`), not a decode
// step's.
constexpr int64_t kPromptRows = 32;

// Runs body(tile) for every tile in [0, n_tiles) on the caller and on XLA's
// intra-op pool (a task for each of its other threads), for prompt-sized
// calls (a tenth of a millisecond and more). Between a prompt's kernel
// calls XLA's idle pool threads spin before they sleep; beside the caller
// and `Workers`, a third thread then took turns on the 2 cores of this
// project's machines, and a prefill's products ran ~8% slower than with
// the pool's own threads doing the work (docs/cpu-speed.md, "Prompts on
// XLA's own threads"). A task that starts after every tile was taken
// returns at once; the caller waits only for tiles already taken.
template <typename Body>
void PoolTiles(ffi::ThreadPool& pool, int64_t n_tiles, const Body& body) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  const auto work = [](Shared& s, const Body& b, int64_t n) {
    for (int64_t t; (t = s.next.fetch_add(1)) < n;) {
      b(t);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers =
      std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), n_tiles) - 1;
  for (int64_t h = 0; h < helpers; ++h)
    pool.Schedule([shared, &body, n_tiles, work] {
      work(*shared, body, n_tiles);  // Touches body only for a tile left.
    });
  work(*shared, body, n_tiles);
  for (int spins = 0; shared->done.load(std::memory_order_acquire) < n_tiles;
       ++spins) {
    if (spins > 64) std::this_thread::yield();
  }
}

// Runs body(n0, n1) over outputs [0, N) of a product that streams its
// weights from memory, in chunks of at most `chunk` outputs (a multiple of
// 4; a chunk's weights stay in cache while the body makes its passes over
// the rows). The chunks go to the threads in kTilesPerThread contiguous
// tiles per thread: a thread then reads one long run of the weights, which
// the hardware prefetchers follow, where tiles of a few outputs each
// restarted them (measured in docs/cpu-speed.md). A thread that starts
// late still finds the other's second tile.
constexpr int64_t kTilesPerThread = 2;
template <typename Body>
void ParallelOutputs(ffi::ThreadPool& pool, int64_t N, int64_t chunk,
                     Body body) {
  const int64_t parts = kTilesPerThread * std::max<int64_t>(
      1, pool.num_threads());
  const int64_t tile =
      std::max<int64_t>(4, ((N + parts - 1) / parts + 3) / 4 * 4);
  ParallelTiles(pool, (N + tile - 1) / tile, [&](int64_t t) {
    const int64_t end = std::min(N, (t + 1) * tile);
    for (int64_t n0 = t * tile; n0 < end; n0 += chunk)
      body(n0, std::min(end, n0 + chunk));
  });
}

// Whether a 4-bit product's x [R, K], qs [N, K / 2] and scale [N, K / 32]
// fit (K % 32 == 0): the shapes every 4-bit entry point checks.
inline bool Q4Shapes(const ffi::Buffer<ffi::F32>& x,
                     const ffi::Buffer<ffi::U8>& qs,
                     const ffi::Buffer<ffi::F32>& scale) {
  auto xd = x.dimensions(), qd = qs.dimensions(), sd = scale.dimensions();
  return xd.size() == 2 && xd[1] % 32 == 0 && qd.size() == 2 &&
         qd[1] * 2 == xd[1] && sd.size() == 2 && sd[0] == qd[0] &&
         sd[1] * 32 == xd[1];
}

// Whether a product of x [R, K] (K % 32 == 0) with a 4-bit weight in tiles
// of 16 outputs (qs u8 [T, 8 K], scale [T, K / 2]) into y [R, 16 T] fits:
// the shapes matvec_q4_tiles.cc and gemm_float.cc check (Q4_1's mins are
// shaped as its scales).
template <ffi::DataType S>
bool Q4TileShapes(const ffi::Buffer<ffi::F32>& x,
                  const ffi::Buffer<ffi::U8>& qs, const ffi::Buffer<S>& scale,
                  ffi::Span<const int64_t> yd) {
  auto xd = x.dimensions(), qd = qs.dimensions(), sd = scale.dimensions();
  return xd.size() == 2 && xd[1] % 32 == 0 && qd.size() == 2 &&
         qd[1] == 8 * xd[1] && sd.size() == 2 && sd[0] == qd[0] &&
         2 * sd[1] == xd[1] && yd.size() == 2 && yd[0] == xd[0] &&
         yd[1] == 16 * qd[0];
}

}  // namespace pzlm

// The FFI signature of a weight product: x f32 [R, K], then the weight
// buffers of its format (element types, in order), y f32 [R, N].
#define PZLM_WEIGHT_ARG(T) .Arg<ffi::Buffer<T>>()
#define PZLM_PRODUCT_BINDING_1(A) \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>() \
      PZLM_WEIGHT_ARG(A).Ret<ffi::Buffer<ffi::F32>>()
#define PZLM_PRODUCT_BINDING_2(A, B) \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>() \
      PZLM_WEIGHT_ARG(A) PZLM_WEIGHT_ARG(B).Ret<ffi::Buffer<ffi::F32>>()
#define PZLM_PRODUCT_BINDING_3(A, B, C)                                  \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()  \
      PZLM_WEIGHT_ARG(A) PZLM_WEIGHT_ARG(B) PZLM_WEIGHT_ARG(C)          \
          .Ret<ffi::Buffer<ffi::F32>>()

#endif  // PENZAI_LM_KERNELS_COMMON_H_
