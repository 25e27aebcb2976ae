// The inner loops kvflow's native ops share — a dot product, o += p v, exp — in AVX2 + FMA where the build has them
// (native.py builds with them when the CPU reports them), else in plain C++.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVFLOW_AVX2 1
#endif

namespace kvflow {

#ifdef KVFLOW_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums at once (three rounds of pairwise adds).
inline __m256 hsum8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// dst[i * ld + j] = src[j][d + i] for i, j in [0, 8): eight rows' eight values from d, transposed (unpack, shuffle,
// swap halves).
inline void transpose8(const float* const* src, int64_t d, float* dst, int64_t ld) {
  __m256 r[8], t[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src[j] + d);
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {
    r[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float sum = 0.f;
#ifdef KVFLOW_AVX2
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
#ifdef KVFLOW_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
#endif
  for (; d < n; ++d) o[d] += p * v[d];
}

// exp(x) as 2^(x log2 e) = 2^n * 2^f with n = round, |f| <= 1/2, and 2^f by its degree-7 Taylor polynomial (relative
// error < 2e-7, about one float ulp) on [-87, 88]; below -87 it is 0 (where std::exp gives a denormal that a softmax
// or a SiLU cannot use), above 88 a finite ~2^127 instead of inf (1 / (1 + it) is 0 all the same).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kPoly[8] = {1.5252733804059840e-05f, 1.5403530393381609e-04f, 1.3333558146428443e-03f,
                            9.6181291076284772e-03f, 5.5504108664821580e-02f, 2.4022650695910071e-01f,
                            6.9314718055994531e-01f, 1.f};

inline float exp1(float x) {
  const float y = std::min(std::max(x * kLog2e, -126.f), 127.f);
  const float n = std::nearbyint(y), f = y - n;
  float r = kPoly[0];
  for (int i = 1; i < 8; ++i) r = r * f + kPoly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : r * scale;
}

#ifdef KVFLOW_AVX2
inline __m256 exp8(__m256 x) {
  const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _mm256_set1_ps(-126.f)),
                                 _mm256_set1_ps(127.f));
  const __m256 k = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, k);
  __m256 r = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 8; ++i) r = _mm256_fmadd_ps(r, f, _mm256_set1_ps(kPoly[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  r = _mm256_mul_ps(r, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ), r);
}
#endif

inline float max_row(const float* row, int64_t n) {                 // max of row[0 .. n), n >= 1
  int64_t t = 0;
  float top = row[0];
#ifdef KVFLOW_AVX2
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(row);
    for (t = 8; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(row + t));
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    top = _mm_cvtss_f32(_mm_max_ss(r, _mm_shuffle_ps(r, r, 1)));
  }
#endif
  for (; t < n; ++t) top = std::max(top, row[t]);
  return top;
}

inline float exp_sum_row(float* row, int64_t n, float shift) {      // row[t] = exp(row[t] - shift); their sum
  int64_t t = 0;
  float sum = 0.f;
#ifdef KVFLOW_AVX2
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), sh));
    _mm256_storeu_ps(row + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; t < n; ++t) sum += (row[t] = exp1(row[t] - shift));
  return sum;
}

inline void softmax_row(float* row, int64_t n) {                    // in place, n >= 1
  const float inv = 1.f / exp_sum_row(row, n, max_row(row, n));
  for (int64_t t = 0; t < n; ++t) row[t] *= inv;
}

}  // namespace kvflow
