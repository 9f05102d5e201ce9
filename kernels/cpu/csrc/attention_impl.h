// Paged attention's walk over blocks and rows (kernels/cpu/csrc/attention.cpp has the contract),
// written once over an ISA's vector primitives: `Isa::dot8` (eight keys' scores), `softmax_block`,
// `scale_accumulate_rows` and `prefetch_rows`. attention.cpp instantiates it for AVX2,
// attention_avx512.cpp for AVX-512. Everything here is a template on `Isa`, a type local to each
// translation unit, so no function compiled for one target can stand in for the other's at link
// time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace deepserve_cpu::attention {

constexpr int64_t kTileRows = 32;  // query rows per work item: acc stays in L1 for Dv <= 64
constexpr int64_t kMaxBlock = 64;  // largest KV block size the score buffer holds

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

// One call's tensors as pointers (caches of element type T: float or a 16-bit bfloat16).
template <typename T>
struct Batch {
  const float* q;
  const T* k;
  const T* v;
  const int32_t* loc;     // query_start_loc
  const int32_t* lens;    // seq_lens
  const int32_t* tables;  // block_tables, `tstride` apart
  int64_t tstride;
  float* out;
  int64_t os0, os1;
};

// A row's running softmax state: max, sum, and the unnormalized output (dv floats).
struct RowState {
  float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
  float* acc;
};

// Fold `visible` keys kp/vp (pointer arrays padded to a multiple of 8) into R rows' states, each
// row's arithmetic exactly what it would be alone: R rows share the value loads and interleave
// their FMA chains (`Isa::scale_accumulate_rows`), which a lone row leaves latency-bound.
template <class Isa, typename T, int R>
inline void attend_block(const float* const* qr, const T* const* kp, const T* const* vp,
                         int64_t visible, const Layout& L, RowState* const* st) {
  alignas(64) float s[R][kMaxBlock + 16];
  const float* sp[R];
  float alpha[R];
  float* acc[R];
  const int64_t padded = (visible + 7) & ~int64_t{7};
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < padded; j += 8) Isa::dot8(qr[r], kp + j, L.dk, s[r] + j);
    for (int64_t j = 0; j < visible; ++j) s[r][j] *= L.scale;
    for (int64_t j = visible; j < padded; ++j) s[r][j] = -std::numeric_limits<float>::infinity();
    const float sum = Isa::softmax_block(s[r], padded, st[r]->m, &alpha[r]);
    st[r]->l = st[r]->l * alpha[r] + sum;
    sp[r] = s[r];
    acc[r] = st[r]->acc;
  }
  Isa::template scale_accumulate_rows<T, R>(acc, alpha, sp, vp, visible, L.dv);
}

// Rows [r, r + R) of an item when they all see `n` keys of the block, else false.
template <int R>
inline bool same_visible(const int64_t* visible, int64_t r, int64_t nrows, int64_t n) {
  if (r + R > nrows) return false;
  for (int i = 0; i < R; ++i)
    if (visible[r + i] != n) return false;
  return true;
}

template <class Isa, typename T>
inline void prefetch_block(const T* kc, const T* vc, int64_t blk, int64_t n, int64_t h,
                           const Layout& L) {
  Isa::prefetch_rows(kc + blk * L.kb + h * L.kh, L.kt, n, L.dk * int64_t(sizeof(T)));
  Isa::prefetch_rows(vc + blk * L.vb + h * L.vh, L.vt, n, L.dv * int64_t(sizeof(T)));
}

// The item's rows over its sequence's keys, block by block, prefetching the next block while
// this one computes.
template <class Isa, typename T>
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
  prefetch_block<Isa>(kc, vc, table[0], std::min(bs, keys), h, L);
  for (int64_t start = 0; start < keys; start += bs) {
    const int64_t blk = table[start / bs], n = std::min(bs, keys - start);
    if (start + bs < keys)
      prefetch_block<Isa>(kc, vc, table[start / bs + 1], std::min(bs, keys - start - bs), h, L);
    for (int64_t j = 0; j < n; ++j) {
      kp[j] = kc + blk * L.kb + j * L.kt + h * L.kh;
      vp[j] = vc + blk * L.vb + j * L.vt + h * L.vh;
    }
    for (int64_t j = n; j < ((n + 7) & ~int64_t{7}); ++j) kp[j] = kp[0];  // scored, then masked
    int64_t visible[kTileRows];
    const float* qr[kTileRows];
    RowState* st[kTileRows];
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t row = w.row0 + r, t = row / G;
      visible[r] = std::min(n, ctx + t + 1 - start);
      qr[r] = q + (q0 + t) * L.qs0 + (h * G + row % G) * L.qs1;
      st[r] = &rows[r];
    }
    for (int64_t r = 0; r < nrows;) {
      if (same_visible<4>(visible, r, nrows, n)) {
        attend_block<Isa, T, 4>(qr + r, kp, vp, n, L, st + r);
        r += 4;
      } else if (same_visible<2>(visible, r, nrows, n)) {
        attend_block<Isa, T, 2>(qr + r, kp, vp, n, L, st + r);
        r += 2;
      } else {
        if (visible[r] > 0) attend_block<Isa, T, 1>(qr + r, kp, vp, visible[r], L, st + r);
        r += 1;
      }
    }
  }
}

template <class Isa>
void store_item(const Work& w, const Layout& L, const std::vector<RowState>& rows, int64_t q0,
                float* out, int64_t os0, int64_t os1) {
  for (int64_t r = 0; r < w.row1 - w.row0; ++r) {
    const int64_t row = w.row0 + r;
    float* o = out + (q0 + row / L.group) * os0 + (w.head * L.group + row % L.group) * os1;
    const float inv = 1.0f / rows[r].l;
    for (int64_t d = 0; d < L.dv; ++d) o[d] = rows[r].acc[d] * inv;
  }
}

// Work items [i0, i1) of one call: one thread's share.
template <class Isa, typename T>
void attend_items(const Batch<T>& b, const Layout& L, const Work* items, int64_t i0, int64_t i1) {
  std::vector<float> acc;
  std::vector<RowState> rows;
  for (int64_t i = i0; i < i1; ++i) {
    const Work& w = items[i];
    const int64_t q0 = b.loc[w.seq], ctx = b.lens[w.seq] - (b.loc[w.seq + 1] - b.loc[w.seq]);
    attend_item<Isa, T>(w, L, b.q, b.k, b.v, b.tables + w.seq * b.tstride, q0, ctx, rows, acc);
    store_item<Isa>(w, L, rows, q0, b.out, b.os0, b.os1);
  }
}

}  // namespace deepserve_cpu::attention

namespace deepserve_cpu {

// The AVX-512 instantiations (kernels/cpu/csrc/attention_avx512.cpp); bfloat16 caches as uint16_t.
void attention_items_avx512_f32(const attention::Batch<float>& b, const attention::Layout& L,
                                const attention::Work* items, int64_t i0, int64_t i1);
void attention_items_avx512_bf16(const attention::Batch<uint16_t>& b,
                                 const attention::Layout& L, const attention::Work* items,
                                 int64_t i0, int64_t i1);

}  // namespace deepserve_cpu
