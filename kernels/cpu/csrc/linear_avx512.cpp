// The linear's AVX-512 paths (kernels/cpu/csrc/linear.cpp has the layout and the AVX2 path): one
// 16-float zmm register is a whole panel step, and 32 registers hold tiles of up to 12 rows x 2
// panels. Compiled for AVX-512 by the target pragma below (the build's flags stay AVX2 for every
// other file) and only called when cpuid reports the features (kernels/cpu/csrc/isa.cpp).
//
// Float32 and widened-bfloat16 panels: every output is one FMA chain over k in order from zero,
// lane by lane as on AVX2, so this path gives the AVX2 path's bits exactly. AVX512-BF16
// (`linear_panels_avx512bf16_dot`) takes bfloat16 rows and multiplies a pair of k-steps per
// instruction (vdpbf16ps: odd k, then even k, added into the accumulator one after the other,
// denormals flushed): a fixed order per output too, so its rows are batch invariant, with bits of
// its own.
//
// Everything here has internal linkage, and the standard headers come before the pragma: no
// function compiled for AVX-512 can be picked by the linker for a caller on an AVX2 CPU.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

namespace {

constexpr int64_t kPanel = 16;
constexpr int kMaxTileRows = 12;  // 12 rows x 2 panels = 24 accumulators of the 32 registers
constexpr int64_t kRowChunk = 192;  // rows kept hot while a thread's panels stream past
constexpr int64_t kGroup = 2;      // panels widened / interleaved once and shared by all tiles
constexpr int64_t kAhead = 1024;   // a lone tile's prefetch distance, bytes

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

inline void store_panel(float* dst, __m512 v, int64_t cols) {
  if (cols == kPanel) {
    _mm512_storeu_ps(dst, v);
  } else {
    _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << cols) - 1), v);
  }
}

// Panel sources: `load(p, k)` is step k of panel p as 16 float32 weights.
struct F32Panels {
  const float* w;
  int64_t K;
  static constexpr int64_t kStepBytes = kPanel * sizeof(float);
  const char* at(int64_t p, int64_t k) const {
    return reinterpret_cast<const char*>(w + (p * K + k) * kPanel);
  }
  __m512 load(int64_t p, int64_t k) const { return _mm512_loadu_ps(w + (p * K + k) * kPanel); }
  F32Panels from(int64_t p) const { return {w + p * K * kPanel, K}; }
};

struct BF16Panels {
  const uint16_t* w;
  int64_t K;
  static constexpr int64_t kStepBytes = kPanel * sizeof(uint16_t);
  const char* at(int64_t p, int64_t k) const {
    return reinterpret_cast<const char*>(w + (p * K + k) * kPanel);
  }
  __m512 load(int64_t p, int64_t k) const {
    // bf16 -> f32 is exact: the bf16 bits are the float's top half.
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (p * K + k) * kPanel));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  BF16Panels from(int64_t p) const { return {w + p * K * kPanel, K}; }
};

// MR rows x NP consecutive panels; `last_cols` of the last panel exist.
template <int MR, int NP, class Src>
inline void tile(const float* x, int64_t ldx, Src w, int64_t K, float* y, int64_t ldy,
                 int64_t last_cols, int64_t ahead) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      prefetch(w.at(p, k) + ahead);
      wv[p] = w.load(p, k);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xb, wv[p], acc[r][p]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      store_panel(y + r * ldy + p * kPanel, acc[r][p], p < NP - 1 ? kPanel : last_cols);
}

// `rows` (1..12) rows against `panels` consecutive panels: NP panels a tile (enough independent
// chains to hide the FMA latency), then one at a time for the rest.
template <class Src>
void run_rows(int rows, const float* x, int64_t ldx, Src w, int64_t K, float* y, int64_t ldy,
              int64_t panels, int64_t last_cols, int64_t ahead) {
  auto cols = [&](int64_t p, int64_t np) { return p + np == panels ? last_cols : kPanel; };
  int64_t p = 0;
#define DS_RUN(MR, NP)            \
  for (; p + NP <= panels; p += NP) \
    tile<MR, NP, Src>(x, ldx, w.from(p), K, y + p * kPanel, ldy, cols(p, NP), ahead);
#define DS_ROWS(MR, NP) \
  case MR: DS_RUN(MR, NP) DS_RUN(MR, 1) break;
  switch (rows) {
    DS_ROWS(1, 4) DS_ROWS(2, 4) DS_ROWS(3, 2) DS_ROWS(4, 2) DS_ROWS(5, 2) DS_ROWS(6, 2)
    DS_ROWS(7, 2) DS_ROWS(8, 2) DS_ROWS(9, 2) DS_ROWS(10, 2) DS_ROWS(11, 2)
    default: DS_RUN(12, 2) DS_RUN(12, 1) break;
  }
#undef DS_ROWS
#undef DS_RUN
}

// A panel group as float32 panels: in place for float32, widened once into `scratch` otherwise,
// so the tiles that share it do not widen it again.
inline F32Panels group_f32(F32Panels w, int64_t, int64_t, float*) { return w; }

inline F32Panels group_f32(BF16Panels w, int64_t g, int64_t K, float* scratch) {
  for (int64_t p = 0; p < g; ++p)
    for (int64_t k = 0; k < K; ++k) _mm512_storeu_ps(scratch + (p * K + k) * kPanel, w.load(p, k));
  return {scratch, K};
}

// One thread's share, as linear.cpp's AVX2 run_panels: row chunks, near-equal tiles of at most
// 12 rows, panel groups shared by the tiles of a chunk.
template <class Src>
void run_panels(const float* x, int64_t M, int64_t K, Src w, float* y, int64_t N, int64_t p0,
                int64_t p1) {
  const int64_t panels_total = (N + kPanel - 1) / kPanel;
  const int64_t tail = N - (panels_total - 1) * kPanel;
  std::vector<float> scratch(M > kMaxTileRows ? kGroup * K * kPanel : 0);
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, M - m0);
    const int64_t tiles = (mc + kMaxTileRows - 1) / kMaxTileRows;
    if (tiles == 1) {
      run_rows(static_cast<int>(mc), x + m0 * K, K, w.from(p0), K, y + m0 * N + p0 * kPanel, N,
               p1 - p0, p1 == panels_total ? tail : kPanel, kAhead);
      continue;
    }
    for (int64_t p = p0; p < p1; p += kGroup) {
      const int64_t g = std::min(kGroup, p1 - p);
      const int64_t last_cols = p + g == panels_total ? tail : kPanel;
      const F32Panels wf = group_f32(w.from(p), g, K, scratch.data());
      int64_t r = m0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = static_cast<int>(mc / tiles + (t < mc % tiles ? 1 : 0));
        run_rows(rows, x + r * K, K, wf, K, y + r * N + p * kPanel, N, g, last_cols, 0);
        r += rows;
      }
    }
  }
}

}  // namespace

#pragma GCC pop_options

// ---- AVX512-BF16: bfloat16 rows, a pair of k-steps per vdpbf16ps ----

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

// A pair of panel steps (k, k + 1: 32 contiguous bf16) interleaved as vdpbf16ps wants them,
// column c's two weights side by side: element 2c + e of the result is element 16e + c.
inline __m512i pair_index() {
  alignas(64) uint16_t idx[32];
  for (int c = 0; c < 16; ++c) {
    idx[2 * c] = static_cast<uint16_t>(c);
    idx[2 * c + 1] = static_cast<uint16_t>(16 + c);
  }
  return _mm512_load_si512(idx);
}

// Panels as vdpbf16ps operands: pair j of panel p holds steps 2j and 2j + 1 (an odd K's last
// pair is its last step and a zero).
struct PairedPanels {
  const uint16_t* w;  // [P, ceil(K / 2), 32] interleaved
  int64_t K;
  int64_t pairs() const { return (K + 1) / 2; }
  __m512i load(int64_t p, int64_t j) const {
    return _mm512_loadu_si512(w + (p * pairs() + j) * 2 * kPanel);
  }
  PairedPanels from(int64_t p) const { return {w + p * pairs() * 2 * kPanel, K}; }
};

// Pair j of bf16 panel p straight from the packed weight, interleaved in registers.
struct RawPairs {
  const uint16_t* w;  // [P, K, 16]
  int64_t K;
  __m512i index;
  __m512i load(int64_t p, int64_t j) const {
    const uint16_t* at = w + (p * K + 2 * j) * kPanel;
    if (2 * j + 1 < K) {
      return _mm512_permutexvar_epi16(index, _mm512_loadu_si512(at));
    }
    // odd K: the last step alone, each weight widened to a (weight, 0) pair
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  }
  RawPairs from(int64_t p) const { return {w + p * K * kPanel, K, index}; }
};

// x's steps 2j, 2j + 1 as one 32-bit pair, broadcast: one load (the pair is contiguous in a
// bfloat16 row), which the compiler folds into vdpbf16ps's {1to16} operand. An odd K's last
// step comes from `x_last` instead.
inline __m512i x_pair(const uint16_t* x, int64_t j) {
  uint32_t pair;
  std::memcpy(&pair, x + 2 * j, sizeof(pair));
  return _mm512_set1_epi32(static_cast<int>(pair));
}

// The last step of an odd K and a zero.
inline __m512i x_last(const uint16_t* x, int64_t K) {
  return _mm512_set1_epi32(static_cast<int>(uint32_t{x[K - 1]}));
}

template <int MR, int NP, class Src>
inline void dot_step(const uint16_t* x, int64_t ldx, const Src& w, int64_t j, __m512 (&acc)[MR][NP],
                     bool last, int64_t K) {
  __m512i wv[NP];
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) wv[p] = w.load(p, j);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    const __m512i xb = last ? x_last(x + r * ldx, K) : x_pair(x + r * ldx, j);
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)xb, (__m512bh)wv[p]);
  }
}

// Pairs in order, each a vdpbf16ps per output (odd k, then even k, added into the accumulator):
// the same order for every tile shape, so a row's bits never depend on its tile.
// The output stored as bfloat16: rounded to nearest even as torch's cast rounds (NaN: 0x7FC0),
// so a row's bits are those of the float32 output cast afterwards.
inline void store_panel(uint16_t* dst, __m512 v, int64_t cols) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  const __m256i packed = _mm512_cvtepi32_epi16(r);
  if (cols == kPanel) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
  } else {
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << cols) - 1), packed);
  }
}

template <int MR, int NP, class Src, class Out>
inline void dot_tile(const uint16_t* x, int64_t ldx, Src w, int64_t K, Out* y, int64_t ldy,
                     int64_t last_cols) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t full = K / 2;
  for (int64_t j = 0; j < full; ++j) dot_step<MR, NP>(x, ldx, w, j, acc, false, K);
  if (K % 2) dot_step<MR, NP>(x, ldx, w, full, acc, true, K);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      store_panel(y + r * ldy + p * kPanel, acc[r][p], p < NP - 1 ? kPanel : last_cols);
}

template <class Src, class Out>
void dot_rows(int rows, const uint16_t* x, int64_t ldx, Src w, int64_t K, Out* y, int64_t ldy,
              int64_t panels, int64_t last_cols) {
  auto cols = [&](int64_t p, int64_t np) { return p + np == panels ? last_cols : kPanel; };
  int64_t p = 0;
#define DS_RUN(MR, NP)            \
  for (; p + NP <= panels; p += NP) \
    dot_tile<MR, NP, Src, Out>(x, ldx, w.from(p), K, y + p * kPanel, ldy, cols(p, NP));
#define DS_ROWS(MR, NP) \
  case MR: DS_RUN(MR, NP) DS_RUN(MR, 1) break;
  switch (rows) {
    DS_ROWS(1, 8) DS_ROWS(2, 6) DS_ROWS(3, 4) DS_ROWS(4, 4) DS_ROWS(5, 4) DS_ROWS(6, 4)
    DS_ROWS(7, 2) DS_ROWS(8, 2) DS_ROWS(9, 2) DS_ROWS(10, 2) DS_ROWS(11, 2)
    default: DS_RUN(12, 2) DS_RUN(12, 1) break;
  }
#undef DS_ROWS
#undef DS_RUN
}

// Rows a pair-dot pass keeps hot: bfloat16 rows are half the bytes, so 384 (442 KB at K = 576)
// still sit in L2, and a weight bigger than the caches (an lm_head) streams from memory a
// quarter as often as with 96.
constexpr int64_t kDotRowChunk = 384;

// A panel group interleaved once into `scratch` for the tiles that share it.
PairedPanels group_pairs(RawPairs w, int64_t g, uint16_t* scratch) {
  const int64_t pairs = (w.K + 1) / 2;
  for (int64_t p = 0; p < g; ++p)
    for (int64_t j = 0; j < pairs; ++j)
      _mm512_storeu_si512(scratch + (p * pairs + j) * 2 * kPanel, w.load(p, j));
  return {scratch, w.K};
}

template <class Out>
void run_dot_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wp, Out* y,
                    int64_t N, int64_t p0, int64_t p1) {
  const int64_t panels_total = (N + kPanel - 1) / kPanel;
  const int64_t tail = N - (panels_total - 1) * kPanel;
  const RawPairs w{wp, K, pair_index()};
  std::vector<uint16_t> scratch(M > kMaxTileRows ? kGroup * ((K + 1) / 2) * 2 * kPanel : 0);
  for (int64_t m0 = 0; m0 < M; m0 += kDotRowChunk) {
    const int64_t mc = std::min(kDotRowChunk, M - m0);
    const int64_t tiles = (mc + kMaxTileRows - 1) / kMaxTileRows;
    if (tiles == 1) {
      dot_rows(static_cast<int>(mc), x + m0 * K, K, w.from(p0), K, y + m0 * N + p0 * kPanel, N,
               p1 - p0, p1 == panels_total ? tail : kPanel);
      continue;
    }
    for (int64_t p = p0; p < p1; p += kGroup) {
      const int64_t g = std::min(kGroup, p1 - p);
      const int64_t last_cols = p + g == panels_total ? tail : kPanel;
      const PairedPanels wg = group_pairs(w.from(p), g, scratch.data());
      int64_t r = m0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = static_cast<int>(mc / tiles + (t < mc % tiles ? 1 : 0));
        dot_rows(rows, x + r * K, K, wg, K, y + r * N + p * kPanel, N, g, last_cols);
        r += rows;
      }
    }
  }
}

}  // namespace

#pragma GCC pop_options

namespace deepserve_cpu {

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void linear_panels_avx512_f32(
    const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t p0,
    int64_t p1) {
  run_panels(x, M, K, F32Panels{w, K}, y, N, p0, p1);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void linear_panels_avx512_bf16(
    const float* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t p0,
    int64_t p1) {
  run_panels(x, M, K, BF16Panels{w, K}, y, N, p0, p1);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void
linear_panels_avx512bf16_dot(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* y,
                             int64_t N, int64_t p0, int64_t p1) {
  run_dot_panels(x, M, K, w, y, N, p0, p1);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void
linear_panels_avx512bf16_dot(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                             uint16_t* y, int64_t N, int64_t p0, int64_t p1) {
  run_dot_panels(x, M, K, w, y, N, p0, p1);
}

}  // namespace deepserve_cpu
