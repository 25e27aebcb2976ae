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
#include <vector>

#include "simd.h"

namespace {

using kvflow::axpy;
using kvflow::dot;
using kvflow::exp_row;

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

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("paged_decode(Tensor q, Tensor kv, Tensor tables, Tensor lengths, int block_size, float scale, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvflow, CPU, m) { m.impl("paged_decode", &paged_decode); }
