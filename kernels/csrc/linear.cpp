// A float32 linear y[M, N] = x[M, K] @ W[N, K]^T for AVX2 + FMA, against a weight packed once at
// load time into panels of 16 output columns: packed[P, K, 16] (P = ceil(N / 16), the last panel
// zero-padded), float32 or bfloat16 (widened to float32 in registers, half the bytes to stream).
//
// Why panels: one k-step of a panel is one 64-byte cache line (32 bytes in bf16) that feeds 16
// outputs, so a one-row GEMV is a single sequential stream per thread (the weight read is the
// whole cost there) and a multi-row tile reuses each loaded line across up to 6 rows.
//
// Every output element is one FMA chain over k = 0..K-1 in order, starting from zero, whatever
// the tile shape, row count or thread split: a row's result is bitwise the same alone or inside
// any batch. Tiles differ only in how many chains run side by side.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;
// Rows per tile at most: 6 rows x 2 vectors = 12 accumulators, + 2 weight vectors + 1 broadcast
// fill the 16 ymm registers (the classic AVX2 6x16 shape).
constexpr int kMaxTileRows = 6;
// Rows kept hot in L2 while the thread's panels stream past them (prefill-sized inputs); below
// this every panel is read from memory exactly once.
constexpr int64_t kRowChunk = 96;
// A lone tile's prefetch distance (elements): 1 KB of f32 ahead helped 2-6 row tiles by 5-15%.
constexpr int64_t kAhead = 256;
// Panels a multi-tile pass shares: 2 (72 KB at K = 576) stays in L2 with the next group in
// flight; 1 or 4 were as fast or up to 20% slower at 8-32 rows.
constexpr int64_t kGroup = 2;

template <bool BF16>
struct Panel {
  using T = std::conditional_t<BF16, uint16_t, float>;
  // The 16 weights of step k, as two float32 vectors.
  static inline void load(const T* p, __m256& w0, __m256& w1) {
    if constexpr (BF16) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      // bf16 -> f32 is exact: the bf16 bits are the float's top half.
      w0 = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
      w1 = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
    } else {
      w0 = _mm256_loadu_ps(p);
      w1 = _mm256_loadu_ps(p + 8);
    }
  }
};

__attribute__((noinline)) void store_partial(float* y, __m256 a0, __m256 a1, int64_t cols) {
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, a0);
  _mm256_store_ps(tmp + 8, a1);
  std::memcpy(y, tmp, cols * sizeof(float));
}

// Where a tile call prefetches. A lone tile streaming from memory reads `ahead` elements past
// each panel's position; tiles that share a panel group instead walk `next` (the next group) one
// prefetch per k-step, so memory keeps streaming while the group's later tiles compute.
struct Prefetch {
  int64_t ahead = 0;  // elements
  const char* next = nullptr;
  int64_t step = 0;  // bytes per k-step
};

// Prefetches never fault, so the loop issues them unconditionally: "none" is a prefetch of the
// line being loaded anyway, cheaper than a branch in the inner loop.
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// MR rows x NP consecutive panels. x rows are `ldx` apart; y rows `ldy`; `last_cols` is how
// many of the last panel's 16 columns exist (N's remainder).
template <int MR, int NP, bool BF16>
inline void tile(const float* x, int64_t ldx, const typename Panel<BF16>::T* w, int64_t K,
                 float* y, int64_t ldy, int64_t last_cols, Prefetch pf) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  const int64_t panel_stride = K * kPanel;
  const char* pf_next = pf.next ? pf.next : reinterpret_cast<const char*>(w);
  const int64_t pf_step = pf.next ? pf.step : kPanel * sizeof(*w);
  for (int64_t k = 0; k < K; ++k) {
    prefetch(pf_next + k * pf_step);
    __m256 w0[NP], w1[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const auto* wk = w + p * panel_stride + k * kPanel;
      prefetch(wk + pf.ahead);
      Panel<BF16>::load(wk, w0[p], w1[p]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        acc[r][p][0] = _mm256_fmadd_ps(xb, w0[p], acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(xb, w1[p], acc[r][p][1]);
      }
    }
  }
  // Full panels store straight from registers; only N's last, partial panel goes through memory.
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      float* dst = y + r * ldy + p * kPanel;
      if (p < NP - 1 || last_cols == kPanel) {
        _mm256_storeu_ps(dst, acc[r][p][0]);
        _mm256_storeu_ps(dst + 8, acc[r][p][1]);
      } else {
        store_partial(dst, acc[r][p][0], acc[r][p][1], last_cols);
      }
    }
  }
}

// Panels side by side for a tile of `rows`: enough independent FMA chains (>= 8) to hide the
// FMA latency on both pipes, without spilling the 16 registers.
inline int panels_per_tile(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

// `rows` (1..6) rows against `panels` consecutive panels.
template <bool BF16>
void run_rows(int rows, const float* x, int64_t ldx, const typename Panel<BF16>::T* w, int64_t K,
              float* y, int64_t ldy, int64_t panels, int64_t last_cols, Prefetch pf) {
  const int64_t stride = K * kPanel;
  auto cols = [&](int64_t p, int64_t np) { return p + np == panels ? last_cols : kPanel; };
  int64_t p = 0;
#define DS_RUN(MR, NP)                                                                        \
  for (; p + NP <= panels; p += NP, pf.next = pf.next ? pf.next + K * pf.step : nullptr)     \
    tile<MR, NP, BF16>(x, ldx, w + p * stride, K, y + p * kPanel, ldy, cols(p, NP), pf);
#define DS_GROUPED(MR, NP) DS_RUN(MR, NP) DS_RUN(MR, 1)
  switch (rows) {
    case 1: DS_GROUPED(1, 4) break;
    case 2: DS_GROUPED(2, 2) break;
    case 3: DS_GROUPED(3, 2) break;
    case 4: DS_RUN(4, 1) break;
    case 5: DS_RUN(5, 1) break;
    default: DS_RUN(6, 1) break;
  }
#undef DS_GROUPED
#undef DS_RUN
}

// A bf16 panel group widened once to float32, for the tiles that share it: widening in
// registers costs a shuffle and a shift per 8 weights on the FMA ports, which every tile would
// pay again (16 rows ran ~30% slower); one widening per group is ~1/16 of that at 16 rows.
void widen(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += kPanel) {
    __m256 w0, w1;
    Panel<true>::load(src + i, w0, w1);
    _mm256_storeu_ps(dst + i, w0);
    _mm256_storeu_ps(dst + i + 8, w1);
  }
}

// One thread's share: panels [p0, p1) for every row. Rows are cut into near-equal tiles of at
// most 6 (16 -> 6+5+5, not 6+6+4) so no tile runs short of independent chains.
template <bool BF16>
void run_panels(const float* x, int64_t M, int64_t K, const typename Panel<BF16>::T* w,
                float* y, int64_t N, int64_t p0, int64_t p1) {
  const int64_t panels_total = (N + kPanel - 1) / kPanel;
  const int64_t tail = N - (panels_total - 1) * kPanel;
  const int64_t stride = K * kPanel;
  std::vector<float> wide(BF16 && M > kMaxTileRows ? kGroup * stride : 0);
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, M - m0);
    const int64_t tiles = (mc + kMaxTileRows - 1) / kMaxTileRows;
    if (tiles == 1) {
      run_rows<BF16>(static_cast<int>(mc), x + m0 * K, K, w + p0 * stride, K,
                     y + m0 * N + p0 * kPanel, N, p1 - p0, p1 == panels_total ? tail : kPanel,
                     Prefetch{kAhead, nullptr, 0});
      continue;
    }
    // A few panels at a time: the group leaves memory once and serves the other tiles from
    // L1/L2, while every tile call prefetches its share of the next group.
    for (int64_t p = p0; p < p1; p += kGroup) {
      const int64_t g = std::min(kGroup, p1 - p);
      const int64_t last_cols = p + g == panels_total ? tail : kPanel;
      const int64_t next = std::min(kGroup, p1 - p - g);
      const char* next_bytes = reinterpret_cast<const char*>(w + (p + g) * stride);
      const int64_t share = (next * stride * sizeof(*w) + tiles - 1) / tiles;
      const float* wf;
      if constexpr (BF16) {
        widen(w + p * stride, g * stride, wide.data());
        wf = wide.data();
      } else {
        wf = w + p * stride;
      }
      int64_t r = m0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = static_cast<int>(mc / tiles + (t < mc % tiles ? 1 : 0));
        const int64_t calls = (g + panels_per_tile(rows) - 1) / panels_per_tile(rows);
        Prefetch pf;
        if (next > 0) pf = {0, next_bytes + t * share, (share + calls * K - 1) / (calls * K)};
        run_rows<false>(rows, x + r * K, K, wf, K, y + r * N + p * kPanel, N, g, last_cols, pf);
        r += rows;
      }
    }
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel, "packed must be [P, K, 16]");
  TORCH_CHECK(packed.size(1) == x.size(1), "x and packed disagree on K");
  TORCH_CHECK(packed.size(0) == (n + kPanel - 1) / kPanel, "packed has the wrong panel count");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || packed.scalar_type() == at::kFloat, "packed must be float32 or bfloat16");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = packed.size(0);
  at::Tensor y = at::empty({M, n}, xc.options());
  if (M == 0 || n == 0) return y;
  if (K == 0) return y.zero_();
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Keep a thread's share above ~64K multiply-adds: smaller splits cost more to fork than they save
  const int64_t grain = std::max<int64_t>(1, 65536 / (M * K * kPanel));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    if (bf16) {
      const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
      run_panels<true>(xp, M, K, w, yp, n, p0, p1);
    } else {
      const float* w = packed.data_ptr<float>();
      run_panels<false>(xp, M, K, w, yp, n, p0, p1);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) {
  m.def("linear(Tensor x, Tensor packed, int n) -> Tensor", &linear);
}
