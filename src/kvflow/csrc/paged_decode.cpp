// Decode attention read in place from the paged KV cache (kvflow/engine/paged_decode.py says when and why).
//
//   q       [B, Hq, D]        fp32, one query per sequence
//   kv      [2, S, Hkv, D]    fp32, one layer of the cache (0 = K, 1 = V; slot = block * block_size + offset)
//   tables  [B, M]            int64 block ids of each sequence (row b: its first ceil(lengths[b] / block_size))
//   lengths [B]               int64 keys of each sequence: positions [0, length), or the last `window` of them
//   out     [B, Hq, D]        softmax(scale * q . K^T) . V over those keys
//
// A work item is a sequence (or one KV head of it), over torch's own thread pool (at::parallel_for): its query heads'
// scores over the keys, tile by tile of 64 keys (a tile's K rows read from memory once, then from the caches for
// every head), the softmax, then the weighted sum of V the same way, in fp32. Scores go eight keys at a time with
// their horizontal sums reduced together, and each query head's output stays in registers over a tile's keys.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

// Scores of g query heads q [g, D] against n keys (key t's D floats at rows[t] + off):
// s[j * ld + t] = scale * q_j . k_t.
// With AVX2, eight keys at a time: one accumulator per key over D, the eight reduced together (hsum8) — a horizontal
// sum per dot was most of the op's time.
void scores(const float* q, int64_t g, const float* const* rows, int64_t off, int64_t n, int64_t D, float scale,
            float* s, int64_t ld) {
  for (int64_t j = 0; j < g; ++j) {
    const float* qj = q + j * D;
    float* sj = s + j * ld;
    int64_t t = 0;
#ifdef KVFLOW_AVX2
    if (D % 8 == 0) {
      const __m256 sc = _mm256_set1_ps(scale);
      for (; t + 8 <= n; t += 8) {
        const float* k[8];
        __m256 acc[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          k[i] = rows[t + i] + off;
          acc[i] = _mm256_setzero_ps();
        }
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qj + d);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + d), acc[i]);
        }
        _mm256_storeu_ps(sj + t, _mm256_mul_ps(kvflow::hsum8(acc), sc));
      }
    }
#endif
    for (; t < n; ++t) sj[t] = kvflow::dot(qj, rows[t] + off, D) * scale;
  }
}

// o [g, D] += p [g, n] . V (p's rows ld apart; key t's D floats at rows[t] + off). With AVX2, 64 of D at a time held
// in eight registers over the n keys; the rest of D by axpy.
void weighted_sum(const float* p, int64_t ld, int64_t g, const float* const* rows, int64_t off, int64_t n, int64_t D,
                  float* o) {
  int64_t d0 = 0;
#ifdef KVFLOW_AVX2
  for (; d0 + 64 <= D; d0 += 64) {
    for (int64_t j = 0; j < g; ++j) {
      const float* pj = p + j * ld;
      __m256 acc[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_loadu_ps(o + j * D + d0 + 8 * i);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 w = _mm256_broadcast_ss(pj + t);
        const float* v = rows[t] + off + d0;
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + j * D + d0 + 8 * i, acc[i]);
    }
  }
#endif
  if (d0 == D) return;
  for (int64_t j = 0; j < g; ++j)
    for (int64_t t = 0; t < n; ++t) kvflow::axpy(p[j * ld + t], rows[t] + off + d0, o + j * D + d0, D - d0);
}

constexpr int64_t kTile = 64;    // keys a pass takes through every head before the next: their rows stay in L1/L2

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
  // A work item is a sequence's KV heads [h0, h0 + hp): all of them when the sequences alone keep the threads busy,
  // else one head each (a lone long decode still uses every thread). Its keys' rows are listed once (block by
  // block), then each head's scores over K, the softmax, and the weighted sum of V.
  const int64_t hp = B >= 2 * at::get_num_threads() ? Hkv : 1, parts = Hkv / hp, Gp = hp * G;
  const int64_t v_off = S * row;                                  // V's row of a key, from its K row
  at::parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    std::vector<const float*> rows;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / parts, h0 = (w % parts) * hp, len = lp[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - lo;
      const int64_t* table = tp + b * M;
      rows.resize(n);
      for (int64_t blk = lo / block_size, pos = lo, t = 0; pos < len; ++blk) {
        const float* first = kp + table[blk] * block_size * row;
        for (const int64_t stop = std::min(len, (blk + 1) * block_size); pos < stop; ++pos)
          rows[t++] = first + (pos % block_size) * row;
      }
      p.resize(Gp * n);
      for (int64_t t0 = 0; t0 < n; t0 += kTile) {               // scores: each tile of K read once, every head
        for (int64_t hh = 0; hh < hp; ++hh) {
          const int64_t h = h0 + hh;
          scores(qp + (b * Hq + h * G) * D, G, rows.data() + t0, h * D, std::min(kTile, n - t0), D, sc,
                 p.data() + hh * G * n + t0, n);
        }
      }
      for (int64_t j = 0; j < Gp; ++j) kvflow::softmax_row(p.data() + j * n, n);    // each query head's row
      float* ob = op + (b * Hq + h0 * G) * D;
      std::fill(ob, ob + Gp * D, 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += kTile) {               // the weighted sum: each tile of V read once
        for (int64_t hh = 0; hh < hp; ++hh) {
          const int64_t h = h0 + hh;
          weighted_sum(p.data() + hh * G * n + t0, n, G, rows.data() + t0, v_off + h * D, std::min(kTile, n - t0), D,
                       ob + hh * G * D);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("paged_decode(Tensor q, Tensor kv, Tensor tables, Tensor lengths, int block_size, float scale, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvflow, CPU, m) { m.impl("paged_decode", &paged_decode); }
