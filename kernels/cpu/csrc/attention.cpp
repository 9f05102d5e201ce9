// Paged attention over one flattened, variable-length batch, read straight from the block tables.
//
// The contract is kernels/reference/attention.py's paged_attention: sequence b owns query rows
// query_start_loc[b]..query_start_loc[b+1], at the last positions of its seq_lens[b] keys (causal
// within the new rows, full over the cached context). One work item is (sequence, kv head, a tile
// of that head's query rows): the rows of a GQA group share every K/V load, and each row keeps an
// online softmax in float32, so no [B, L] padded copy of the cache is ever made. A row's result
// depends only on its own sequence (fixed key order), never on what else is in the batch.
//
// The walk over key tiles and rows is attention_impl.h's; this file has the op, the AVX2 vector
// primitives, and the choice of path (AVX-512 in attention_avx512.cpp, kernels/cpu/csrc/isa.h).
// Scores are the same on both paths (one FMA chain per score over the head); a path's bits are
// still its own: AVX-512 sums a tile's probabilities over 16 lanes, AVX2 over 8. On AVX512-BF16,
// bfloat16 q against a bfloat16 cache is scored, and p @ V summed, by vdpbf16ps in bf16 pairs
// (bits of its own).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "attention_impl.h"
#include "isa.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using deepserve_cpu::exp8;
using namespace deepserve_cpu::attention;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  // bfloat16 is the high half of a float32: widening is a 16-bit shift, exact.
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// r[i] (lane j) <- r[j] (lane i): an 8 x 8 transpose.
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved by 32 bits
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 2; ++g) {  // u[4g + c]: rows 4g..4g+3 of columns c and c + 4
    u[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// panel[d][j] = k[j][d] (widened to float32) for a tile's n keys; columns past n are left as
// they are (their scores are masked).
template <typename T>
inline void pack_keys(const T* const* k, int64_t n, int64_t dk, float* panel) {
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - j0);
    for (int64_t d0 = 0; d0 < dk; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = i < m ? load8(k[j0 + i] + d0) : _mm256_setzero_ps();
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(panel + (d0 + i) * kKeys + j0, r[i]);
    }
  }
}

// s[r][0:n] = scale * (q[r] . k[j]), -inf for keys j >= vis[r]: R x V registers of scores, each
// lane one chain over the head in order. n (returned) covers vis[R - 1], rounded up to a pass:
// keys no row sees are neither scored nor exponentiated (their probabilities would be zeros).
template <int R>
inline int64_t scores(const float* const* q, const float* panel, int64_t dk, float scale,
                      const int64_t* vis, float* s) {
  constexpr int V = R <= 2 ? 4 : 2;  // R x V accumulators within AVX2's 16 registers
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t c0 = 0;
  for (; c0 < vis[R - 1]; c0 += 8 * V) {
    __m256 a[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) a[r][v] = _mm256_setzero_ps();
    const float* kd = panel + c0;
    for (int64_t d = 0; d < dk; ++d, kd += kKeys) {
      __m256 kv[V];
      for (int v = 0; v < V; ++v) kv[v] = _mm256_load_ps(kd + 8 * v);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_broadcast_ss(q[r] + d);
        for (int v = 0; v < V; ++v) a[r][v] = _mm256_fmadd_ps(qv, kv[v], a[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) {
        const int64_t k = std::clamp<int64_t>(vis[r] - c0 - 8 * v, 0, 8);
        const __m256i count = _mm256_set1_epi32(int(k));
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, lane));
        _mm256_store_ps(s + r * kKeys + c0 + 8 * v,
                        _mm256_blendv_ps(ninf, _mm256_mul_ps(a[r][v], vs), live));
      }
  }
  return c0;
}

// acc[0:d] = acc * alpha + sum_j p[j] * v[j]: 64 columns at a time in registers (a fixed
// count, so the compiler keeps them there), then 8 at a time for the rest.
template <typename T>
inline void scale_accumulate(float* acc, float alpha, const float* p, const T* const* v,
                             int64_t n, int64_t d) {
  const __m256 va = _mm256_set1_ps(alpha);
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) {
    __m256 r[8];
    for (int u = 0; u < 8; ++u) r[u] = _mm256_mul_ps(va, _mm256_loadu_ps(acc + c + 8 * u));
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int u = 0; u < 8; ++u) r[u] = _mm256_fmadd_ps(pj, load8(v[j] + c + 8 * u), r[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(acc + c + 8 * u, r[u]);
  }
  for (; c < d; c += 8) {
    __m256 r = _mm256_mul_ps(va, _mm256_loadu_ps(acc + c));
    for (int64_t j = 0; j < n; ++j) r = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v[j] + c), r);
    _mm256_storeu_ps(acc + c, r);
  }
}

// Scores s[0:n] -> probabilities against the row's running max; returns the block's sum and
// updates m, giving the factor the earlier accumulation must be rescaled by in *alpha.
inline float softmax_block(float* s, int64_t n, float& m, float* alpha) {
  float bm = m;
  for (int64_t j = 0; j < n; ++j) bm = std::max(bm, s[j]);
  *alpha = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - bm);
  m = bm;
  const __m256 vm = _mm256_set1_ps(bm);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {  // s is padded to a multiple of 8 with -inf
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
}

// The AVX2 primitives attention_impl.h walks with.
struct Avx2 {
  using Q = float;
  static constexpr int kRows = 4;
  static constexpr bool kPairValues = false;
  template <typename T>
  static void pack_keys(const T* const* k, int64_t n, int64_t dk, float* panel) {
    ::pack_keys(k, n, dk, panel);
  }
  template <int R>
  static int64_t scores(const float* const* q, const float* panel, int64_t dk, float scale,
                        const int64_t* vis, float* s) {
    return ::scores<R>(q, panel, dk, scale, vis, s);
  }
  template <typename T, int R>
  static void scale_accumulate_rows(float* const* acc, const float* alpha, const float* const* p,
                                    const T* const* v, int64_t n, int64_t d) {
    for (int r = 0; r < R; ++r) ::scale_accumulate(acc[r], alpha[r], p[r], v, n, d);
  }
  static float softmax_block(float* s, int64_t n, float& m, float* alpha) {
    return ::softmax_block(s, n, m, alpha);
  }
};

// A sequence's row tiles go first, last, second, second to last, ...: under causal masking a
// tile's cost grows with its position, and threads take contiguous ranges of items, so pairing
// cheap with dear tiles gives each thread an even share (in row order, a 3-kv-head prefill
// split in two left one thread 1.4x the other's work). Items are independent: the order
// changes no result.
std::vector<Work> plan(const int32_t* loc, int64_t seqs, int64_t hkv, int64_t group) {
  std::vector<Work> items;
  for (int64_t b = 0; b < seqs; ++b) {
    const int64_t rows = int64_t(loc[b + 1] - loc[b]) * group;
    const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t i = 0; i < tiles; ++i) {
        const int64_t t = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
        items.push_back({b, h, t * kTileRows, std::min(rows, (t + 1) * kTileRows)});
      }
  }
  return items;
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_tables,
                           double scale) {
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "K and V caches must share a dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache rows must be contiguous");
  TORCH_CHECK(k_cache.size(3) % 8 == 0 && v_cache.size(3) % 8 == 0, "head sizes must be x8");
  // bfloat16 q against a bfloat16 cache is scored in bf16 pairs where the CPU has AVX512-BF16;
  // every other case widens q to float32.
  const bool dot = deepserve_cpu::isa() == deepserve_cpu::Isa::kAvx512Bf16 &&
                   q_in.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16;
  at::Tensor q = q_in.dtype() == at::kFloat || dot ? q_in : q_in.to(at::kFloat);
  if (q.stride(2) != 1) q = q.contiguous();
  const at::Tensor loc = query_start_loc.to(at::kInt).contiguous();
  const at::Tensor lens = seq_lens.to(at::kInt).contiguous();
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const int64_t hq = q.size(1), hkv = k_cache.size(2), seqs = lens.size(0);
  TORCH_CHECK(hq % hkv == 0 && q.size(2) == k_cache.size(3), "q does not match the cache");
  const Layout L{hq / hkv,         k_cache.size(3),  v_cache.size(3),  k_cache.size(1),
                 q.stride(0),      q.stride(1),      k_cache.stride(0), k_cache.stride(1),
                 k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                 float(scale)};
  at::Tensor out = at::empty({q.size(0), hq, L.dv}, q.options().dtype(at::kFloat));
  const int32_t* lp = loc.data_ptr<int32_t>();
  const int32_t* sl = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t tstride = tables.size(1);
  const std::vector<Work> items = plan(lp, seqs, hkv, L.group);
  const bool avx512 = deepserve_cpu::isa() != deepserve_cpu::Isa::kAvx2;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const Batch<T> batch{q.data_ptr(), reinterpret_cast<const T*>(k_cache.data_ptr()),
                         reinterpret_cast<const T*>(v_cache.data_ptr()), lp, sl, tp, tstride,
                         out.data_ptr<float>(), out.stride(0), out.stride(1)};
    at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
      if (!avx512) {
        attend_items<Avx2, T>(batch, L, items.data(), i0, i1);
      } else if constexpr (std::is_same_v<T, float>) {
        deepserve_cpu::attention_items_avx512_f32(batch, L, items.data(), i0, i1);
      } else {
        const Batch<uint16_t> raw{batch.q, reinterpret_cast<const uint16_t*>(batch.k),
                                  reinterpret_cast<const uint16_t*>(batch.v), lp, sl, tp,
                                  tstride, batch.out, batch.os0, batch.os1};
        if (dot) {
          deepserve_cpu::attention_items_avx512bf16_dot(raw, L, items.data(), i0, i1);
        } else {
          deepserve_cpu::attention_items_avx512_bf16(raw, L, items.data(), i0, i1);
        }
      }
    });
  };
  if (k_cache.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16, "caches must be float32 or bfloat16");
    run(at::BFloat16{});
  }
  return q_in.dtype() == at::kFloat ? out : out.to(q_in.dtype());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_tables, float scale) -> Tensor",
      &paged_attention);
}
