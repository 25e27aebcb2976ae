// Decode attention read in place from the paged KV cache (kvflow/engine/paged_decode.py says when and why).
//
//   q       [B, Hq, D]        fp32, one query per sequence
//   kv      [2, S, Hkv, D]    fp32, one layer of the cache (0 = K, 1 = V; slot = block * block_size + offset)
//   tables  [B, M]            int64 block ids of each sequence (row b: its first ceil(lengths[b] / block_size))
//   lengths [B]               int64 keys of each sequence: positions [0, length), or the last `window` of them
//   out     [B, Hq, D]        softmax(scale * q . K^T) . V over those keys
//
// A work item is a piece of one decode's keys, all its KV heads (each key's row read whole), over torch's own thread
// pool, a thread taking the next piece when it is done: its query heads' scores over the piece's keys, tile by tile
// of 64 keys (a tile's K rows read from memory once, then from the caches for every head), exp(s - max) and its sum,
// then the weighted sum of V the same way, in fp32. Scores go eight keys at a time with their horizontal sums reduced
// together, and each query head's output stays in registers over a tile's keys. A decode cut in several pieces is
// merged by their log-sum-exps at the end. Pieces are about a quarter of a thread's share of the step's keys, so one
// long decode, alone or among short ones, keeps every thread busy to the end (one piece a KV head, as before, left a
// thread idle for a third of a lone decode on 3 KV heads and 2 threads).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
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
constexpr int64_t kMinPiece = 128;   // keys of a piece at least: below, a merge costs more than the balance gains

// A piece of one decode's keys, [lo, hi): the unit of work. Its output is left unnormalized, with each query head's
// running max and sum, when its sequence has other pieces (merged after), else normalized in place.
struct Piece {
  int64_t b, lo, hi;
};

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
  const int64_t v_off = S * row;                                  // V's row of a key, from its K row
  // The pieces: every decode's keys cut into pieces of about a quarter of a thread's share of the step's keys (at
  // least kMinPiece; a decode shorter than that is one piece), so that a lone long decode, or one long among short
  // ones, keeps every thread busy to the end. Each piece reads all KV heads of its keys (contiguous rows).
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> lo_of(B), first(B + 1);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    lo_of[b] = window > 0 ? std::max<int64_t>(0, lp[b] - window) : 0;
    total += lp[b] - lo_of[b];
  }
  const int64_t target = std::max<int64_t>(kMinPiece, (total + 4 * threads - 1) / (4 * threads));
  std::vector<Piece> pieces;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lp[b] - lo_of[b], k = std::max<int64_t>(1, n / target), size = (n + k - 1) / k;
    first[b] = static_cast<int64_t>(pieces.size());
    for (int64_t lo = lo_of[b]; lo < lp[b]; lo += size) pieces.push_back({b, lo, std::min(lp[b], lo + size)});
  }
  first[B] = static_cast<int64_t>(pieces.size());
  const int64_t P = first[B];
  std::vector<float> part_o(static_cast<size_t>(P) * Hq * D), part_m(P * Hq), part_l(P * Hq);
  std::atomic<int64_t> next{0};                           // each thread takes the next piece when it is done
  at::parallel_for(0, std::min(threads, P), 1, [&](int64_t, int64_t) {
    std::vector<float> p;
    std::vector<const float*> rows;
    for (int64_t w; (w = next.fetch_add(1)) < P;) {
      const Piece& pc = pieces[w];
      const int64_t b = pc.b, n = pc.hi - pc.lo;
      const int64_t* table = tp + b * M;
      rows.resize(n);
      for (int64_t blk = pc.lo / block_size, pos = pc.lo, t = 0; pos < pc.hi; ++blk) {
        const float* start = kp + table[blk] * block_size * row;
        for (const int64_t stop = std::min(pc.hi, (blk + 1) * block_size); pos < stop; ++pos)
          rows[t++] = start + (pos % block_size) * row;
      }
      p.resize(Hq * n);
      for (int64_t t0 = 0; t0 < n; t0 += kTile)                 // scores: each tile of K read once, every head
        for (int64_t h = 0; h < Hkv; ++h)
          scores(qp + (b * Hq + h * G) * D, G, rows.data() + t0, h * D, std::min(kTile, n - t0), D, sc,
                 p.data() + h * G * n + t0, n);
      float* mw = part_m.data() + w * Hq;
      float* lw = part_l.data() + w * Hq;
      for (int64_t j = 0; j < Hq; ++j) {                        // each query head's row: exp(s - max), its sum
        mw[j] = kvflow::max_row(p.data() + j * n, n);
        lw[j] = kvflow::exp_sum_row(p.data() + j * n, n, mw[j]);
      }
      const bool alone = first[b + 1] - first[b] == 1;
      float* ow = alone ? op + b * Hq * D : part_o.data() + w * Hq * D;
      std::fill(ow, ow + Hq * D, 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += kTile)                 // the weighted sum: each tile of V read once
        for (int64_t h = 0; h < Hkv; ++h)
          weighted_sum(p.data() + h * G * n + t0, n, G, rows.data() + t0, v_off + h * D, std::min(kTile, n - t0), D,
                       ow + h * G * D);
      if (alone)
        for (int64_t j = 0; j < Hq; ++j) {
          const float inv = 1.f / lw[j];
          for (int64_t d = 0; d < D; ++d) ow[j * D + d] *= inv;
        }
    }
  });
  for (int64_t b = 0; b < B; ++b) {                       // a decode cut in pieces: merged by their log-sum-exps
    if (first[b + 1] - first[b] == 1) continue;
    for (int64_t j = 0; j < Hq; ++j) {
      float top = part_m[first[b] * Hq + j];
      for (int64_t w = first[b] + 1; w < first[b + 1]; ++w) top = std::max(top, part_m[w * Hq + j]);
      float* o = op + (b * Hq + j) * D;
      std::fill(o, o + D, 0.f);
      float sum = 0.f;
      for (int64_t w = first[b]; w < first[b + 1]; ++w) {
        const float f = kvflow::exp1(part_m[w * Hq + j] - top);
        sum += f * part_l[w * Hq + j];
        kvflow::axpy(f, part_o.data() + (w * Hq + j) * D, o, D);
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("paged_decode(Tensor q, Tensor kv, Tensor tables, Tensor lengths, int block_size, float scale, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvflow, CPU, m) { m.impl("paged_decode", &paged_decode); }
