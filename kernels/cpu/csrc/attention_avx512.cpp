// Paged attention's AVX-512 path: attention_impl.h's walk over the primitives below, 16 floats a
// register. Compiled for AVX-512 by the target pragma (the build's flags stay AVX2), called only
// when cpuid reports it (kernels/cpu/csrc/isa.cpp).
//
// The output accumulation (p @ V, column by column) and exp are lane-wise, the AVX2 path's
// operations in wider registers; a key's score (a dot product over the head) and a block's sum
// of probabilities reduce 16 lanes in a fixed tree. Both are fixed by the head size and the
// block's keys alone, so a row's bits do not depend on the batch on this path either.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// After the pragma: its templates are instantiated here for AVX-512 (its standard headers, above,
// are not).
#include "attention_impl.h"

namespace {

using namespace deepserve_cpu::attention;

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const uint16_t* p, __mmask16 m) {
  // bfloat16 is the high half of a float32: widening is a 16-bit shift, exact.
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lanes [i, i + 16) of a row of d floats (d a multiple of 8): all 16, or 8 at the end.
inline __mmask16 lanes(int64_t i, int64_t d) { return d - i >= 16 ? 0xFFFF : 0x00FF; }

// vec_math.h's exp8, lane for lane: the same range reduction and polynomial.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i ni = _mm512_cvtps_epi32(n);
  const __m512i h1 = _mm512_srai_epi32(ni, 1), h2 = _mm512_sub_epi32(ni, h1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 p1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h1, bias), 23));
  const __m512 p2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h2, bias), 23));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under),
                             _mm512_mul_ps(_mm512_mul_ps(y, p1), p2));
}

// 16 lanes to one float in a fixed tree (halves, then quarters, ...).
inline float hsum(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of eight registers at once, each key's lanes added in exactly `hsum`'s tree (lane i with
// i + 8, then i + 4, i + 2, i + 1), so the scores keep their bits: 15 vector adds and their
// shuffles for eight keys instead of eight horizontal sums.
inline __m256 hsum8(const __m512 (&a)[8]) {
  __m512 b[4], c[2];
  for (int j = 0; j < 4; ++j)  // [a_j lanes i + (i + 8) | a_{j+4}'s]
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 4], 0x44),
                         _mm512_shuffle_f32x4(a[j], a[j + 4], 0xEE));
  for (int j = 0; j < 2; ++j)  // quarters: keys j, j + 4, j + 2, j + 6, lanes i + (i + 4)
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[j], b[j + 2], 0x88),
                         _mm512_shuffle_f32x4(b[j], b[j + 2], 0xDD));
  // per quarter: two lanes of c[0]'s key, two of c[1]'s, lanes i + (i + 2)
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44),
                                 _mm512_shuffle_ps(c[0], c[1], 0xEE));
  const __m512 e = _mm512_add_ps(d, _mm512_permute_ps(d, 0xB1));  // lanes i + (i + 1)
  // key 0..7 sit in lanes 0, 2, 8, 10, 4, 6, 12, 14
  const __m512i order = _mm512_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, e));
}

struct Avx512 {
  // s[0:8] = q . k[j] for eight keys: eight accumulators over the head, reduced together by
  // `hsum8`, which adds each key's lanes in `hsum`'s tree.
  template <typename T>
  static void dot8(const float* q, const T* const* k, int64_t d, float* s) {
    __m512 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = lanes(i, d);
      const __m512 qv = load16(q + i, m);
      for (int j = 0; j < 8; ++j) a[j] = _mm512_fmadd_ps(qv, load16(k[j] + i, m), a[j]);
    }
    _mm256_storeu_ps(s, hsum8(a));
  }

  // acc[0:d] = acc * alpha + sum_j p[j] * v[j]: 64 columns at a time in registers, then 16
  // (or the last 8) at a time.
  template <typename T>
  static void scale_accumulate(float* acc, float alpha, const float* p, const T* const* v,
                               int64_t n, int64_t d) {
    const __m512 va = _mm512_set1_ps(alpha);
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) {
      __m512 r[4];
      for (int u = 0; u < 4; ++u) r[u] = _mm512_mul_ps(va, _mm512_loadu_ps(acc + c + 16 * u));
      for (int64_t j = 0; j < n; ++j) {
        const __m512 pj = _mm512_set1_ps(p[j]);
        for (int u = 0; u < 4; ++u)
          r[u] = _mm512_fmadd_ps(pj, load16(v[j] + c + 16 * u, 0xFFFF), r[u]);
      }
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc + c + 16 * u, r[u]);
    }
    for (; c < d; c += 16) {
      const __mmask16 m = lanes(c, d);
      __m512 r = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, acc + c));
      for (int64_t j = 0; j < n; ++j)
        r = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), load16(v[j] + c, m), r);
      _mm512_mask_storeu_ps(acc + c, m, r);
    }
  }

  // scale_accumulate for R rows at once: each row's own operations in its own order, the value
  // loads shared and 4R independent FMA chains in flight (a lone row's 4 wait on the latency).
  template <typename T, int R>
  static void scale_accumulate_rows(float* const* acc, const float* alpha, const float* const* p,
                                    const T* const* v, int64_t n, int64_t d) {
    if (R == 1 || d % 64 != 0) {
      for (int r = 0; r < R; ++r) scale_accumulate(acc[r], alpha[r], p[r], v, n, d);
      return;
    }
    for (int64_t c = 0; c < d; c += 64) {
      __m512 a[R][4];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 va = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u)
          a[r][u] = _mm512_mul_ps(va, _mm512_loadu_ps(acc[r] + c + 16 * u));
      }
      for (int64_t j = 0; j < n; ++j) {
        __m512 vj[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) vj[u] = load16(v[j] + c + 16 * u, 0xFFFF);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512 pj = _mm512_set1_ps(p[r][j]);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) a[r][u] = _mm512_fmadd_ps(pj, vj[u], a[r][u]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc[r] + c + 16 * u, a[r][u]);
    }
  }

  template <typename T>
  static void prefetch_rows(const T* p, int64_t stride, int64_t rows, int64_t bytes) {
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t b = 0; b < bytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + j * stride) + b, _MM_HINT_T0);
  }

  // Scores s[0:n] (n a multiple of 8, padded with -inf) -> probabilities against the row's
  // running max; returns the block's sum, updates m, sets the earlier accumulation's rescale.
  static float softmax_block(float* s, int64_t n, float& m, float* alpha) {
    // The maximum is exact in any order: one vector reduction instead of a scalar chain.
    __m512 vmax = _mm512_set1_ps(m);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = lanes(j, n);
      vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, s + j));
    }
    const float bm = _mm512_reduce_max_ps(vmax);
    *alpha = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - bm);
    m = bm;
    const __m512 vm = _mm512_set1_ps(bm);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = lanes(j, n);
      const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(load16(s + j, k), vm)));
      _mm512_mask_storeu_ps(s + j, k, e);
      sum = _mm512_add_ps(sum, e);
    }
    return hsum(sum);
  }
};

}  // namespace

namespace deepserve_cpu {

void attention_items_avx512_f32(const attention::Batch<float>& b, const attention::Layout& L,
                                const attention::Work* items, int64_t i0, int64_t i1) {
  attention::attend_items<Avx512, float>(b, L, items, i0, i1);
}

void attention_items_avx512_bf16(const attention::Batch<uint16_t>& b,
                                 const attention::Layout& L, const attention::Work* items,
                                 int64_t i0, int64_t i1) {
  attention::attend_items<Avx512, uint16_t>(b, L, items, i0, i1);
}

}  // namespace deepserve_cpu

#pragma GCC pop_options
