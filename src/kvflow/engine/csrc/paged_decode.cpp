// Decode attention read in place from the paged KV cache (kvflow/engine/paged_decode.py says when and why).
//
//   q       [B, Hq, D]        fp32, one query per sequence
//   kv      [2, S, Hkv, D]    fp32, one layer of the cache (0 = K, 1 = V; slot = block * block_size + offset)
//   tables  [B, M]            int64 block ids of each sequence (row b: its first ceil(lengths[b] / block_size))
//   lengths [B]               int64 keys of each sequence: positions [0, length), or the last `window` of them
//   out     [B, Hq, D]        softmax(scale * q . K^T) . V over those keys
//
// A work item is a sequence (or one KV head of it): its query heads' scores over the keys (K read once), the softmax,
// then the weighted sum of V (V read once), in fp32, over torch's own thread pool (at::parallel_for).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// The three inner loops — q . k, the softmax's exp, o += p v — in AVX2 + FMA where the build has them (the module
// builds with them when the CPU reports them), else in plain C++.

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
  }
  for (; d + 8 <= n; d += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
  sum = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline void axpy(float p, const float* v, float* o, int64_t n) {     // o += p * v
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
#endif
  for (; d < n; ++d) o[d] += p * v[d];
}

// exp(x) for x <= 0 (a softmax's shifted scores): 2^(x log2 e) = 2^n * 2^f with n = round, |f| <= 1/2, and 2^f by
// its degree-7 Taylor polynomial (relative error < 2e-7, about one float ulp); below -87 (2^-126) it is 0, where
// std::exp would give a denormal a softmax cannot use.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kPoly[8] = {1.5252733804059840e-05f, 1.5403530393381609e-04f, 1.3333558146428443e-03f,
                            9.6181291076284772e-03f, 5.5504108664821580e-02f, 2.4022650695910071e-01f,
                            6.9314718055994531e-01f, 1.f};

inline float exp_nonpositive(float x) {
  const float y = std::max(x * kLog2e, -126.f);
  const float n = std::nearbyint(y), f = y - n;
  float r = kPoly[0];
  for (int i = 1; i < 8; ++i) r = r * f + kPoly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : r * scale;
}

inline void exp_row(float* row, int64_t n) {                        // row[t] = exp_nonpositive(row[t])
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 log2e = _mm256_set1_ps(kLog2e), floor = _mm256_set1_ps(-126.f), cut = _mm256_set1_ps(-87.f);
  for (; t + 8 <= n; t += 8) {
    const __m256 x = _mm256_loadu_ps(row + t);
    const __m256 y = _mm256_max_ps(_mm256_mul_ps(x, log2e), floor);
    const __m256 k = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(y, k);
    __m256 r = _mm256_set1_ps(kPoly[0]);
    for (int i = 1; i < 8; ++i) r = _mm256_fmadd_ps(r, f, _mm256_set1_ps(kPoly[i]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    r = _mm256_mul_ps(r, _mm256_castsi256_ps(bits));
    _mm256_storeu_ps(row + t, _mm256_andnot_ps(_mm256_cmp_ps(x, cut, _CMP_LT_OQ), r));
  }
#endif
  for (; t < n; ++t) row[t] = exp_nonpositive(row[t]);
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                        const at::Tensor& lengths, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, Hq, D] fp32 contiguous");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.scalar_type() == at::kFloat && kv.is_contiguous(),
              "kv: [2, S, Hkv, D] fp32 contiguous");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(), "tables: [B, M] int64");
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong && lengths.is_contiguous(),
              "lengths: [B] int64");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t S = kv.size(1), Hkv = kv.size(2), M = tables.size(1);
  TORCH_CHECK(kv.size(3) == D && Hq % Hkv == 0 && tables.size(0) == B && lengths.size(0) == B &&
              block_size >= 1 && S % block_size == 0, "shapes disagree");
  const int64_t G = Hq / Hkv;
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kv.data_ptr<float>();
  const float* vp = kp + S * Hkv * D;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = S / block_size;
  for (int64_t b = 0; b < B; ++b) {                       // every read below stays inside the layer
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= M * block_size, "length ", lp[b], " outside the block table");
    for (int64_t i = 0; i < (lp[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * M + i] >= 0 && tp[b * M + i] < blocks, "block id ", tp[b * M + i], " outside the cache");
  }
  const float sc = static_cast<float>(scale);
  const int64_t row = Hkv * D;
  // Keys [lo, len) of a sequence block by block: fn(pointer to the key's row [Hkv, D] in `base`, its index from lo).
  const auto each_key = [&](const float* base, const int64_t* table, int64_t lo, int64_t len, auto&& fn) {
    for (int64_t blk = lo / block_size, pos = lo; pos < len; ++blk) {
      const float* first = base + table[blk] * block_size * row;
      for (const int64_t stop = std::min(len, (blk + 1) * block_size); pos < stop; ++pos)
        fn(first + (pos % block_size) * row, pos - lo);
    }
  };

  // A work item is a sequence's KV heads [h0, h0 + hp): all of them (each key's whole row read as one run) when
  // the sequences alone keep the threads busy, else one head each (a lone long decode still uses every thread).
  const int64_t hp = B >= 2 * at::get_num_threads() ? Hkv : 1, parts = Hkv / hp, Gp = hp * G;
  at::parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / parts, h0 = (w % parts) * hp, len = lp[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - lo;
      const int64_t* table = tp + b * M;
      p.assign(Gp * n, 0.f);
      const float* qb = qp + (b * Hq + h0 * G) * D;               // query heads of KV heads h0 .. h0 + hp - 1
      each_key(kp + h0 * D, table, lo, len, [&](const float* k, int64_t t) {      // scores: K of each key read once
        for (int64_t j = 0; j < Gp; ++j) p[j * n + t] = dot(qb + j * D, k + (j / G) * D, D) * sc;
      });
      for (int64_t j = 0; j < Gp; ++j) {                       // softmax of each query head's row
        float* scores = p.data() + j * n;
        float top = scores[0];
        for (int64_t t = 1; t < n; ++t) top = std::max(top, scores[t]);
        for (int64_t t = 0; t < n; ++t) scores[t] -= top;
        exp_row(scores, n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) sum += scores[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) scores[t] *= inv;
      }
      float* ob = op + (b * Hq + h0 * G) * D;
      std::fill(ob, ob + Gp * D, 0.f);
      each_key(vp + h0 * D, table, lo, len, [&](const float* v, int64_t t) {      // the weighted sum: V read once
        for (int64_t j = 0; j < Gp; ++j) axpy(p[j * n + t], v + (j / G) * D, ob + j * D, D);
      });
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvflow, m) {
  m.def("paged_decode(Tensor q, Tensor kv, Tensor tables, Tensor lengths, int block_size, float scale, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvflow, CPU, m) { m.impl("paged_decode", &paged_decode); }
