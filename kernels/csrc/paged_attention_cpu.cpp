// Paged attention of a few query rows per sequence, read straight from the paged KV cache on
// CPU: torch.ops.qwen3_cpu.paged_attention_rows (built and loaded by kernels/cpu_extension.py,
// called by kernels/cpu_attention.py).
//
// Work item: one (sequence, KV head). Its query vectors are the sequence's q_len rows times the
// KV head's G = Hq / Hkv query heads, so every K and V row of that head is read once for all of
// them (GQA without repeating K/V) and straight through the block table: no gathered copy.
// Softmax is online, one cache block at a time, in float32; K and V are widened to float32 in
// registers. Query row j of a sequence sits at position seq_len - q_len + j and weighs only the
// keys at positions <= its own, so no cache row at a position >= seq_len is ever read.
//
// Layouts (kernels/ops.py checks the shapes): q and out [T, Hq, D] (any strides but the last),
// caches [num_blocks, block_size, Hkv, D] contiguous (fp32, bf16 or fp16, all of q's dtype),
// block_tables int32 [B, max_blocks], query_start_loc int32 [B + 1], seq_lens int32 [B],
// seqs int64 [n]: the sequences to attend; out's rows of the other sequences are untouched.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
using qwen3_cpu_vec::exp16;
#endif

constexpr int kMaxRows = 8;  // query vectors attended per pass over a sequence's keys
constexpr int kChunk = 16;   // keys scored before their softmax update (one AVX-512 vector)

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
// 16 elements widened to float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane t of the result: the sum of v[t]'s 16 lanes (16 horizontal sums at once).
inline __m512 reduce16(const __m512* v) {
  __m512 h[8], q[4];
  for (int i = 0; i < 8; ++i)  // halves: lanes 0-7 of token 2i, 8-15 of 2i + 1
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // quarters: 128-bit lane k of q[j] holds token 4j + k
    q[j] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * j], h[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(h[2 * j], h[2 * j + 1], 0xDD));
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(q[0], q[1]), _mm512_unpackhi_ps(q[0], q[1]));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(q[2], q[3]), _mm512_unpackhi_ps(q[2], q[3]));
  const __m512 sums = _mm512_add_ps(  // lane 4k + j: token 4j + k
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}
#endif

// scores[r * kChunk + t] = q[r] . k_t for NR float32 query rows (row stride D) and the n
// cache rows k_t = k + t * row_stride.
template <int NR, typename T>
inline void dot_chunk(const float* q, const T* k, int64_t row_stride, int n, int D,
                      float* scores) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 part[NR][kChunk];
    for (int t = 0; t < n; ++t) {
      __m512 acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 16) {
        const __m512 kv = load16(k + t * row_stride + d);
        for (int r = 0; r < NR; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + d), kv, acc[r]);
      }
      for (int r = 0; r < NR; ++r) part[r][t] = acc[r];
    }
    for (int r = 0; r < NR; ++r) {
      for (int t = n; t < kChunk; ++t) part[r][t] = _mm512_setzero_ps();
      _mm512_storeu_ps(scores + r * kChunk, reduce16(part[r]));
    }
    return;
  }
#endif
  for (int t = 0; t < n; ++t) {
    for (int r = 0; r < NR; ++r) {
      float sum = 0.f;
      for (int d = 0; d < D; ++d) sum += q[r * D + d] * to_float(k[t * row_stride + d]);
      scores[r * kChunk + t] = sum;
    }
  }
}

// acc[r] = alpha[r] * acc[r] + sum_t p[r * kChunk + t] * v_t for NR float32 accumulator rows
// (row stride D) and the n cache rows v_t = v + t * row_stride.
template <int NR, typename T>
inline void axpy_chunk(const float* p, const float* alpha, const T* v, int64_t row_stride,
                       int n, int D, float* acc) {
  int d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16) {
    __m512 a[NR];
    for (int r = 0; r < NR; ++r)
      a[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), _mm512_set1_ps(alpha[r]));
    for (int t = 0; t < n; ++t) {
      const __m512 vv = load16(v + t * row_stride + d);
      for (int r = 0; r < NR; ++r)
        a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kChunk + t]), vv, a[r]);
    }
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(acc + r * D + d, a[r]);
  }
#endif
  for (; d < D; ++d) {
    for (int r = 0; r < NR; ++r) {
      float sum = acc[r * D + d] * alpha[r];
      for (int t = 0; t < n; ++t) sum += p[r * kChunk + t] * to_float(v[t * row_stride + d]);
      acc[r * D + d] = sum;
    }
  }
}

// Asks for the cache lines of n rows of D elements, row_stride apart.
template <typename T>
inline void prefetch_rows(const T* p, int64_t row_stride, int n, int D) {
  const int bytes = D * static_cast<int>(sizeof(T));
  for (int t = 0; t < n; ++t) {
    const char* row = reinterpret_cast<const char*>(p + t * row_stride);
    for (int b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
  }
}

// Scores s[0, valid) of one chunk of keys (at most kChunk) turned into their weights
// exp(s - m') in place, s[valid, n) into 0; m (running max) and l (running sum) updated.
// Returns the factor the accumulated output must be scaled by: exp(m - m'), 1 if unchanged.
inline float softmax_chunk(float* s, int n, int valid, float& m, float& l) {
  if (valid <= 0) {
    std::fill(s, s + n, 0.f);
    return 1.f;
  }
#if defined(__AVX512F__)
  const __mmask16 live = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                        live, s);
  const float new_m = std::max(m, _mm512_reduce_max_ps(x));
  const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, _mm512_set1_ps(new_m))));
  _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << n) - 1), e);
  const float sum = _mm512_reduce_add_ps(e);
#else
  float new_m = m;
  for (int t = 0; t < valid; ++t) new_m = std::max(new_m, s[t]);
  float sum = 0.f;
  for (int t = 0; t < n; ++t) {
    s[t] = t < valid ? std::exp(s[t] - new_m) : 0.f;
    sum += s[t];
  }
#endif
  const float alpha = std::exp(m - new_m);  // 0 on the first chunk (m = -inf)
  l = l * alpha + sum;
  m = new_m;
  return alpha;
}

// One pass over a sequence's keys for NR query vectors: online softmax, one chunk of at most
// kChunk keys (never across a cache block) at a time.
// q: [NR, D] float32, already times the softmax scale; limit[r]: keys at positions < limit[r];
// out_rows[r]: where row r's result goes (D elements of T); acc: [NR, D]; scores: [NR, kChunk].
template <int NR, typename T>
void attend_rows(const float* q, const int* limit, T* const* out_rows, const T* k_cache,
                 const T* v_cache, const int32_t* table, int block_size, int64_t row_stride,
                 int D, float* acc, float* scores) {
  float m[NR], l[NR], alpha[NR];
  for (int r = 0; r < NR; ++r) { m[r] = -std::numeric_limits<float>::infinity(); l[r] = 0.f; }
  std::fill(acc, acc + NR * D, 0.f);
  int longest = 0;
  for (int r = 0; r < NR; ++r) longest = std::max(longest, limit[r]);
  for (int pos = 0; pos < longest;) {
    const int offset = pos % block_size;
    const int n = std::min({kChunk, block_size - offset, longest - pos});
    const int64_t base =
        (static_cast<int64_t>(table[pos / block_size]) * block_size + offset) * row_stride;
    const int next = pos + n;  // the next chunk's rows, fetched while this one is computed
    if (next < longest) {
      const int64_t ahead = (static_cast<int64_t>(table[next / block_size]) * block_size +
                             next % block_size) * row_stride;
      const int rows = std::min({kChunk, block_size - next % block_size, longest - next});
      prefetch_rows(k_cache + ahead, row_stride, rows, D);
      prefetch_rows(v_cache + ahead, row_stride, rows, D);
    }
    dot_chunk<NR>(q, k_cache + base, row_stride, n, D, scores);
    for (int r = 0; r < NR; ++r)
      alpha[r] = softmax_chunk(scores + r * kChunk, n, std::min(n, limit[r] - pos), m[r], l[r]);
    axpy_chunk<NR>(scores, alpha, v_cache + base, row_stride, n, D, acc);
    pos += n;
  }
  for (int r = 0; r < NR; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int d = 0; d < D; ++d) out_rows[r][d] = static_cast<T>(acc[r * D + d] * inv);
  }
}

template <typename T>
using AttendFn = void (*)(const float*, const int*, T* const*, const T*, const T*, const int32_t*,
                          int, int64_t, int, float*, float*);

template <typename T>
AttendFn<T> attend_for(int rows) {
  switch (rows) {
    case 1: return attend_rows<1, T>;
    case 2: return attend_rows<2, T>;
    case 3: return attend_rows<3, T>;
    case 4: return attend_rows<4, T>;
    case 5: return attend_rows<5, T>;
    case 6: return attend_rows<6, T>;
    case 7: return attend_rows<7, T>;
    default: return attend_rows<kMaxRows, T>;
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& query_start_loc,
         const at::Tensor& seq_lens, const at::Tensor& seqs, double scale, at::Tensor& out) {
  const int Hq = static_cast<int>(q.size(1)), D = static_cast<int>(q.size(2));
  const int block_size = static_cast<int>(k_cache.size(1)), Hkv = static_cast<int>(k_cache.size(2));
  const int G = Hq / Hkv;
  const int64_t row_stride = static_cast<int64_t>(Hkv) * D;  // one token's row of the cache
  const int64_t table_stride = block_tables.stride(0);
  const int64_t q_stride[2] = {q.stride(0), q.stride(1)};
  const int64_t out_stride[2] = {out.stride(0), out.stride(1)};
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* seq_ids = seqs.data_ptr<int64_t>();
  const int64_t items = seqs.numel() * Hkv;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kMaxRows * D), acc(kMaxRows * D);
    std::vector<float> scores(kChunk * kMaxRows);
    int limit[kMaxRows];
    T* out_rows[kMaxRows];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = seq_ids[item / Hkv];
      const int h = static_cast<int>(item % Hkv);
      const int q_start = starts[b], q_len = starts[b + 1] - q_start, seq_len = lens[b];
      const int vectors = q_len * G;  // (row j, head g) pairs, j-major
      for (int v0 = 0; v0 < vectors; v0 += kMaxRows) {
        const int nr = std::min(kMaxRows, vectors - v0);
        for (int r = 0; r < nr; ++r) {
          const int j = (v0 + r) / G, head = h * G + (v0 + r) % G;
          const T* qrow = qp + (q_start + j) * q_stride[0] + head * q_stride[1];
          for (int d = 0; d < D; ++d) qf[r * D + d] = to_float(qrow[d]) * fscale;
          limit[r] = seq_len - q_len + 1 + j;
          out_rows[r] = op + (q_start + j) * out_stride[0] + head * out_stride[1];
        }
        attend_for<T>(nr)(qf.data(), limit, out_rows, kp + h * D, vp + h * D,
                          tables + b * table_stride, block_size, row_stride, D, acc.data(),
                          scores.data());
      }
    }
  });
}

void paged_attention_rows(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          const at::Tensor& seqs, double scale, at::Tensor out) {
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && q.sizes() == out.sizes(),
              "paged_attention_rows: the caches must be contiguous, q's and out's rows "
              "contiguous, out shaped as q");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "paged_attention_rows: q, out and the caches must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                  query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seqs.scalar_type() == at::kLong && seqs.is_contiguous(),
              "paged_attention_rows: block_tables, query_start_loc and seq_lens must be int32 "
              "(rows contiguous), seqs int64");
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, seqs, scale, out); break;
    case at::kBFloat16: run<c10::BFloat16>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, seqs, scale, out); break;
    case at::kHalf: run<c10::Half>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, seqs, scale, out); break;
    default: TORCH_CHECK(false, "paged_attention_rows: float32, bfloat16 or float16 only, got ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(qwen3_cpu, m) {
  m.def("paged_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor seqs, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(qwen3_cpu, CPU, m) {
  m.impl("paged_attention_rows", paged_attention_rows);
}
