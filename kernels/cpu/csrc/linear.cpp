// A float32 linear y[M, N] = x[M, K] @ W[N, K]^T for AVX2 + FMA, against a weight packed once at
// load time into panels of 16 output columns: packed[P, K, 16] (P = ceil(N / 16), the last panel
// zero-padded), float32 or bfloat16 (widened to float32 in registers, half the bytes to stream),
// or a GGUF quantization (Q4_0, Q4_1, Q8_0) regrouped into the same panels, 32 k-steps a block:
// packed[P, K / 32, B] bytes, each block the 16 columns' float32 scales (and Q4_1's minimums)
// then their 32 x 16 quants. Dequantizing is exact (scale * quant fits a float32; Q4_1's
// fma(quant, scale, min) rounds once, like the reference's (scale * quant) + min), so a quantized
// weight gives bitwise the result of its float32 dequantization packed as f32 panels; it streams
// 6-8x fewer bytes, which is the whole cost of a decode step's matmuls.
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
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"

namespace {

constexpr int64_t kPanel = 16;
// Rows per tile at most: 6 rows x 2 vectors = 12 accumulators, + 2 weight vectors + 1 broadcast
// fill the 16 ymm registers (the classic AVX2 6x16 shape).
constexpr int kMaxTileRows = 6;
// Rows kept hot in L2 while the thread's panels stream past them (prefill-sized inputs); below
// this every panel is read from memory exactly once.
constexpr int64_t kRowChunk = 96;
// A lone tile's prefetch distance (bytes): 1 KB ahead helped 2-6 row f32 tiles by 5-15%.
constexpr int64_t kAhead = 1024;
// Panels a multi-tile pass shares: 2 (72 KB at K = 576) stays in L2 with the next group in
// flight; 1 or 4 were as fast or up to 20% slower at 8-32 rows.
constexpr int64_t kGroup = 2;

// Where a tile's weights come from. `cursor(p, k0)` walks panel p from step k0 for at most
// `kChunk` steps: `load(kk, ...)` gives the 16 float32 weights of step k0 + kk as two vectors,
// `at(kk)` their address (for prefetches, issued every `kPrefetchEvery` steps: about one per
// cache line). `from(p)` is the same source starting at panel p. `kDirect` sources are float32
// panels a multi-row pass reads in place; the others are widened once per panel group (see
// `group_f32`). `kMaxPanels` caps the panels a tile walks side by side.

// float32 panels, or bfloat16 ones widened in registers.
template <class T>
struct PlainSource {
  static constexpr bool kDirect = std::is_same_v<T, float>;
  static constexpr int64_t kStepBytes = kPanel * sizeof(T);
  static constexpr int64_t kChunk = INT64_MAX;
  static constexpr int64_t kPrefetchEvery = 1;
  static constexpr int kMaxPanels = 4;
  struct Cursor {
    const T* w;
    const char* at(int64_t kk) const { return reinterpret_cast<const char*>(w + kk * kPanel); }
    void load(int64_t kk, __m256& w0, __m256& w1) const {
      if constexpr (kDirect) {
        w0 = _mm256_loadu_ps(w + kk * kPanel);
        w1 = _mm256_loadu_ps(w + kk * kPanel + 8);
      } else {
        __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kk * kPanel));
        // bf16 -> f32 is exact: the bf16 bits are the float's top half.
        w0 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
        w1 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
      }
    }
  };
  const T* w;
  int64_t K;
  Cursor cursor(int64_t p, int64_t k0) const { return {w + (p * K + k0) * kPanel}; }
  const char* at(int64_t p, int64_t k) const { return cursor(p, k).at(0); }
  PlainSource from(int64_t p) const { return {w + p * K * kPanel, K}; }
};
using F32Source = PlainSource<float>;
using BF16Source = PlainSource<uint16_t>;

// GGUF block quantizations, regrouped per panel: a block is 32 k-steps of 16 columns, headed by
// the columns' float32 scales (then Q4_1's float32 minimums), then the quants in k order. A
// 4-bit step is 8 bytes (byte j: column j in the low nibble, column j + 8 in the high one); an
// 8-bit step is 16 signed bytes.
enum QuantFormat : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };
constexpr int64_t kQuantBlock = 32;

template <QuantFormat F>
struct QuantSource {
  static constexpr bool kDirect = false;
  static constexpr int64_t kHeader = (F == kQ4_1 ? 2 : 1) * kPanel * sizeof(float);
  static constexpr int64_t kStepQuants = F == kQ8_0 ? kPanel : kPanel / 2;
  static constexpr int64_t kBlockBytes = kHeader + kQuantBlock * kStepQuants;
  static constexpr int64_t kStepBytes = kBlockBytes / kQuantBlock;
  static constexpr int64_t kChunk = kQuantBlock;
  static constexpr int64_t kPrefetchEvery = 64 / kStepQuants;
  // Dequantizing, not the FMA latency, bounds a tile here: one panel at a time was fastest.
  static constexpr int kMaxPanels = 1;
  struct Cursor {
    const float* scale;  // the block's 16 scales (Q4_1: then 16 minimums)
    const uint8_t* quants;
    const char* at(int64_t kk) const {
      return reinterpret_cast<const char*>(quants + kk * kStepQuants);
    }
    void load(int64_t kk, __m256& w0, __m256& w1) const {
      const auto* q = reinterpret_cast<const __m128i*>(quants + kk * kStepQuants);
      // A 4-bit step is 8 bytes: a 16-byte load could read past the tensor's end.
      const __m128i raw = F == kQ8_0 ? _mm_loadu_si128(q) : _mm_loadl_epi64(q);
      __m256 q0, q1;
      if constexpr (F == kQ8_0) {
        q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
        q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
      } else {
        const __m128i low = _mm_set1_epi8(0x0F);
        __m256i i0 = _mm256_cvtepu8_epi32(_mm_and_si128(raw, low));
        __m256i i1 = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
        if constexpr (F == kQ4_0) {
          i0 = _mm256_sub_epi32(i0, _mm256_set1_epi32(8));
          i1 = _mm256_sub_epi32(i1, _mm256_set1_epi32(8));
        }
        q0 = _mm256_cvtepi32_ps(i0);
        q1 = _mm256_cvtepi32_ps(i1);
      }
      if constexpr (F == kQ4_1) {
        const float* min = scale + kPanel;
        w0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(scale), _mm256_loadu_ps(min));
        w1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(scale + 8), _mm256_loadu_ps(min + 8));
      } else {
        w0 = _mm256_mul_ps(q0, _mm256_loadu_ps(scale));
        w1 = _mm256_mul_ps(q1, _mm256_loadu_ps(scale + 8));
      }
    }
  };
  const uint8_t* w;
  int64_t K;
  int64_t panel_bytes() const { return K / kQuantBlock * kBlockBytes; }
  // k0 is a multiple of 32 (tiles walk whole blocks).
  Cursor cursor(int64_t p, int64_t k0) const {
    const uint8_t* b = w + p * panel_bytes() + k0 / kQuantBlock * kBlockBytes;
    return {reinterpret_cast<const float*>(b), b + kHeader};
  }
  const char* at(int64_t p, int64_t k) const { return cursor(p, k).at(0); }
  QuantSource from(int64_t p) const { return {w + p * panel_bytes(), K}; }
};

__attribute__((noinline)) void store_partial(float* y, __m256 a0, __m256 a1, int64_t cols) {
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, a0);
  _mm256_store_ps(tmp + 8, a1);
  std::memcpy(y, tmp, cols * sizeof(float));
}

// Where a tile call prefetches. A lone tile streaming from memory reads `ahead` bytes past
// each panel's position; tiles that share a panel group instead walk `next` (the next group) one
// prefetch per k-step, so memory keeps streaming while the group's later tiles compute.
struct Prefetch {
  int64_t ahead = 0;  // bytes
  const char* next = nullptr;
  int64_t step = 0;  // bytes per k-step
};

// Prefetches never fault, so the loop issues them unconditionally: "none" is a prefetch of the
// line being loaded anyway, cheaper than a branch in the inner loop.
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// MR rows x NP consecutive panels of `w`. x rows are `ldx` apart; y rows `ldy`; `last_cols` is
// how many of the last panel's 16 columns exist (N's remainder).
template <int MR, int NP, class Src>
inline void tile(const float* x, int64_t ldx, Src w, int64_t K, float* y, int64_t ldy,
                 int64_t last_cols, Prefetch pf) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  const char* pf_next = pf.next ? pf.next : w.at(0, 0);
  const int64_t pf_step = pf.next ? pf.step : Src::kStepBytes;
  for (int64_t k0 = 0; k0 < K; k0 += Src::kChunk) {
    const int64_t kn = std::min(Src::kChunk, K - k0);
    typename Src::Cursor c[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) c[p] = w.cursor(p, k0);
    for (int64_t kk = 0; kk < kn; ++kk) {
      const int64_t k = k0 + kk;
      __m256 w0[NP], w1[NP];
      if (kk % Src::kPrefetchEvery == 0) {
        prefetch(pf_next + k * pf_step);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) prefetch(c[p].at(kk) + pf.ahead);
      }
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) c[p].load(kk, w0[p], w1[p]);
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

// Panels side by side for a tile of `rows` (at most the source's kMaxPanels): enough
// independent FMA chains (>= 8) to hide the FMA latency on both pipes, without spilling the 16
// registers.
inline int panels_per_tile(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

// `rows` (1..6) rows against `panels` consecutive panels.
template <class Src>
void run_rows(int rows, const float* x, int64_t ldx, Src w, int64_t K, float* y, int64_t ldy,
              int64_t panels, int64_t last_cols, Prefetch pf) {
  auto cols = [&](int64_t p, int64_t np) { return p + np == panels ? last_cols : kPanel; };
  int64_t p = 0;
#define DS_RUN(MR, NP)                                                                    \
  for (; p + NP <= panels; p += NP, pf.next = pf.next ? pf.next + K * pf.step : nullptr) \
    tile<MR, NP, Src>(x, ldx, w.from(p), K, y + p * kPanel, ldy, cols(p, NP), pf);
#define DS_GROUPED(MR, NP) DS_RUN(MR, std::min(NP, Src::kMaxPanels)) DS_RUN(MR, 1)
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

// A panel group as float32 panels for the tiles that share it: float32 panels in place, others
// widened once into `scratch`. Widening in registers costs the FMA ports a few instructions per
// 8 weights, which every tile would pay again (bf16 at 16 rows ran ~30% slower); once per
// group it is ~1/16 of that at 16 rows.
template <class Src>
const float* group_f32(Src w, int64_t g, int64_t K, float* scratch) {
  if constexpr (Src::kDirect) {
    return w.w;
  } else {
    for (int64_t p = 0; p < g; ++p) {
      for (int64_t k0 = 0; k0 < K; k0 += Src::kChunk) {
        const typename Src::Cursor c = w.cursor(p, k0);
        float* dst = scratch + (p * K + k0) * kPanel;
        for (int64_t kk = 0; kk < std::min(Src::kChunk, K - k0); ++kk) {
          __m256 w0, w1;
          c.load(kk, w0, w1);
          _mm256_storeu_ps(dst + kk * kPanel, w0);
          _mm256_storeu_ps(dst + kk * kPanel + 8, w1);
        }
      }
    }
    return scratch;
  }
}

// One thread's share: panels [p0, p1) for every row. Rows are cut into near-equal tiles of at
// most 6 (16 -> 6+5+5, not 6+6+4) so no tile runs short of independent chains.
template <class Src>
void run_panels(const float* x, int64_t M, int64_t K, Src w, float* y, int64_t N, int64_t p0,
                int64_t p1) {
  const int64_t panels_total = (N + kPanel - 1) / kPanel;
  const int64_t tail = N - (panels_total - 1) * kPanel;
  const int64_t stride = K * kPanel;  // float32 elements of a panel
  std::vector<float> scratch(!Src::kDirect && M > kMaxTileRows ? kGroup * stride : 0);
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, M - m0);
    const int64_t tiles = (mc + kMaxTileRows - 1) / kMaxTileRows;
    if (tiles == 1) {
      run_rows(static_cast<int>(mc), x + m0 * K, K, w.from(p0), K, y + m0 * N + p0 * kPanel, N,
               p1 - p0, p1 == panels_total ? tail : kPanel, Prefetch{kAhead, nullptr, 0});
      continue;
    }
    // A few panels at a time: the group leaves memory once and serves the other tiles from
    // L1/L2, while every tile call prefetches its share of the next group.
    for (int64_t p = p0; p < p1; p += kGroup) {
      const int64_t g = std::min(kGroup, p1 - p);
      const int64_t last_cols = p + g == panels_total ? tail : kPanel;
      const int64_t next = std::min(kGroup, p1 - p - g);
      const char* next_bytes = w.at(p + g, 0);
      const int64_t share = (next * K * Src::kStepBytes + tiles - 1) / tiles;
      const F32Source wf{group_f32(w.from(p), g, K, scratch.data()), K};
      int64_t r = m0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = static_cast<int>(mc / tiles + (t < mc % tiles ? 1 : 0));
        const int64_t calls = (g + panels_per_tile(rows) - 1) / panels_per_tile(rows);
        Prefetch pf;
        if (next > 0) pf = {0, next_bytes + t * share, (share + calls * K - 1) / (calls * K)};
        run_rows(rows, x + r * K, K, wf, K, y + r * N + p * kPanel, N, g, last_cols, pf);
        r += rows;
      }
    }
  }
}

struct Rows {
  at::Tensor x, y;
  int64_t M, K;
};

// Checks x and allocates y, float32 unless told (zeros when K is 0; `run` then has nothing to add).
Rows prepare(const at::Tensor& x, int64_t K, int64_t n, at::ScalarType dtype = at::kFloat,
             at::ScalarType out = at::kFloat) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "x must be a 2-D ", dtype, " tensor");
  TORCH_CHECK(x.size(1) == K, "x and the packed weight disagree on K");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({xc.size(0), n}, xc.options().dtype(out));
  if (K == 0) y.zero_();
  return {xc, y, xc.size(0), K};
}

// Calls `share(p0, p1)` for each thread's range of panels.
template <class F>
void split(const Rows& r, int64_t n, int64_t P, const F& share) {
  if (r.M == 0 || n == 0 || r.K == 0) return;
  // Keep a thread's share above ~64K multiply-adds: smaller splits cost more to fork than they save
  const int64_t grain = std::max<int64_t>(1, 65536 / (r.M * r.K * kPanel));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) { share(p0, p1); });
}

// Runs `w` over every panel, split across threads (the AVX2 path).
template <class Src>
void run(const Rows& r, Src w, int64_t n, int64_t P) {
  const float* xp = r.x.data_ptr<float>();
  float* yp = r.y.data_ptr<float>();
  split(r, n, P, [&](int64_t p0, int64_t p1) { run_panels(xp, r.M, r.K, w, yp, n, p0, p1); });
}

// The AVX-512 paths (kernels/cpu/csrc/linear_avx512.cpp) over the same split; `dot`: bfloat16 rows
// as they are against bfloat16 panels (AVX512-BF16).
at::Tensor linear_avx512(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool dot) {
  const int64_t K = packed.size(1), P = packed.size(0);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  if (dot) {
    Rows r = prepare(x, K, n, at::kBFloat16);
    const auto* xp = reinterpret_cast<const uint16_t*>(r.x.data_ptr());
    float* yp = r.y.data_ptr<float>();
    split(r, n, P, [&](int64_t p0, int64_t p1) {
      deepserve_cpu::linear_panels_avx512bf16_dot(xp, r.M, K, w, yp, n, p0, p1);
    });
    return r.y;
  }
  Rows r = prepare(x.to(at::kFloat), K, n);
  const float* xp = r.x.data_ptr<float>();
  float* yp = r.y.data_ptr<float>();
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const float* wf = bf16 ? nullptr : packed.data_ptr<float>();
  split(r, n, P, [&](int64_t p0, int64_t p1) {
    if (bf16) {
      deepserve_cpu::linear_panels_avx512_bf16(xp, r.M, K, w, yp, n, p0, p1);
    } else {
      deepserve_cpu::linear_panels_avx512_f32(xp, r.M, K, wf, yp, n, p0, p1);
    }
  });
  return r.y;
}

// x is float32 or bfloat16 rows: widened exactly to float32, except on the AVX512-BF16 path
// against bfloat16 panels, which multiplies them as they are (isa.h).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel, "packed must be [P, K, 16]");
  TORCH_CHECK(packed.size(0) == (n + kPanel - 1) / kPanel, "packed has the wrong panel count");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || packed.scalar_type() == at::kFloat, "packed must be float32 or bfloat16");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  const deepserve_cpu::Isa path = deepserve_cpu::isa();
  if (path != deepserve_cpu::Isa::kAvx2) {
    const bool dot =
        path == deepserve_cpu::Isa::kAvx512Bf16 && bf16 && x.scalar_type() == at::kBFloat16;
    return linear_avx512(x, packed, n, dot);
  }
  const int64_t K = packed.size(1), P = packed.size(0);
  Rows r = prepare(x.scalar_type() == at::kBFloat16 ? x.to(at::kFloat) : x, K, n);
  if (bf16) {
    run(r, BF16Source{reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), K}, n, P);
  } else {
    run(r, F32Source{packed.data_ptr<float>(), K}, n, P);
  }
  return r.y;
}

// `linear` rounded to bfloat16, with the bits of `linear(x, packed, n).to(bfloat16)`: the
// AVX512-BF16 pair-dot kernel rounds each output as it leaves its register (no float32 output
// to write, read back and cast); the FMA paths cast their float32 output.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const bool dot = deepserve_cpu::isa() == deepserve_cpu::Isa::kAvx512Bf16 &&
                   packed.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16;
  if (!dot) return linear(x, packed, n).to(at::kBFloat16);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel, "packed must be [P, K, 16]");
  TORCH_CHECK(packed.size(0) == (n + kPanel - 1) / kPanel, "packed has the wrong panel count");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  const int64_t K = packed.size(1), P = packed.size(0);
  const Rows r = prepare(x, K, n, at::kBFloat16, at::kBFloat16);
  const auto* xp = reinterpret_cast<const uint16_t*>(r.x.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(r.y.data_ptr());
  split(r, n, P, [&](int64_t p0, int64_t p1) {
    deepserve_cpu::linear_panels_avx512bf16_dot(xp, r.M, K, w, yp, n, p0, p1);
  });
  return r.y;
}

template <QuantFormat F>
void run_quant(const Rows& r, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed.size(2) == QuantSource<F>::kBlockBytes, "packed has the wrong block size");
  run(r, QuantSource<F>{packed.data_ptr<uint8_t>(), r.K}, n, packed.size(0));
}

// `packed` is [P, K / 32, block bytes] uint8 in `format` (a QuantFormat).
at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t format) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte, "packed must be 3-D uint8");
  TORCH_CHECK(packed.size(0) == (n + kPanel - 1) / kPanel, "packed has the wrong panel count");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  Rows r = prepare(x, packed.size(1) * kQuantBlock, n);
  switch (format) {
    case kQ4_0: run_quant<kQ4_0>(r, packed, n); break;
    case kQ4_1: run_quant<kQ4_1>(r, packed, n); break;
    case kQ8_0: run_quant<kQ8_0>(r, packed, n); break;
    default: TORCH_CHECK(false, "unknown quantized panel format ", format);
  }
  return r.y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) {
  m.def("linear(Tensor x, Tensor packed, int n) -> Tensor", &linear);
  m.def("linear_bf16(Tensor x, Tensor packed, int n) -> Tensor", &linear_bf16);
  m.def("linear_quant(Tensor x, Tensor packed, int n, int format) -> Tensor", &linear_quant);
}
