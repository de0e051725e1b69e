// Next-token sampling on CPU: `penzai_lm.sampling.sample_next` in one call.
//
// pzlm_sample: for each row of logits f32[B, V], the same choice as the
// JAX sampler (penzai_lm/sampling/sample.py) makes from the same Gumbel
// noise and coins: penalties, logit bias and bans; greedy rows
// (temperature < 1e-5) take the first argmax; top-k / top-p / min-p rows
// draw over the top `num` candidates (value descending, ties to the lower
// id), or over the exact nucleus where it does not fit in them; typical,
// epsilon and eta filter the vocabulary; XTC acts on what is left (the
// candidates or the vocabulary); the draw over the vocabulary is the
// two-level Gumbel-max over chunks of `chunk` tokens. It also returns the
// chosen token's log-probability under the raw logits.
//
// Why a kernel: XLA:CPU compiles every vocabulary-wide step of the JAX
// sampler (and every branch of its conds) as a kernel of its own, about 116
// of them: 1.4 s of every first decode program's compilation. This is one.
//
// Buffers, per row r: params[r] (f32): the settings of PZLM_SAMPLE_PARAMS,
// in its order; top_k[r] (i32, 0 = off); counts[r] (i32) and seen[r]
// (pred): the penalties' statistics; bias f32[B, V] and bans pred[B, V], or
// [B, 0] for none; noise f32[B, N]; coin f32[B]: XTC's uniform draws.
//
// A new sampling setting: add it to PZLM_SAMPLE_PARAMS at the place of its
// field in penzai_lm/sampling/settings.py's FIELDS (the columns
// sample_next passes are settings.KERNEL_PARAMS, in the table's order;
// ops.sample and a test compare them), use it in SampleRow, and mark its
// field kernel=True.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "common.h"
#include "row_ops.h"

namespace {

using namespace pzlm;  // NOLINT: the kernels' own vocabulary

constexpr float kMinTemperature = 1e-5f;  // filters.MIN_TEMPERATURE

// The per-row parameters: (enumerator, the SamplingSettings field), in the
// order of penzai_lm.sampling.settings.KERNEL_PARAMS: FIELDS' order,
// without the settings that have buffers of their own (top_k, logit_bias,
// banned_tokens).
#define PZLM_SAMPLE_PARAMS(X)               \
  X(kRepetition, "repetition_penalty")      \
  X(kPresence, "presence_penalty")          \
  X(kFrequency, "frequency_penalty")        \
  X(kTemperature, "temperature")            \
  X(kTopP, "top_p")                         \
  X(kMinP, "min_p")                         \
  X(kTypical, "typical_p")                  \
  X(kEpsilon, "epsilon_cutoff")             \
  X(kEta, "eta_cutoff")                     \
  X(kXtcProbability, "xtc_probability")     \
  X(kXtcThreshold, "xtc_threshold")

#define PZLM_ENUMERATOR(e, name) e,
enum Param { PZLM_SAMPLE_PARAMS(PZLM_ENUMERATOR) kNumParams };
#undef PZLM_ENUMERATOR

struct Row {
  const float* logits;
  const float* p;
  int32_t top_k;
  const int32_t* counts;
  const bool* seen;
  const float* bias;  // null: none
  const bool* bans;   // null: none
  const float* noise;
  float coin;  // XTC's uniform draw in [0, 1).
};

struct Scratch {
  std::vector<float> x, y, q, score;  // [V]
  std::vector<float> vals, vk;        // [num]: the candidates
  std::vector<uint8_t> keep, ck;      // [V] and [num]
  std::vector<int32_t> ids;
};

// Steps (1)-(2): penalties, bias, bans (sample.py `processed`). NaN (a
// broken row, whose token the loop discards) becomes -inf so that the
// orderings below stay strict.
void Process(const Row& r, int64_t V, float* x) {
  const float rep = r.p[kRepetition], pres = r.p[kPresence],
              freq = r.p[kFrequency];
  const bool penalise = rep != 1.f || pres != 0.f || freq != 0.f;
  if (!penalise && !r.bias && !r.bans) {
    for (int64_t i = 0; i < V; ++i)  // Vectorized.
      x[i] = r.logits[i] != r.logits[i] ? kNegInf : r.logits[i];
    return;
  }
  for (int64_t i = 0; i < V; ++i) {
    float l = r.logits[i];
    if (penalise) {
      if (r.seen[i]) l = l > 0.f ? l / rep : l * rep;
      const float c = static_cast<float>(r.counts[i]);
      l = l - pres * (r.counts[i] > 0 ? 1.f : 0.f) - freq * c;
    }
    if (r.bias) l = l + r.bias[i];
    if (r.bans && r.bans[i]) l = kNegInf;
    x[i] = std::isnan(l) ? kNegInf : l;
  }
}

// The `num` highest of x, descending, ties to the lower id.
void TopCandidates(const float* x, int64_t V, int64_t num,
                   std::vector<int32_t>& ids) {
  ids.resize(V);
  std::iota(ids.begin(), ids.end(), 0);
  auto before = [x](int32_t a, int32_t b) {
    return x[a] > x[b] || (x[a] == x[b] && a < b);
  };
  if (num < V)
    std::partial_sort(ids.begin(), ids.begin() + num, ids.end(), before);
  else
    std::sort(ids.begin(), ids.end(), before);
}

// filters.candidate_keep_mask for one row; returns `covered`.
bool CandidateKeep(const float* vals, int64_t num, int32_t top_k,
                   float top_p, float min_p, float full_log_norm,
                   bool exhaustive, float* vk, uint8_t* keep) {
  const bool k_on = top_k > 0;
  for (int64_t j = 0; j < num; ++j)
    vk[j] = (!k_on || j < top_k) ? vals[j] : kNegInf;
  const float log_norm = k_on ? LogSumExp(vk, num) : full_log_norm;
  const float min_cut = vals[0] + std::log(min_p);
  float cum = 0.f;
  for (int64_t j = 0; j < num; ++j) {
    const float before = cum;
    cum += vk[j] == kNegInf ? 0.f : std::exp(vk[j] - log_norm);
    const bool in_k = !k_on || j < top_k;
    const bool in_p = top_p >= 1.f || before < top_p;
    keep[j] = (in_k && in_p && vals[j] >= min_cut) || j == 0;
  }
  return k_on || cum >= top_p || exhaustive;
}

// filters.top_p_keep_mask_full: the exact nucleus over the vocabulary, for
// rows whose nucleus does not fit in the candidates. As there, a bisection
// over the float bit patterns finds the threshold value t (at most 32
// masked sums; a sort of the vocabulary took 6 ms a row at 49k tokens):
// every token above t is kept, and of the tokens equal to t the first
// (lowest ids) as long as the mass before them is below top_p. `upper`: a
// value whose strictly-higher mass is known to be below top_p.
void FullNucleus(const float* x, int64_t V, float log_norm, float top_p,
                 float upper, float* q, uint8_t* keep) {
  for (int64_t i = 0; i < V; i += 16) {
    if (i + 16 <= V) {
      Store(q + i, ExpOrZero(Load(x + i) - log_norm));
    } else {
      for (int64_t j = i; j < V; ++j)
        q[j] = x[j] == kNegInf ? 0.f : std::exp(x[j] - log_norm);
    }
  }
  int64_t hi = Sortable(upper);
  int64_t lo = std::min<int64_t>(
      static_cast<int64_t>(Sortable(Min(x, V))) - 1, hi - 1);
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (MassAbove(x, q, V, Unsortable(mid)) < top_p)
      hi = mid;
    else
      lo = mid;
  }
  const float t = Unsortable(hi);
  const float above = MassAbove(x, q, V, t);
  const float p_t = t == kNegInf ? 0.f : std::exp(t - log_norm);
  float mass = above;
  int64_t taken = 0;
  for (int64_t i = 0; i < V; ++i) {
    keep[i] = x[i] > t;
    if (x[i] == t && (taken == 0 || mass < top_p)) {
      keep[i] = 1;
      mass += p_t;
      ++taken;
    }
  }
}

// y = where(keep, x, -inf); returns its log-normaliser.
float Masked(const float* x, const uint8_t* keep, int64_t V, float* y) {
  for (int64_t i = 0; i < V; ++i) y[i] = keep[i] ? x[i] : kNegInf;
  return LogSumExp(y, V);
}

// entropy_filters.typical_mask, epsilon_mask and eta_mask, in HF's order,
// each on what the previous ones kept. Typical's threshold is found, as
// there, by bisection over the scores' bit patterns: at most
// 32 masked sums, where sorting 49k scores took 4.5 ms a row.
void EntropyFilters(const float* x, int64_t V, const float* p, Scratch& s) {
  uint8_t* keep = s.keep.data();
  float* y = s.y.data();
  float* q = s.q.data();
  if (p[kTypical] < 1.f) {
    const float lse = Masked(x, keep, V, y);
    const float h = ProbsAndEntropy(y, V, lse, q);
    float* score = s.score.data();
    float lo_score = kInf, hi_score = 0.f;
    for (int64_t i = 0; i < V; ++i) {
      score[i] = y[i] == kNegInf ? kInf : std::fabs(y[i] - lse + h);
      if (y[i] != kNegInf) {
        lo_score = std::min(lo_score, score[i]);
        hi_score = std::max(hi_score, score[i]);
      }
    }
    if (lo_score <= hi_score) {
      int64_t lo = static_cast<int64_t>(Sortable(lo_score)) - 1;
      int64_t hi = Sortable(hi_score);
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (MassUpTo(score, q, V, Unsortable(mid)) >= p[kTypical])
          hi = mid;
        else
          lo = mid;
      }
      const float threshold = Unsortable(hi);
      for (int64_t i = 0; i < V; ++i)
        keep[i] = y[i] != kNegInf && score[i] <= threshold;
    }
  }
  for (int which = 0; which < 2; ++which) {
    const float cutoff = p[which == 0 ? kEpsilon : kEta];
    if (!(cutoff > 0.f)) continue;
    const float lse = Masked(x, keep, V, y);
    const float h = ProbsAndEntropy(y, V, lse, q);
    const float cut =
        which == 0 ? cutoff
                   : std::min(cutoff, std::sqrt(cutoff) * std::exp(-h));
    const float top = Max(y, V);
    for (int64_t i = 0; i < V; ++i)
      keep[i] = y[i] != kNegInf && (q[i] >= cut || y[i] >= top);
  }
}

// filters.xtc_applies: whether XTC acts on this row at this step.
bool XtcApplies(const float* p, float coin) {
  return p[kXtcProbability] > 0.f && p[kXtcThreshold] <= 0.5f &&
         coin <= p[kXtcProbability];
}

// filters.xtc_mask: of the kept entries of x[0, n) whose probability
// (softmax over the kept ones, e / sum(e) with e = exp(x - max)) is >=
// threshold, if there are at least two, drops all but the last in
// candidate order (the lowest value; of equal values, the highest index).
// y: n floats of scratch.
void ExcludeTopChoices(const float* x, int64_t n, float threshold,
                       uint8_t* keep, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = keep[i] ? x[i] : kNegInf;
  const float m = Max(y, n);
  if (!(m > kNegInf)) return;
  const float sum = SumExp(y, n, m);
  // p <= exp(y - m) (sum >= 1), so p >= threshold needs y >= m +
  // log(threshold): entries below that (with a margin for rounding) are
  // skipped without an exp.
  const float floor =
      threshold > 0.f ? m + std::log(threshold) - 1e-3f * (1.f + std::fabs(m))
                      : kNegInf;
  auto top = [&](int64_t i) {
    return y[i] != kNegInf && y[i] >= floor &&
           std::exp(y[i] - m) / sum >= threshold;
  };
  int64_t count = 0, last = -1;
  float lowest = kInf;
  for (int64_t i = 0; i < n; ++i) {
    if (!top(i)) continue;
    ++count;
    if (y[i] <= lowest) lowest = y[i], last = i;
  }
  if (count < 2) return;
  for (int64_t i = 0; i < n; ++i)
    if (i != last && top(i)) keep[i] = 0;
}

// sample.sample_full_vocab: the two-level Gumbel-max draw from softmax(y).
int64_t DrawFromVocabulary(const float* y, int64_t V, int64_t chunk,
                           const float* noise) {
  const int64_t chunks = (V + chunk - 1) / chunk;
  const float m = Max(y, V);
  if (!(m > kNegInf)) return 0;
  int64_t which = 0;
  float best = kNegInf;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n = std::min(chunk, V - c * chunk);
    const float mass = SumExp(y + c * chunk, n, m);
    const float score = (mass > 0.f ? std::log(mass) : kNegInf) + noise[c];
    if (score > best) best = score, which = c;
  }
  const int64_t n = std::min(chunk, V - which * chunk);
  int64_t pick = 0;
  best = kNegInf;
  for (int64_t j = 0; j < n; ++j) {
    const float score = y[which * chunk + j] + noise[chunks + j];
    if (score > best) best = score, pick = j;
  }
  return which * chunk + pick;
}

int64_t SampleRow(const Row& r, int64_t V, int64_t num, int64_t chunk,
                  Scratch& s) {
  float* x = s.x.data();
  Process(r, V, x);
  const float* p = r.p;
  if (p[kTemperature] < kMinTemperature) return ArgmaxFirst(x, V);
  for (int64_t i = 0; i < V; ++i) x[i] = x[i] / p[kTemperature];
  const bool truncating = r.top_k > 0 || p[kTopP] < 1.f;
  const bool entropy =
      p[kTypical] < 1.f || p[kEpsilon] > 0.f || p[kEta] > 0.f;
  const bool xtc = XtcApplies(p, r.coin);
  uint8_t* keep = s.keep.data();
  if (truncating) {
    TopCandidates(x, V, num, s.ids);
    float* vals = s.vals.data();
    for (int64_t j = 0; j < num; ++j) vals[j] = x[s.ids[j]];
    const float full_log_norm =
        r.top_k > 0 ? 0.f : LogSumExp(x, V);
    uint8_t* ck = s.ck.data();
    const bool covered = CandidateKeep(vals, num, r.top_k, p[kTopP],
                                       p[kMinP], full_log_norm, num == V,
                                       s.vk.data(), ck);
    if (covered && !entropy) {
      if (xtc)
        ExcludeTopChoices(vals, num, p[kXtcThreshold], ck, s.vk.data());
      int64_t pos = 0;
      float best = kNegInf;
      for (int64_t j = 0; j < num; ++j) {
        const float score = (ck[j] ? vals[j] : kNegInf) + r.noise[j];
        if (score > best) best = score, pos = j;
      }
      return s.ids[pos];
    }
    if (covered) {  // Candidates' keep (min-p included) as a mask.
      std::fill(keep, keep + V, 0);
      for (int64_t j = 0; j < num; ++j) keep[s.ids[j]] = ck[j];
    } else {
      FullNucleus(x, V, full_log_norm, p[kTopP], vals[num - 1], s.q.data(),
                  keep);
      const float cut = vals[0] + std::log(p[kMinP]);
      for (int64_t i = 0; i < V; ++i) keep[i] = keep[i] && x[i] >= cut;
    }
  } else {
    const float cut = Max(x, V) + std::log(p[kMinP]);
    for (int64_t i = 0; i < V; ++i) keep[i] = x[i] >= cut;
  }
  if (entropy) EntropyFilters(x, V, p, s);
  if (xtc) ExcludeTopChoices(x, V, p[kXtcThreshold], keep, s.y.data());
  float* y = s.y.data();
  for (int64_t i = 0; i < V; ++i) y[i] = keep[i] ? x[i] : kNegInf;
  return DrawFromVocabulary(y, V, chunk, r.noise);
}

ffi::Error Sample(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                  ffi::Buffer<ffi::F32> params, ffi::Buffer<ffi::S32> top_k,
                  ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::PRED> seen,
                  ffi::Buffer<ffi::F32> bias,
                  ffi::Buffer<ffi::PRED> bans, ffi::Buffer<ffi::F32> noise,
                  ffi::Buffer<ffi::F32> coin, int64_t num, int64_t chunk,
                  ffi::Result<ffi::Buffer<ffi::S32>> token,
                  ffi::Result<ffi::Buffer<ffi::F32>> logprob) {
  auto d = logits.dimensions();
  if (d.size() != 2 || d[1] == 0)
    return ffi::Error::InvalidArgument("sample: logits [B, V > 0]");
  const int64_t B = d[0], V = d[1];
  const int64_t N = noise.dimensions().back();
  const int64_t chunks = (V + chunk - 1) / chunk;
  if (params.element_count() != B * kNumParams ||
      top_k.element_count() != B || counts.element_count() != B * V ||
      seen.element_count() != B * V || num < 1 || num > V || chunk < 1 ||
      N < std::max(num, chunks + chunk) || noise.element_count() != B * N ||
      coin.element_count() != B ||
      (bias.element_count() != 0 && bias.element_count() != B * V) ||
      (bans.element_count() != 0 && bans.element_count() != B * V))
    return ffi::Error::InvalidArgument("sample: inconsistent shapes");
  auto row = [&](int64_t b) {
    thread_local Scratch s;  // Per thread: rows run on the workers.
    for (auto* v : {&s.x, &s.y, &s.q, &s.score}) v->resize(V);
    s.keep.resize(V);
    for (auto* v : {&s.vals, &s.vk}) v->resize(num);
    s.ck.resize(num);
    const Row r{logits.typed_data() + b * V,
                params.typed_data() + b * kNumParams,
                top_k.typed_data()[b],
                counts.typed_data() + b * V,
                seen.typed_data() + b * V,
                bias.element_count() ? bias.typed_data() + b * V : nullptr,
                bans.element_count() ? bans.typed_data() + b * V : nullptr,
                noise.typed_data() + b * N,
                coin.typed_data()[b]};
    const int64_t t = SampleRow(r, V, num, chunk, s);
    token->typed_data()[b] = static_cast<int32_t>(t);
    logprob->typed_data()[b] = r.logits[t] - LogSumExp(r.logits, V);
  };
  if (B == 1)
    row(0);
  else
    ParallelTiles(pool, B, row);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(pzlm_sample, Sample,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num")
                                  .Attr<int64_t>("chunk")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The names of the per-row parameters, in their order, comma-separated
// (penzai_lm.kernels.ops.kernel_sample_params reads them).
#define PZLM_NAME(e, name) name ","
extern "C" const char* pzlm_sample_params() {
  static const char kNames[] = PZLM_SAMPLE_PARAMS(PZLM_NAME);
  return kNames;
}
#undef PZLM_NAME
