// Attention of prefill chunks: queries at positions [start, start + n) of their sequences over keys [0, start + n)
// (causal; with a window, only the last `window` keys of each query), in fp32 on the host (kvflow/model/
// chunk_attention.py says when and why).
//
//   paged_chunks(q [R, Hq, D], kv [2, S, Hkv, D], tables [B, M], starts [B], offsets [B + 1], block_size, scale,
//                window) -> [R, Hq, D]
//       chunk b's queries are rows [offsets[b], offsets[b + 1]) of q, its keys read in place from the paged cache
//       through row b of the block tables (slot = block * block_size + offset), as paged_decode.cpp reads them
//   chunk_attention(q [n, Hq, D], k [T, Hkv, D], v [T, Hkv, D], start, scale, window) -> [n, Hq, D]
//       one chunk over keys in tensors (T = start + n; any strides with D contiguous: a [1, Hkv, T, D] cache's
//       k[0].transpose(0, 1) as it is)
//
// Flash attention, GQA-aware: a work item is a block of up to kRows query positions of one chunk and one KV head,
// and that KV head's G query heads are its rows (G x kRows of them), so each key's K and V are read once for all of
// them. Keys go in tiles of kTile at fixed positions (tile i is keys [i * kTile, (i + 1) * kTile), whatever the
// chunk): K's tile is packed transposed in strips of 16 keys ([D][16]) and the scores of six rows x sixteen keys at a
// time are an outer-product kernel (a broadcast query value times two vectors of keys, twelve accumulators); each row
// keeps its running max and sum (online softmax) and its output in a buffer, to which the tile's p . V adds six rows
// x sixteen dims at a time. Masked keys (past the query, or before its window) get p = 0. The causal triangle is
// skipped a block of rows at a time: a block reads keys up to its last query only.
//
// A query's result depends on its position and its keys only, never on the chunk it came in or the rows beside it:
// its scores, max, sum and p . V run over the same tiles in the same order, and a masked key's p = 0 adds exactly
// nothing. So a prompt attended in one call, in chunks of any size, or as one engine step among others gives the
// same bits (kvflow/model/attention.py routes the full prefill here too: that is what makes restoration exact).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kRows = 32;     // query positions of a work item (x G query heads: its rows) ...
constexpr int64_t kLong = 128;    // ... and of one over more than kLongAt keys: each pass over K and V serves more rows
constexpr int64_t kLongAt = 4096;
constexpr int64_t kTile = 128;    // keys of a tile (a multiple of 16)
constexpr int kQkRows = 6;        // rows of the scores' register block (16 keys: two float vectors a row)
constexpr int kPvRows = 6;        // rows of p . V's register block (16 dims: two float vectors a row)

// s[r * kTile + j] = scale * q_r . K_j for rows [0, RB) and the strip's 16 keys j (the strip packed [D][16], zero
// past the tile's keys), each dot product one fused multiply-add chain over D in float.
template <int RB>
inline void qk_strip(const float* const* q, const float* ks, int64_t D, float scale, float* s) {
#ifdef KVFLOW_AVX2
  __m256 a[RB][2];
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = ks + d * 16;
    const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8);
#pragma GCC unroll 6
    for (int r = 0; r < RB; ++r) {
      const __m256 b = _mm256_broadcast_ss(q[r] + d);
      a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(s + r * kTile, _mm256_mul_ps(a[r][0], sc));
    _mm256_storeu_ps(s + r * kTile + 8, _mm256_mul_ps(a[r][1], sc));
  }
#else
  for (int r = 0; r < RB; ++r)
    for (int64_t j = 0; j < 16; ++j) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[r][d] * ks[d * 16 + j];
      s[r * kTile + j] = acc * scale;
    }
#endif
}

// o[r * D + j] += sum_t p[r * kTile + t] * V_t[d + j] for rows [0, RB), keys [0, tn) and the 16 dims from d (vt: the
// tile's V rows packed [kTile][D]).
template <int RB>
inline void pv_strip(const float* p, const float* vt, int64_t tn, int64_t D, int64_t d, float* o) {
#ifdef KVFLOW_AVX2
  __m256 a0[RB], a1[RB];
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r) {
    a0[r] = _mm256_loadu_ps(o + r * D + d);
    a1[r] = _mm256_loadu_ps(o + r * D + d + 8);
  }
  for (int64_t t = 0; t < tn; ++t) {
    const __m256 v0 = _mm256_loadu_ps(vt + t * D + d), v1 = _mm256_loadu_ps(vt + t * D + d + 8);
#pragma GCC unroll 6
    for (int r = 0; r < RB; ++r) {
      const __m256 b = _mm256_broadcast_ss(p + r * kTile + t);
      a0[r] = _mm256_fmadd_ps(b, v0, a0[r]);
      a1[r] = _mm256_fmadd_ps(b, v1, a1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(o + r * D + d, a0[r]);
    _mm256_storeu_ps(o + r * D + d + 8, a1[r]);
  }
#else
  for (int r = 0; r < RB; ++r)
    for (int64_t t = 0; t < tn; ++t)
      for (int64_t j = 0; j < 16; ++j) o[r * D + d + j] += p[r * kTile + t] * vt[t * D + d + j];
#endif
}

template <int Rb, typename F>
inline void by_blocks(int64_t rows, F&& fn) {      // fn(r0, rb) over blocks of Rb rows, the last one shorter
  int64_t r = 0;
  for (; r + Rb <= rows; r += Rb) fn(r, std::integral_constant<int, Rb>{});
  switch (rows - r) {
    case 5: fn(r, std::integral_constant<int, 5>{}); break;
    case 4: fn(r, std::integral_constant<int, 4>{}); break;
    case 3: fn(r, std::integral_constant<int, 3>{}); break;
    case 2: fn(r, std::integral_constant<int, 2>{}); break;
    case 1: fn(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// Where a work item's keys are: key t of head h at k[t - lo] + h * hk (K) and v[t - lo] + h * hv (V).
struct Keys {
  std::vector<const float*> k, v;
  int64_t hk = 0, hv = 0;
};

struct Scratch {
  std::vector<float> kt, vt, s, o, m, l;
  std::vector<const float*> q;
};

// One work item: query positions [p0, p0 + rows) (their G heads' query rows at q + i * ldq + (h * G + g) * D, the
// results at out the same way) over keys [lo, p0 + rows) given by `keys` (index t - lo).
void item(const float* q, int64_t ldq, float* out, int64_t h, int64_t G, int64_t D, int64_t p0, int64_t rows,
          int64_t lo, const Keys& keys, float scale, int64_t window, Scratch& w) {
  const int64_t R = rows * G, hi = p0 + rows;
  w.kt.resize(D * kTile);
  w.vt.resize(kTile * D);
  w.s.resize(R * kTile);
  w.o.assign(R * D, 0.f);
  w.m.assign(R, -std::numeric_limits<float>::infinity());
  w.l.assign(R, 0.f);
  w.q.resize(R);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < G; ++g) w.q[i * G + g] = q + i * ldq + (h * G + g) * D;
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int64_t tn = std::min(kTile, hi - t0), tn16 = (tn + 15) / 16 * 16;
    for (int64_t t = 0; t < tn16;) {                       // K in strips of 16 keys [D][16], V's rows [t][D]
      float* ks = w.kt.data() + (t / 16) * D * 16 + t % 16;
      int64_t step = 1;
#ifdef KVFLOW_AVX2
      if (t % 8 == 0 && t + 8 <= tn) {                     // eight keys at once: 8 x 8 blocks transposed in registers
        const float* rows8[8];
        for (int i = 0; i < 8; ++i) rows8[i] = keys.k[t0 + t + i - lo] + h * keys.hk;
        for (int64_t d = 0; d < D; d += 8) kvflow::transpose8(rows8, d, ks + d * 16, 16);
        step = 8;
      } else
#endif
      if (t < tn) {
        const float* kr = keys.k[t0 + t - lo] + h * keys.hk;
        for (int64_t d = 0; d < D; ++d) ks[d * 16] = kr[d];
      } else {
        for (int64_t d = 0; d < D; ++d) ks[d * 16] = 0.f;
      }
      for (int64_t i = t; i < std::min(t + step, tn); ++i)
        std::memcpy(w.vt.data() + i * D, keys.v[t0 + i - lo] + h * keys.hv, D * sizeof(float));
      t += step;
    }
    for (int64_t j = 0; j < tn16; j += 16)                 // a strip's 4 KB stays in L1 over every row
      by_blocks<kQkRows>(R, [&](int64_t r0, auto rb) {
        qk_strip<decltype(rb)::value>(w.q.data() + r0, w.kt.data() + j * D, D, scale, w.s.data() + r0 * kTile + j);
      });
    for (int64_t r = 0; r < R; ++r) {                      // online softmax, row by row
      const int64_t pos = p0 + r / G;
      const int64_t a = std::max<int64_t>(window > 0 ? pos - window + 1 : 0, t0) - t0;
      const int64_t b = std::min<int64_t>(pos + 1, t0 + tn) - t0;
      float* sr = w.s.data() + r * kTile;
      if (a >= b) {                                        // nothing of this tile is its to see
        std::fill(sr, sr + tn, 0.f);
        continue;
      }
      const float top = std::max(w.m[r], kvflow::max_row(sr + a, b - a));
      const float alpha = kvflow::exp1(w.m[r] - top);      // 0 for the first keys (m = -inf)
      const float sum = kvflow::exp_sum_row(sr + a, b - a, top);
      std::fill(sr, sr + a, 0.f);
      std::fill(sr + b, sr + tn, 0.f);
      if (alpha != 1.f) {
        float* orow = w.o.data() + r * D;
        for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
      }
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = top;
    }
    for (int64_t d = 0; d < D; d += 16)                    // a 16-dim column of V's tile stays in L1 over every row
      by_blocks<kPvRows>(R, [&](int64_t r0, auto rb) {
        pv_strip<decltype(rb)::value>(w.s.data() + r0 * kTile, w.vt.data(), tn, D, d, w.o.data() + r0 * D);
      });
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float inv = 1.f / w.l[r];
      const float* orow = w.o.data() + r * D;
      float* dst = out + i * ldq + (h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = orow[d] * inv;
    }
}

struct Work {
  int64_t chunk, h, i0, rows;
};

void check_q(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu() && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q: [rows, Hq, D] fp32 contiguous host tensor");
  TORCH_CHECK(q.size(2) % 16 == 0, "head size ", q.size(2), " is not a multiple of 16");
}

// Runs `work` over torch's thread pool; keys_of(chunk, lo, hi, keys) lists a chunk's key rows [lo, hi).
template <typename KeysOf>
void run(const std::vector<Work>& work, const at::Tensor& q, at::Tensor& out, int64_t Hkv, const int64_t* starts,
         const int64_t* offsets, double scale, int64_t window, KeysOf&& keys_of) {
  const int64_t Hq = q.size(1), D = q.size(2), G = Hq / Hkv, ldq = Hq * D;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Items go to whichever thread is free next (an atomic counter): at::parallel_for alone splits a range into equal
  // parts, and the items are of unequal size (sorted longest first).
  std::atomic<int64_t> next{0};
  const int64_t size = static_cast<int64_t>(work.size());
  at::parallel_for(0, std::min<int64_t>(size, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch w;
    Keys keys;
    for (int64_t x = next++; x < size; x = next++) {
      const Work& it = work[x];
      const int64_t p0 = starts[it.chunk] + it.i0, hi = p0 + it.rows;
      // the first key any row may see, down to its tile's first: tiles stay at fixed positions (header)
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) / kTile * kTile : 0;
      keys_of(it.chunk, lo, hi, keys);
      const int64_t row = offsets[it.chunk] + it.i0;
      item(qp + row * ldq, ldq, op + row * ldq, it.h, G, D, p0, it.rows, lo, keys, static_cast<float>(scale), window,
           w);
    }
  });
}

std::vector<Work> plan(int64_t chunks, const int64_t* starts, const int64_t* offsets, int64_t Hkv) {
  std::vector<Work> work;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t rows = starts[c] + offsets[c + 1] - offsets[c] > kLongAt ? kLong : kRows;
    for (int64_t i0 = offsets[c]; i0 < offsets[c + 1]; i0 += rows)
      for (int64_t h = 0; h < Hkv; ++h)
        work.push_back({c, h, i0 - offsets[c], std::min(rows, offsets[c + 1] - i0)});
  }
  // the longest items first (a chunk's later rows see more keys), so the pool's last tasks are short ones
  std::stable_sort(work.begin(), work.end(), [](const Work& a, const Work& b) { return a.i0 > b.i0; });
  return work;
}

at::Tensor paged_chunks(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables, const at::Tensor& starts,
                        const at::Tensor& offsets, int64_t block_size, double scale, int64_t window) {
  check_q(q);
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.scalar_type() == at::kFloat && kv.is_contiguous(),
              "kv: [2, S, Hkv, D] fp32 contiguous");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(), "tables: [B, M] int64");
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == at::kLong && starts.is_contiguous(), "starts: [B] int64");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
              offsets.size(0) == starts.size(0) + 1, "offsets: [B + 1] int64");
  const int64_t B = starts.size(0), Hq = q.size(1), D = q.size(2), S = kv.size(1), Hkv = kv.size(2),
                M = tables.size(1);
  TORCH_CHECK(kv.size(3) == D && Hq % Hkv == 0 && tables.size(0) == B && block_size >= 1 && S % block_size == 0,
              "shapes disagree");
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  TORCH_CHECK(op[0] == 0 && op[B] == q.size(0), "offsets must cover q's rows");
  const int64_t blocks = S / block_size;
  for (int64_t b = 0; b < B; ++b) {                        // every read below stays inside the layer
    const int64_t end = sp[b] + op[b + 1] - op[b];
    TORCH_CHECK(sp[b] >= 0 && op[b + 1] >= op[b] && end <= M * block_size, "chunk ", b, " outside its block table");
    for (int64_t i = 0; i < (end + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * M + i] >= 0 && tp[b * M + i] < blocks, "block id ", tp[b * M + i], " outside the cache");
  }
  auto out = at::empty_like(q);
  const float* kp = kv.data_ptr<float>();
  const int64_t row = Hkv * D, v_off = S * row;
  run(plan(B, sp, op, Hkv), q, out, Hkv, sp, op, scale, window, [&](int64_t c, int64_t lo, int64_t hi, Keys& keys) {
    keys.hk = keys.hv = D;
    keys.k.resize(hi - lo);
    keys.v.resize(hi - lo);
    const int64_t* table = tp + c * M;
    for (int64_t pos = lo; pos < hi; ++pos) {
      const float* k = kp + (table[pos / block_size] * block_size + pos % block_size) * row;
      keys.k[pos - lo] = k;
      keys.v[pos - lo] = k + v_off;
    }
  });
  return out;
}

at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start, double scale,
                           int64_t window) {
  check_q(q);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.device().is_cpu() && v.device().is_cpu() &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.stride(2) == 1 && v.stride(2) == 1,
              "k, v: [T, Hkv, D] fp32 host tensors, D contiguous");
  const int64_t n = q.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == q.size(2) && q.size(1) % Hkv == 0 && start >= 0 && k.size(0) == start + n,
              "shapes disagree: keys must be positions [0, start + n)");
  auto out = at::empty_like(q);
  const int64_t starts[1] = {start}, offsets[2] = {0, n};
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  run(plan(1, starts, offsets, Hkv), q, out, Hkv, starts, offsets, scale, window,
      [&](int64_t, int64_t lo, int64_t hi, Keys& keys) {
        keys.hk = k.stride(1);
        keys.hv = v.stride(1);
        keys.k.resize(hi - lo);
        keys.v.resize(hi - lo);
        for (int64_t pos = lo; pos < hi; ++pos) {
          keys.k[pos - lo] = kp + pos * ks;
          keys.v[pos - lo] = vp + pos * vs;
        }
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("paged_chunks(Tensor q, Tensor kv, Tensor tables, Tensor starts, Tensor offsets, int block_size, float scale, "
        "int window) -> Tensor");
  m.def("chunk_attention(Tensor q, Tensor k, Tensor v, int start, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvflow, CPU, m) {
  m.impl("paged_chunks", &paged_chunks);
  m.impl("chunk_attention", &chunk_attention);
}
