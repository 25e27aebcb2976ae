// A decoder layer's elementwise parts, each one op (kvflow/model/layer.py and model/linear.py say when and why).
//
//   rms_norm(x [.., N], w [N], eps)              x / sqrt(mean(x^2) + eps) * w, row by row
//   add_rms_norm(x, y, w, eps) -> (s, n)         s = x + y (the residual), n = rms_norm(s, w, eps)
//   rotary_(x [T, H, D], cos [T, D], sin [T, D], heads)
//                                                in place, heads [0, heads) of each row: x * cos + rotate_half(x) *
//                                                sin, rotate_half(x) = (-x[D/2:], x[:D/2]) (Llama's, NeoX's layout),
//                                                rounded as torch rounds it (rotate_head)
//   silu_mul(gu [.., 2I]) -> [.., I]             silu(gu[.., :I]) * gu[.., I:] (a gated MLP's packed gate|up)
//
// All fp32 on the host. Rows go over torch's thread pool only when there are enough of them to pay for waking it
// (a prefill chunk); a decode step's few rows run on the calling thread.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "simd.h"

namespace {

constexpr int64_t kGrainElements = 1 << 15;    // ~32K floats a task: below that a row loop is cheaper than a wake-up

template <typename F>
void each_row(int64_t rows, int64_t width, F&& fn) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

void check_fp32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              ": expected a contiguous fp32 host tensor");
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(kvflow::dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t d = 0; d < n; ++d) out[d] = w[d] * (x[d] * inv);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_fp32(x, "x");
  check_fp32(w, "w");
  const int64_t n = w.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n, "x's last dimension must be the weight's size");
  auto out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  each_row(x.numel() / std::max<int64_t>(n, 1), n,
           [&](int64_t r) { norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps)); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& w,
                                                double eps) {
  check_fp32(x, "x");
  check_fp32(y, "y");
  check_fp32(w, "w");
  const int64_t n = w.numel();
  TORCH_CHECK(x.sizes() == y.sizes() && x.dim() >= 1 && x.size(-1) == n, "x and y: the same shape [.., N]");
  auto sum = at::empty_like(x), out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *yp = y.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  each_row(x.numel() / std::max<int64_t>(n, 1), n, [&](int64_t r) {
    float* s = sp + r * n;
    for (int64_t d = 0; d < n; ++d) s[d] = xp[r * n + d] + yp[r * n + d];
    norm_row(s, wp, op + r * n, n, static_cast<float>(eps));
  });
  return {sum, out};
}

// One head's rotation in place, rounded as torch rounds transformers' q * cos + rotate_half(q) * sin: each product,
// then their sum. No multiply-add is fused (the library is built with -mfma, and GCC would contract these), so the
// result is the model's own rotation bit for bit (model/layer.py: the module and the fused layer compute alike).
__attribute__((optimize("fp-contract=off"))) void rotate_head(float* __restrict a, const float* __restrict c,
                                                              const float* __restrict s, int64_t half) {
  float* __restrict b = a + half;
  for (int64_t i = 0; i < half; ++i) {
    const float lo = a[i], hi = b[i];
    a[i] = lo * c[i] - hi * s[i];
    b[i] = hi * c[i + half] + lo * s[i + half];
  }
}

void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  check_fp32(x, "x");
  check_fp32(cos, "cos");
  check_fp32(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes(), "x [T, H, D], cos and sin [T, D]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == D && D % 2 == 0 && heads >= 0 && heads <= H,
              "x [T, H, D] with D even, cos and sin [T, D], 0 <= heads <= H");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  each_row(T, heads * D, [&](int64_t t) {
    for (int64_t h = 0; h < heads; ++h) rotate_head(xp + (t * H + h) * D, cp + t * D, sp + t * D, half);
  });
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_fp32(gu, "gu");
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "gu: [.., 2I]");
  const int64_t width = gu.size(-1), n = width / 2, rows = gu.numel() / std::max<int64_t>(width, 1);
  auto sizes = gu.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  each_row(rows, width, [&](int64_t r) {
    const float *g = gp + r * width, *u = g + n;
    float* o = op + r * n;
    int64_t d = 0;
#ifdef KVFLOW_AVX2
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; d + 8 <= n; d += 8) {
      const __m256 x = _mm256_loadu_ps(g + d);
      const __m256 e = kvflow::exp8(_mm256_sub_ps(zero, x));
      _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + d)));
    }
#endif
    for (; d < n; ++d) o[d] = g[d] / (1.f + kvflow::exp1(-g[d])) * u[d];
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor y, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvflow, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
}
