// Small-batch matrix products for XLA:CPU, called through the XLA FFI.
//
// Why this exists: for a vector-matrix product (decoding, a few rows of
// activations) XLA:CPU converts bfloat16/float16 weights to a float32 copy
// before every dot, and has no dot that reads int8 or 4-bit weights at all.
// Decoding reads every weight once per token, so that copy costs a weight
// sized write and read per step (SmolLM2 bf16 decoded slower than f32, and
// 576x12288 bf16 took 12 ms against 5 ms in f32). Here the weights are
// decoded into a small float tile in L1 and used from there by every row of
// the activations, so each weight byte is read from memory once per call.
//
// Conventions (every entry point):
//   x: f32[R, K]  activations, R rows (batch x seq), K contracted.
//   y: f32[R, N]  result.
//   "out-major" weights are [N, K] (each output's weights contiguous, as
//   GGUF and tied embedding tables store them); "in-major" are [K, N].
//   Quantized weights are out-major and blockwise along K:
//     q8:  qs s8[N, K],          w = qs * scale[n, k / block]
//     q4:  qs u8[N, K / 2],      w = nibble * scale[n, k / 32] + min[n, k / 32]
//          (ggml's order: byte j of each 32-value block holds value j in its
//          low nibble and value j + 16 in its high nibble).
// Work is split into tiles of outputs, handed out through an atomic counter
// to the caller and to XLA's intra-op thread pool: a helper that starts late
// finds no tiles left, so the call never waits on a pool that is busy.

#include <algorithm>
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

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 16;  // rows handled per pass over the weights
constexpr int64_t kTileK = 512;   // weights decoded to floats at a time

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

// 16-lane vectors (GCC lowers them to AVX-512 or pairs of AVX2 registers):
// explicit, because GCC does not vectorize the scalar conversions.
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
  float s = 0;
  for (int j = 0; j < 16; ++j) s += v[j];
  return s;
}

// Row decoders: out[0 : len] = floats of p[0 : len].
inline void DecodeRow(const float* p, int64_t len, float* out) {
  std::memcpy(out, p, len * sizeof(float));
}
inline void DecodeRow(const uint16_t* p, int64_t len, float* out) {  // bf16
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    U32x16 u = __builtin_convertvector(LoadAs<U16x16>(p + i), U32x16) << 16;
    std::memcpy(out + i, &u, sizeof(u));
  }
  for (; i < len; ++i) out[i] = Bf16ToF32(p[i]);
}
struct Half { uint16_t bits; };
inline void DecodeRow(const Half* h, int64_t len, float* out) {  // f16
  const uint16_t* p = &h->bits;
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= len; i += 8) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(v));
  }
#endif
  for (; i < len; ++i) out[i] = F16ToF32(p[i]);
}

// Weight decoders: floats of out-major row n, values [k0, k0 + len).
template <typename T>
struct Dense {
  const T* w;
  int64_t K;
  void operator()(int64_t n, int64_t k0, int64_t len, float* out) const {
    DecodeRow(w + n * K + k0, len, out);
  }
};
struct Q8 {
  const int8_t* qs;
  const float* scale;
  int64_t K, block;
  void operator()(int64_t n, int64_t k0, int64_t len, float* out) const {
    const int8_t* q = qs + n * K;
    const float* s = scale + n * (K / block);
    for (int64_t i = 0; i < len;) {
      int64_t k = k0 + i, b = k / block;
      int64_t run = std::min(len - i, (b + 1) * block - k);
      float d = s[b];
      for (int64_t j = 0; j < run; ++j) out[i + j] = float(q[k + j]) * d;
      i += run;
    }
  }
};
struct Q4 {
  const uint8_t* qs;
  const float* scale;
  const float* mins;
  int64_t K;
  // k0 and len are multiples of 32.
  void operator()(int64_t n, int64_t k0, int64_t len, float* out) const {
    const uint8_t* q = qs + n * (K / 2);
    const float* s = scale + n * (K / 32);
    const float* m = mins + n * (K / 32);
    for (int64_t i = 0; i < len; i += 32) {
      int64_t b = (k0 + i) / 32;
      const uint8_t* blk = q + b * 16;
      float d = s[b], mn = m[b];
      for (int j = 0; j < 16; ++j) {
        out[i + j] = float(blk[j] & 0xf) * d + mn;
        out[i + j + 16] = float(blk[j] >> 4) * d + mn;
      }
    }
  }
};

// Worker threads of the kernels. XLA's intra-op pool wakes its threads too
// slowly for products this short: a 576x1536 float32 product takes ~0.3 ms,
// and its helper task got 6% of the tiles. These workers spin briefly
// between calls (a decode step calls the kernels back to back), then sleep,
// so a busy machine does not lose a core to spinning (llama.cpp's spinning
// threads decoded 50x slower here while another process held a core).
class Workers {
 public:
  static Workers& Get(int64_t threads) {
    static Workers* workers = new Workers(threads);  // lives for the process
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

// Outputs [n0, n0 + OUTS) of every row: each K tile of their weights is
// decoded once (into L1) and used by all rows; OUTS independent
// accumulators per row keep the FMA units busy.
template <int OUTS, typename Decode>
void OutMajorGroup(const Decode& decode, const float* x, float* y,
                   int64_t rows, int64_t K, int64_t N, int64_t n0) {
  alignas(64) float wf[OUTS][kTileK];
  V16 acc[kMaxRows][OUTS] = {};
  float tail[kMaxRows][OUTS] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    int64_t len = std::min(kTileK, K - k0), full = len & ~int64_t(15);
    for (int o = 0; o < OUTS; ++o) decode(n0 + o, k0, len, wf[o]);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * K + k0;
      V16 a[OUTS];
      for (int o = 0; o < OUTS; ++o) a[o] = acc[r][o];
      for (int64_t i = 0; i < full; i += 16) {
        V16 xv = Load(xr + i);
        for (int o = 0; o < OUTS; ++o) a[o] += xv * Load(wf[o] + i);
      }
      for (int o = 0; o < OUTS; ++o) {
        acc[r][o] = a[o];
        for (int64_t i = full; i < len; ++i) tail[r][o] += xr[i] * wf[o][i];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int o = 0; o < OUTS; ++o) {
      y[r * N + n0 + o] = Sum(acc[r][o]) + tail[r][o];
    }
  }
}

template <typename Decode>
void OutMajor(ffi::ThreadPool& pool, const Decode& decode, const float* x,
              float* y, int64_t R, int64_t K, int64_t N) {
  constexpr int64_t kTileN = 64;
  ParallelTiles(pool, (N + kTileN - 1) / kTileN, [=](int64_t t) {
    int64_t n0 = t * kTileN, n1 = std::min(N, n0 + kTileN);
    for (int64_t r0 = 0; r0 < R; r0 += kMaxRows) {
      int64_t rows = std::min(kMaxRows, R - r0);
      const float* xr = x + r0 * K;
      float* yr = y + r0 * N;
      int64_t n = n0;
      for (; n + 4 <= n1; n += 4) OutMajorGroup<4>(decode, xr, yr, rows, K, N, n);
      for (; n < n1; ++n) OutMajorGroup<1>(decode, xr, yr, rows, K, N, n);
    }
  });
}

// In-major dense weights [K, N]. A task takes a tile of kTileN outputs and
// a chunk of K, and streams that chunk's row segments (4 KB of float32,
// 2 KB of 16-bit weights: long enough runs for the prefetchers). K is split
// only when there are fewer output tiles than threads; the chunks' partial
// sums are then added up at the end.
template <typename T>
void InMajor(ffi::ThreadPool& pool, const T* w, const float* x, float* y,
             int64_t R, int64_t K, int64_t N) {
  constexpr int64_t kTileN = 1024, kRowGroup = 4;
  int64_t tiles = (N + kTileN - 1) / kTileN;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t splits = tiles >= threads ? 1
                   : std::max<int64_t>(1, std::min(threads, K / 64));
  int64_t chunk = (K + splits - 1) / splits;
  std::unique_ptr<float[]> partial;
  if (splits > 1) partial.reset(new float[splits * R * N]);
  float* parts = partial.get();
  ParallelTiles(pool, tiles * splits, [=](int64_t t) {
    int64_t split = t / tiles, n0 = (t % tiles) * kTileN;
    int64_t width = std::min(kTileN, N - n0), vecs = (width + 15) / 16;
    int64_t k0 = split * chunk, k1 = std::min(K, k0 + chunk);
    float* out = splits > 1 ? parts + split * R * N : y;
    alignas(64) float wf[kTileN + 16];
    alignas(64) float acc[kRowGroup][kTileN + 16];
    for (int64_t r0 = 0; r0 < R; r0 += kRowGroup) {
      int64_t rows = std::min(kRowGroup, R - r0);
      for (int64_t r = 0; r < rows; ++r) std::fill_n(acc[r], vecs * 16, 0.f);
      for (int64_t k = k0; k < k1; ++k) {
        const T* p = w + k * N + n0;
        DecodeRow(p, width, wf);
        for (int64_t j = width; j < vecs * 16; ++j) wf[j] = 0;
        for (int64_t r = 0; r < rows; ++r) {
          V16 xv = V16{} + x[(r0 + r) * K + k];
          float* a = acc[r];
          for (int64_t v = 0; v < vecs; ++v) {
            V16 s = Load(a + 16 * v) + xv * Load(wf + 16 * v);
            std::memcpy(a + 16 * v, &s, sizeof(s));
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(out + (r0 + r) * N + n0, acc[r], width * sizeof(float));
      }
    }
  });
  for (int64_t split = 1; split < splits; ++split) {
    const float* p = parts + split * R * N;
    if (split == 1) std::memcpy(y, parts, R * N * sizeof(float));
    for (int64_t i = 0; i < R * N; ++i) y[i] += p[i];
  }
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
  Q8 decode{qs.typed_data(), scale.typed_data(), K, K / sd[1]};
  OutMajor(pool, decode, x.typed_data(), y->typed_data(), R, K, qd[0]);
  return ffi::Error::Success();
}

ffi::Error Q4OutMajor(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::F32> mins,
                      ffi::ResultBuffer<ffi::F32> y) {
  int64_t R, K;
  if (auto e = CheckX(x, R, K); e.failure()) return e;
  auto qd = qs.dimensions(), sd = scale.dimensions(), md = mins.dimensions();
  if (K % 32 != 0 || qd.size() != 2 || qd[1] * 2 != K || sd.size() != 2 ||
      sd[0] != qd[0] || sd[1] * 32 != K || md.size() != 2 || md[0] != sd[0] ||
      md[1] != sd[1])
    return ffi::Error::InvalidArgument(
        "q4: K % 32 == 0, qs [N, K / 2], scale and mins [N, K / 32]");
  Q4 decode{qs.typed_data(), scale.typed_data(), mins.typed_data(), K};
  OutMajor(pool, decode, x.typed_data(), y->typed_data(), R, K, qd[0]);
  return ffi::Error::Success();
}

}  // namespace

#define DENSE_BINDING(T)             \
  ffi::Ffi::Bind()                   \
      .Ctx<ffi::ThreadPool>()        \
      .Arg<ffi::Buffer<ffi::F32>>()  \
      .Arg<ffi::Buffer<T>>()         \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_out_f32,
                              (DenseOutMajor<ffi::F32, Dense<float>>),
                              DENSE_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_out_bf16,
                              (DenseOutMajor<ffi::BF16, Dense<uint16_t>>),
                              DENSE_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_out_f16,
                              (DenseOutMajor<ffi::F16, Dense<Half>>),
                              DENSE_BINDING(ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_in_f32,
                              (DenseInMajor<ffi::F32, float>),
                              DENSE_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_in_bf16,
                              (DenseInMajor<ffi::BF16, uint16_t>),
                              DENSE_BINDING(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_in_f16,
                              (DenseInMajor<ffi::F16, Half>),
                              DENSE_BINDING(ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q8, Q8OutMajor,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_matvec_q4, Q4OutMajor,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
