// Paged attention's AVX-512 path: attention_impl.h's walk over the primitives below, 16 floats a
// register. Compiled for AVX-512 by the target pragma (the build's flags stay AVX2), called only
// when cpuid reports it (kernels/cpu/csrc/isa.cpp).
//
// Scores (keys across lanes, one FMA chain over the head each), the output accumulation (p @ V,
// column by column) and exp are lane-wise, the AVX2 path's operations in wider registers; a
// tile's sum of probabilities reduces 16 lanes in a fixed tree. All are fixed by the row, the
// head size and the tile's keys alone, so a row's bits do not depend on the batch on this path
// either.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// After the pragma: its templates are instantiated here for AVX-512 (its standard headers, above,
// are not).
#include "attention_impl.h"
#include "vec_math_avx512.h"

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


// 16 lanes to one float in a fixed tree (halves, then quarters, ...).
inline float hsum(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// r[i] (lane j) <- r[j] (lane i): a 16 x 16 transpose in four rounds of shuffles.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved by 32 bits
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c]: rows 4g..4g+3 of columns c, c+4, c+8, c+12
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {  // 4 x 4 transpose of the 128-bit blocks of u[c], u[4 + c], ...
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
    const __m512 v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

// The first k of 16 lanes (none for k <= 0).
inline __mmask16 first(int64_t k) {
  return k >= 16 ? __mmask16(0xFFFF) : k <= 0 ? __mmask16(0) : __mmask16((1u << k) - 1);
}

struct Avx512 {
  using Q = float;
  static constexpr int kRows = 6;  // rows of a score block: 6 x 4 registers of keys
  static constexpr bool kPairValues = false;

  // panel[d][j] = k[j][d] (widened to float32) for the tile's n keys; columns past n are left
  // as they are (their scores are masked).
  template <typename T>
  static void pack_keys(const T* const* k, int64_t n, int64_t dk, float* panel) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - j0);
      for (int64_t d0 = 0; d0 < dk; d0 += 16) {
        const __mmask16 dm = lanes(d0, dk);
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = i < m ? load16(k[j0 + i] + d0, dm) : _mm512_setzero_ps();
        transpose16(r);
        const int rows = dk - d0 >= 16 ? 16 : 8;
        for (int i = 0; i < rows; ++i) _mm512_store_ps(panel + (d0 + i) * kKeys + j0, r[i]);
      }
    }
  }

  // Scores of keys [c0, c0 + 16 V) for R rows: R x V registers, each lane one chain over the
  // head in order; scaled, and -inf for keys j >= vis[r].
  template <int R, int V>
  static void score_block(const float* const* q, const float* panel, int64_t dk, float scale,
                          const int64_t* vis, float* s, int64_t c0) {
    __m512 a[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) a[r][v] = _mm512_setzero_ps();
    const float* kd = panel + c0;
    for (int64_t d = 0; d < dk; ++d, kd += kKeys) {
      __m512 kv[V];
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) kv[v] = _mm512_load_ps(kd + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 qv = _mm512_set1_ps(q[r][d]);
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) a[r][v] = _mm512_fmadd_ps(qv, kv[v], a[r][v]);
      }
    }
    store_scores<R, V>(a, scale, vis, s, c0);
  }

  // The score registers, scaled, with -inf for keys j >= vis[r].
  template <int R, int V>
  static void store_scores(const __m512 (&a)[R][V], float scale, const int64_t* vis, float* s,
                           int64_t c0) {
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const __mmask16 live = first(vis[r] - c0 - 16 * v);
        _mm512_store_ps(s + r * kKeys + c0 + 16 * v, _mm512_mask_mul_ps(ninf, live, a[r][v], vs));
      }
  }

  // s[r][0:n] = scale * (q[r] . k[j]), -inf for keys j >= vis[r], where n (returned) is
  // vis[R - 1] rounded up to 16: keys no row sees are neither scored nor exponentiated (their
  // probabilities would be exact zeros).
  template <int R>
  static int64_t scores(const float* const* q, const float* panel, int64_t dk, float scale,
                        const int64_t* vis, float* s) {
    return scores_by<Avx512, R>(q, panel, dk, scale, vis, s);
  }

  // `scores` over the score blocks of path P (its q rows of type P::Q).
  template <class P, int R>
  static int64_t scores_by(const typename P::Q* const* q, const float* panel, int64_t dk,
                           float scale, const int64_t* vis, float* s) {
    static_assert(kKeys % 64 == 0);
    const int64_t n = (vis[R - 1] + 15) & ~int64_t{15};
    int64_t c0 = 0;
    for (; c0 + 64 <= n; c0 += 64) P::template score_block<R, 4>(q, panel, dk, scale, vis, s, c0);
    switch ((n - c0) / 16) {
      case 3: P::template score_block<R, 3>(q, panel, dk, scale, vis, s, c0); break;
      case 2: P::template score_block<R, 2>(q, panel, dk, scale, vis, s, c0); break;
      case 1: P::template score_block<R, 1>(q, panel, dk, scale, vis, s, c0); break;
    }
    return n;
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
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 va = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 8
        for (int u = 0; u < 4; ++u)
          a[r][u] = _mm512_mul_ps(va, _mm512_loadu_ps(acc[r] + c + 16 * u));
      }
      for (int64_t j = 0; j < n; ++j) {
        __m512 vj[4];
#pragma GCC unroll 8
        for (int u = 0; u < 4; ++u) vj[u] = load16(v[j] + c + 16 * u, 0xFFFF);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 pj = _mm512_set1_ps(p[r][j]);
#pragma GCC unroll 8
          for (int u = 0; u < 4; ++u) a[r][u] = _mm512_fmadd_ps(pj, vj[u], a[r][u]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc[r] + c + 16 * u, a[r][u]);
    }
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

#pragma GCC pop_options

// ---- AVX512-BF16: bfloat16 q rows against a bfloat16 cache, scores by vdpbf16ps ----
//
// In a bfloat16 model q is bfloat16 already (the RoPE op writes it so), so the pair products
// are exact and only the sums round: each score is ONE chain of vdpbf16ps over the head's pairs
// in order (per pair: odd d, then even d, added into the accumulator), fixed by the row and the
// key alone as on the other paths, with bits of this path's own. The tile's keys are packed as
// 32-bit pairs, a transposition with no widening, into half the panel. Softmax is the AVX-512
// path's, in float32.
//
// p @ V runs in pairs of keys too: each probability is rounded to bfloat16 (as torch's CPU flash
// attention and GPU flash attention round p for a bf16 model; the row's sum stays the float32
// probabilities'), the tile's values are packed once per work item as 32-bit (key 2i, key 2i + 1)
// pairs per column, and each output column is ONE chain of vdpbf16ps over the row's pairs in
// order: half the float32 FMAs. A pair's second key that the row does not see has p = 0 exactly
// and a finite value (a key of the sequence, or the panel's zero past the tile), so it adds 0
// whichever rows, chunk or step the row is computed with.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

// The bf16 pair at p (two consecutive elements) in every 32-bit lane.
inline __m512bh broadcast_pair(const uint16_t* p) {
  uint32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

struct Avx512Bf16 : Avx512 {
  using Q = uint16_t;
  static constexpr bool kPairValues = true;

  // vpanel[i][c] = (v[2i][c], v[2i + 1][c]) as one 32-bit word, for the tile's n keys (a
  // missing second key is 0).
  static void pack_values(const uint16_t* const* v, int64_t n, int64_t dv, uint32_t* vpanel) {
    alignas(64) static constexpr uint16_t kInterleave[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i idx = _mm512_load_si512(kInterleave);
    for (int64_t i = 0; 2 * i < n; ++i) {
      const uint16_t* a = v[2 * i];
      const uint16_t* b = 2 * i + 1 < n ? v[2 * i + 1] : nullptr;
      for (int64_t c = 0; c < dv; c += 16) {
        const __mmask16 m = lanes(c, dv);
        const __m512i lo = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(m, a + c));
        const __m512i hi = b ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(m, b + c))
                             : _mm512_setzero_si512();
        _mm512_mask_storeu_epi32(vpanel + i * dv + c, m, _mm512_permutex2var_epi16(lo, idx, hi));
      }
    }
  }

  // acc[r] = acc[r] * alpha[r] + p[r] @ V over the row's ceil(vis[r] / 2) pairs: the pairs every
  // row has together, then each row's own last pairs (acc * 1 is exact, so each row's chain over
  // its pairs stays one).
  template <int R>
  static void accumulate_pairs(float* const* acc, const float* alpha, const float* const* p,
                               const uint32_t* vpanel, const int64_t* vis, int64_t dv) {
    alignas(64) uint16_t pb[R][kKeys];
    const uint16_t* rows[R];
    int64_t pairs[R];
    for (int r = 0; r < R; ++r) {
      pairs[r] = (vis[r] + 1) / 2;
      for (int64_t j = 0; j < 2 * pairs[r]; j += 16) {
        const __mmask16 m = first(2 * pairs[r] - j);
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p[r] + j));
        _mm256_mask_storeu_epi16(pb[r] + j, m, (__m256i)b);
      }
      rows[r] = pb[r];
    }
    pair_range<R>(acc, alpha, rows, vpanel, 0, pairs[0], dv);
    const float one = 1.0f;
    for (int r = 1; r < R; ++r)
      if (pairs[r] > pairs[0]) pair_range<1>(&acc[r], &one, &rows[r], vpanel, pairs[0], pairs[r], dv);
  }

  // Pairs [i0, i1) into R rows' outputs: 64 columns at a time in registers, then 16 (or 8).
  template <int R>
  static void pair_range(float* const* acc, const float* alpha, const uint16_t* const* pb,
                         const uint32_t* vpanel, int64_t i0, int64_t i1, int64_t dv) {
    int64_t c = 0;
    for (; c + 64 <= dv; c += 64) pair_columns<R, 4>(acc, alpha, pb, vpanel, i0, i1, dv, c, 0xFFFF);
    for (; c < dv; c += 16) pair_columns<R, 1>(acc, alpha, pb, vpanel, i0, i1, dv, c, lanes(c, dv));
  }

  // Columns [c, c + 16 U) (the last register's lanes `last`) of R rows over pairs [i0, i1).
  template <int R, int U>
  static void pair_columns(float* const* acc, const float* alpha, const uint16_t* const* pb,
                           const uint32_t* vpanel, int64_t i0, int64_t i1, int64_t dv,
                           int64_t c, __mmask16 last) {
    __m512 a[R][U];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 va = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const __mmask16 m = u == U - 1 ? last : __mmask16(0xFFFF);
        a[r][u] = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, acc[r] + c + 16 * u));
      }
    }
    for (int64_t i = i0; i < i1; ++i) {
      const uint32_t* row = vpanel + i * dv + c;
      __m512bh vj[U];
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const __mmask16 m = u == U - 1 ? last : __mmask16(0xFFFF);
        vj[u] = (__m512bh)_mm512_maskz_loadu_epi32(m, row + 16 * u);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh pv = broadcast_pair(pb[r] + 2 * i);
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) a[r][u] = _mm512_dpbf16_ps(a[r][u], pv, vj[u]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const __mmask16 m = u == U - 1 ? last : __mmask16(0xFFFF);
        _mm512_mask_storeu_ps(acc[r] + c + 16 * u, m, a[r][u]);
      }
  }

  // panel[p][j] = (k[j][2p], k[j][2p + 1]) as one 32-bit word, for the tile's n keys.
  static void pack_keys(const uint16_t* const* k, int64_t n, int64_t dk, float* panel) {
    const int64_t pairs = dk / 2;
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - j0);
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        const __mmask16 pm = first(pairs - p0);
        __m512 r[16];  // bit patterns only: the shuffles of the transposition move, not round
        for (int i = 0; i < 16; ++i)
          r[i] = i < m ? _mm512_maskz_loadu_ps(pm, k[j0 + i] + 2 * p0) : _mm512_setzero_ps();
        transpose16(r);
        const int64_t rows = std::min<int64_t>(16, pairs - p0);
        for (int64_t i = 0; i < rows; ++i) _mm512_store_ps(panel + (p0 + i) * kKeys + j0, r[i]);
      }
    }
  }

  template <int R, int V>
  static void score_block(const uint16_t* const* q, const float* panel, int64_t dk, float scale,
                          const int64_t* vis, float* s, int64_t c0) {
    __m512 a[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) a[r][v] = _mm512_setzero_ps();
    const float* kd = panel + c0;
    for (int64_t p = 0; p < dk / 2; ++p, kd += kKeys) {
      __m512bh kv[V];
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) kv[v] = (__m512bh)_mm512_load_si512(kd + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = broadcast_pair(q[r] + 2 * p);
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], qv, kv[v]);
      }
    }
    store_scores<R, V>(a, scale, vis, s, c0);
  }

  template <int R>
  static int64_t scores(const uint16_t* const* q, const float* panel, int64_t dk, float scale,
                        const int64_t* vis, float* s) {
    return scores_by<Avx512Bf16, R>(q, panel, dk, scale, vis, s);
  }
};

}  // namespace

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

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

// (the walk is AVX-512 code, as its declaration under this file's pragma says; it calls the
// AVX512-BF16 score blocks and packing above, which are not inlined into it)
void attention_items_avx512bf16_dot(const attention::Batch<uint16_t>& b, const attention::Layout& L,
                               const attention::Work* items, int64_t i0, int64_t i1) {
  attention::attend_items<Avx512Bf16, uint16_t>(b, L, items, i0, i1);
}

}  // namespace deepserve_cpu

#pragma GCC pop_options
