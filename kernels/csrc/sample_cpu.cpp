// One token per row of float32 logits on CPU, by kernels/reference.py's `sample_tokens`
// algorithm in one pass over each row: torch.ops.qwen3_cpu.sample_rows (built and loaded by
// kernels/cpu_extension.py, called by kernels/ops.py's sample_tokens on CPU).
//
// Per row r: its uniform u = splitmix64(key, counter) (reference.uniform, bit for bit); a row
// whose temperature is not > 0 is greedy (its first maximum), any other draws from
// softmax(logits / temperature) by inverse CDF: per chunk of kSampleChunk tokens its max and
// the float32 sum of exp(x - max), then in float64 the running mass of the chunks, the chunk
// the uniform's share of the total falls in, and the token inside it. The twin's ops do the
// same in ~25 torch calls per step; here each row is read twice (the chunk pass, the chosen
// chunk again) and the rows run in parallel on torch's threads. The chunk sums' float32
// rounding may differ from the twin's in the last bits (another summation order, exp within
// 2 ulp), so a draw within that distance of a chunk's or token's edge may land on the
// neighbour; tests/kernels check the two token for token. -inf logits weigh exactly 0.
//
// Layouts: logits [S, V] float32, rows contiguous (any row stride); rng_key, rng_counter int64
// [S]; temperature float32 [S] or undefined (every row draws, the logits come scaled).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kSampleChunk = 128;  // reference.SAMPLE_CHUNK
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// reference.uniform: splitmix64 of (key, counter), its top 53 bits, in [0, 1).
inline double uniform(int64_t key, int64_t counter) {
  uint64_t x = static_cast<uint64_t>(key) ^ (static_cast<uint64_t>(counter) * 0x9E3779B97F4A7C15ull);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

// y[j] = x[j] / div for j < n (IEEE division, as torch.div), -inf for n <= j < kSampleChunk.
inline void scaled_chunk(const float* x, int64_t n, float div, float* y) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 d = _mm512_set1_ps(div);
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(y + j, _mm512_div_ps(_mm512_loadu_ps(x + j), d));
#endif
  for (; j < n; ++j) y[j] = x[j] / div;
  for (; j < kSampleChunk; ++j) y[j] = kNegInf;
}

// e[j] = exp(y[j] - shift) (0 where y[j] is -inf) for a full chunk; returns their float sum.
inline float exp_chunk(const float* y, float shift, float* e) {
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(shift), ninf = _mm512_set1_ps(kNegInf);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < kSampleChunk; j += 16) {
    const __m512 v = _mm512_loadu_ps(y + j);
    const __m512 w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ),
                                         qwen3_cpu_vec::exp16(_mm512_sub_ps(v, s)));
    _mm512_storeu_ps(e + j, w);
    acc = _mm512_add_ps(acc, w);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float sum = 0.f;
  for (int64_t j = 0; j < kSampleChunk; ++j) {
    e[j] = y[j] == kNegInf ? 0.f : std::exp(y[j] - shift);
    sum += e[j];
  }
  return sum;
#endif
}

inline float chunk_max(const float* y) {
#if defined(__AVX512F__)
  __m512 m = _mm512_loadu_ps(y);
  for (int64_t j = 16; j < kSampleChunk; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(y + j));
  return _mm512_reduce_max_ps(m);
#else
  return *std::max_element(y, y + kSampleChunk);
#endif
}

int64_t sample_row(const float* x, int64_t vocab, bool greedy, float div, double u,
                   float* cmax, float* csum, double* cum) {
  const int64_t num_chunks = (vocab + kSampleChunk - 1) / kSampleChunk;
  alignas(64) float y[kSampleChunk], e[kSampleChunk];
  float row_max = kNegInf;
  for (int64_t c = 0; c < num_chunks; ++c) {
    scaled_chunk(x + c * kSampleChunk, std::min(kSampleChunk, vocab - c * kSampleChunk), div, y);
    cmax[c] = chunk_max(y);
    csum[c] = exp_chunk(y, cmax[c] == kNegInf ? 0.f : cmax[c], e);
    row_max = std::max(row_max, cmax[c]);
  }
  double running = 0.0;
  int64_t last = -1;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const double mass = csum[c] > 0.f
        ? static_cast<double>(csum[c]) * std::exp(static_cast<double>(cmax[c]) - row_max) : 0.0;
    running += mass;
    cum[c] = running;
    if (mass > 0.0) last = c;
  }
  const double target = u * running;
  int64_t which = 0;  // chunks before the one the target falls in (and before the last with mass)
  if (greedy) {
    while (which < num_chunks - 1 && cmax[which] != row_max) ++which;
  } else {
    while (which < last && cum[which] <= target) ++which;
  }
  const double before = which > 0 && !greedy ? cum[which - 1] : 0.0;
  const int64_t start = which * kSampleChunk;
  scaled_chunk(x + start, std::min(kSampleChunk, vocab - start), div, y);
  int64_t offset = kSampleChunk - 1;
  if (greedy) {
    for (int64_t j = 0; j < kSampleChunk; ++j) {
      if (y[j] == row_max) { offset = j; break; }
    }
    return start + offset;
  }
  const float cm = cmax[which];
  exp_chunk(y, cm == kNegInf ? 0.f : cm, e);
  double inside[kSampleChunk], total = 0.0;
  for (int64_t j = 0; j < kSampleChunk; ++j) inside[j] = total += static_cast<double>(e[j]);
  // Stay below the chunk's own total (its float sum may round apart from this one), so the
  // lookup lands on a token of positive weight.
  const double scale = std::exp(static_cast<double>(cm) - row_max);
  const double rest = std::min((target - before) / scale, total - total * 0x1.0p-40);
  int64_t count = 0;
  while (count < kSampleChunk && inside[count] <= rest) ++count;
  return start + std::min(count, kSampleChunk - 1);
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rng_key,
                       const at::Tensor& rng_counter, const c10::optional<at::Tensor>& temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "sample_rows: logits must be float32 [S, V] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(rng_key.scalar_type() == at::kLong && rng_key.is_contiguous() &&
                  rng_key.numel() == rows && rng_counter.scalar_type() == at::kLong &&
                  rng_counter.is_contiguous() && rng_counter.numel() == rows,
              "sample_rows: rng_key and rng_counter must be contiguous int64 [S]");
  const bool has_t = temperature.has_value() && temperature->defined();
  TORCH_CHECK(!has_t || (temperature->scalar_type() == at::kFloat &&
                         temperature->is_contiguous() && temperature->numel() == rows),
              "sample_rows: temperature must be contiguous float32 [S]");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  if (rows == 0 || vocab == 0) return out;
  const float* lp = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const int64_t* key = rng_key.data_ptr<int64_t>();
  const int64_t* counter = rng_counter.data_ptr<int64_t>();
  const float* temp = has_t ? temperature->data_ptr<float>() : nullptr;
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t num_chunks = (vocab + kSampleChunk - 1) / kSampleChunk;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cmax(num_chunks), csum(num_chunks);
    std::vector<double> cum(num_chunks);
    for (int64_t r = begin; r < end; ++r) {
      const bool greedy = has_t && !(temp[r] > 0.f);  // (NaN too, as the twin's ~(t > 0))
      const float div = has_t && !greedy ? temp[r] : 1.f;
      op[r] = sample_row(lp + r * stride, vocab, greedy, div, uniform(key[r], counter[r]),
                         cmax.data(), csum.data(), cum.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qwen3_cpu, m) {
  m.def("sample_rows(Tensor logits, Tensor rng_key, Tensor rng_counter, Tensor? temperature) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(qwen3_cpu, CPU, m) {
  m.impl("sample_rows", sample_rows);
}
