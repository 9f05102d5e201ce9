// Paged attention over one flattened, variable-length batch, read straight from the block tables.
//
// The contract is kernels/attention_ref.py's paged_attention: sequence b owns query rows
// query_start_loc[b]..query_start_loc[b+1], at the last positions of its seq_lens[b] keys (causal
// within the new rows, full over the cached context). One work item is (sequence, kv head, a tile
// of that head's query rows): the rows of a GQA group share every K/V load, and each row keeps an
// online softmax in float32, so no [B, L] padded copy of the cache is ever made. A row's result
// depends only on its own sequence (fixed key order), never on what else is in the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

using deepserve_cpu::exp8;

constexpr int64_t kTileRows = 32;  // query rows per work item: acc stays in L1 for Dv <= 64
constexpr int64_t kMaxBlock = 64;  // largest KV block size the score buffer holds

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

// s[0:8] = q . k[j] for eight keys at once: eight independent accumulators, then one transpose
// reduction instead of eight horizontal sums.
template <typename T>
inline void dot8(const float* q, const T* const* k, int64_t d, float* s) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = load8(q + i);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(k[j] + i), a[j]);
  }
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  // lanes: [k0 k1 k2 k3 | k0 k1 k2 k3] halves of sums, likewise for k4..k7
  const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
  _mm256_storeu_ps(s, _mm256_add_ps(lo, hi));
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

template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t rows, int64_t bytes) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + j * stride) + b, _MM_HINT_T0);
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

// One work item: query rows row0..row1 (token-major, `group` rows a token) of one kv head of
// one sequence.
struct Work {
  int64_t seq, head, row0, row1;
};

struct Layout {
  int64_t group, dk, dv, block_size;
  int64_t qs0, qs1;               // q strides (token, head); float32, last dim contiguous
  int64_t kb, kt, kh, vb, vt, vh;  // cache strides (block, token, head)
  float scale;
};

// A row's running softmax state: max, sum, and the unnormalized output (dv floats).
struct RowState {
  float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
  float* acc;
};

// Fold `visible` keys kp/vp (pointer arrays padded to a multiple of 8) into one row's state.
template <typename T>
inline void attend_block(const float* qr, const T* const* kp, const T* const* vp,
                         int64_t visible, const Layout& L, RowState& st) {
  alignas(32) float s[kMaxBlock + 8];
  const int64_t padded = (visible + 7) & ~int64_t{7};
  for (int64_t j = 0; j < padded; j += 8) dot8(qr, kp + j, L.dk, s + j);
  for (int64_t j = 0; j < visible; ++j) s[j] *= L.scale;
  for (int64_t j = visible; j < padded; ++j) s[j] = -std::numeric_limits<float>::infinity();
  float alpha;
  const float sum = softmax_block(s, padded, st.m, &alpha);
  st.l = st.l * alpha + sum;
  scale_accumulate(st.acc, alpha, s, vp, visible, L.dv);
}

template <typename T>
inline void prefetch_block(const T* kc, const T* vc, int64_t blk, int64_t n, int64_t h,
                           const Layout& L) {
  prefetch_rows(kc + blk * L.kb + h * L.kh, L.kt, n, L.dk * int64_t(sizeof(T)));
  prefetch_rows(vc + blk * L.vb + h * L.vh, L.vt, n, L.dv * int64_t(sizeof(T)));
}

// The item's rows over its sequence's keys, block by block, prefetching the next block while
// this one computes.
template <typename T>
void attend_item(const Work& w, const Layout& L, const float* q, const T* kc, const T* vc,
                 const int32_t* table, int64_t q0, int64_t ctx, std::vector<RowState>& rows,
                 std::vector<float>& acc) {
  const int64_t nrows = w.row1 - w.row0, G = L.group, bs = L.block_size, h = w.head;
  acc.assign(nrows * L.dv, 0.0f);
  rows.assign(nrows, RowState{});
  for (int64_t r = 0; r < nrows; ++r) rows[r].acc = acc.data() + r * L.dv;
  const int64_t keys = ctx + (w.row1 - 1) / G + 1;  // the item's last row sees the most keys
  const T* kp[kMaxBlock + 8];
  const T* vp[kMaxBlock + 8];
  prefetch_block(kc, vc, table[0], std::min(bs, keys), h, L);
  for (int64_t start = 0; start < keys; start += bs) {
    const int64_t blk = table[start / bs], n = std::min(bs, keys - start);
    if (start + bs < keys)
      prefetch_block(kc, vc, table[start / bs + 1], std::min(bs, keys - start - bs), h, L);
    for (int64_t j = 0; j < n; ++j) {
      kp[j] = kc + blk * L.kb + j * L.kt + h * L.kh;
      vp[j] = vc + blk * L.vb + j * L.vt + h * L.vh;
    }
    for (int64_t j = n; j < ((n + 7) & ~int64_t{7}); ++j) kp[j] = kp[0];  // scored, then masked
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t row = w.row0 + r, t = row / G;
      const int64_t visible = std::min(n, ctx + t + 1 - start);
      if (visible <= 0) continue;
      const float* qr = q + (q0 + t) * L.qs0 + (h * G + row % G) * L.qs1;
      attend_block(qr, kp, vp, visible, L, rows[r]);
    }
  }
}

void store_item(const Work& w, const Layout& L, const std::vector<RowState>& rows, int64_t q0,
                float* out, int64_t os0, int64_t os1) {
  for (int64_t r = 0; r < w.row1 - w.row0; ++r) {
    const int64_t row = w.row0 + r;
    float* o = out + (q0 + row / L.group) * os0 + (w.head * L.group + row % L.group) * os1;
    const float inv = 1.0f / rows[r].l;
    for (int64_t d = 0; d < L.dv; ++d) o[d] = rows[r].acc[d] * inv;
  }
}

std::vector<Work> plan(const int32_t* loc, int64_t seqs, int64_t hkv, int64_t group) {
  std::vector<Work> items;
  for (int64_t b = 0; b < seqs; ++b) {
    const int64_t rows = int64_t(loc[b + 1] - loc[b]) * group;
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t r = 0; r < rows; r += kTileRows)
        items.push_back({b, h, r, std::min(rows, r + kTileRows)});
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
  TORCH_CHECK(k_cache.size(1) <= kMaxBlock, "block size too large");
  at::Tensor q = q_in.dtype() == at::kFloat ? q_in : q_in.to(at::kFloat);
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
  at::Tensor out = at::empty({q.size(0), hq, L.dv}, q.options());
  const int32_t* lp = loc.data_ptr<int32_t>();
  const int32_t* sl = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t tstride = tables.size(1);
  const std::vector<Work> items = plan(lp, seqs, hkv, L.group);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* kc = reinterpret_cast<const T*>(k_cache.data_ptr());
    const T* vc = reinterpret_cast<const T*>(v_cache.data_ptr());
    at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> acc;
      std::vector<RowState> rows;
      for (int64_t i = i0; i < i1; ++i) {
        const Work& w = items[i];
        const int64_t q0 = lp[w.seq], ctx = sl[w.seq] - (lp[w.seq + 1] - lp[w.seq]);
        attend_item<T>(w, L, q.data_ptr<float>(), kc, vc, tp + w.seq * tstride, q0, ctx, rows, acc);
        store_item(w, L, rows, q0, out.data_ptr<float>(), out.stride(0), out.stride(1));
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
