// Paged attention's walk over key tiles and rows (kernels/cpu/csrc/attention.cpp has the
// contract), written once over an ISA's vector primitives: `Isa::pack_keys` (a tile's keys
// transposed into a [head][key] panel), `Isa::scores` (a register-blocked score tile),
// `softmax_block` and `scale_accumulate_rows` (or, where `Isa::kPairValues`, `pack_values` and
// `accumulate_pairs`: p @ V over pairs of keys), with q rows of element type `Isa::Q`. attention.cpp instantiates it
// for AVX2, attention_avx512.cpp for AVX-512. Everything here is a template on `Isa`, a type
// local to each translation unit, so no function compiled for one target can stand in for the
// other's at link time.
//
// Scores are a small GEMM: per key tile, the keys are transposed once into a panel and each
// score q . k is ONE multiply-add chain over the head, d = 0, 1, ..., in a vector lane of its
// own (keys across lanes, query rows broadcast), so a score's bits depend on its q row and key
// alone. Key tiles are fixed by absolute key position (tile i holds keys [i kKeys, (i+1) kKeys)
// of the sequence), so a row's online softmax sees the same tiles, in the same order, whether
// it is computed in a prefill, a chunk of one, a decode step or beside any other rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace deepserve_cpu::attention {

constexpr int64_t kTileRows = 96;  // query rows per work item: all share each tile's key panel
constexpr int64_t kKeys = 64;      // keys per tile: one softmax rescale per row per tile

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

// One call's tensors as pointers (caches of element type T: float or a 16-bit bfloat16; q rows
// of the path's `Isa::Q`: float32, or bfloat16 where the path scores bfloat16 pairs).
template <typename T>
struct Batch {
  const void* q;
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

// One thread's scratch, reused across its work items: the rows' outputs, the key panel and,
// on a path that takes p @ V in pairs of keys, the value panel.
struct Scratch {
  std::vector<float> acc, panel_store, vpanel_store;
  std::vector<RowState> rows;
  float* panel(int64_t dk) {  // [dk][kKeys], 64-byte aligned
    return aligned(panel_store, dk * kKeys);
  }
  uint32_t* vpanel(int64_t dv) {  // [kKeys / 2][dv] 32-bit words, 64-byte aligned
    return reinterpret_cast<uint32_t*>(aligned(vpanel_store, kKeys / 2 * dv));
  }
  static float* aligned(std::vector<float>& store, int64_t n) {
    store.resize(n + 16);
    const auto p = reinterpret_cast<uintptr_t>(store.data());
    return store.data() + ((64 - p % 64) % 64) / sizeof(float);
  }
};

// R rows of a tile (vis[r] of its keys visible to row r, nondecreasing: rows are token-major):
// their scores, the softmax update and p @ V. Each row's operations and their order are the
// same for any R; the R rows share the panel and value loads and interleave their chains.
template <class Isa, typename T, int R>
inline void attend_rows(const typename Isa::Q* const* qr, const float* panel, const T* const* vp,
                        const uint32_t* vpanel, const int64_t* vis, const Layout& L,
                        RowState* st) {
  alignas(64) float s[R][kKeys];
  const int64_t n = Isa::template scores<R>(qr, panel, L.dk, L.scale, vis, &s[0][0]);
  float alpha[R];
  const float* sp[R];
  float* acc[R];
  for (int r = 0; r < R; ++r) {
    // (a whole tile, the common case, with its length a constant the compiler unrolls)
    const float sum = n == kKeys ? Isa::softmax_block(s[r], kKeys, st[r].m, &alpha[r])
                                 : Isa::softmax_block(s[r], n, st[r].m, &alpha[r]);
    st[r].l = st[r].l * alpha[r] + sum;
    sp[r] = s[r];
    acc[r] = st[r].acc;
  }
  if constexpr (Isa::kPairValues) {
    Isa::template accumulate_pairs<R>(acc, alpha, sp, vpanel, vis, L.dv);
    return;
  }
  // Keys every row sees together, then each row's own last keys (acc * 1 is exact, so the
  // split leaves each row's chain over its keys as one).
  const int64_t shared = vis[0];
  Isa::template scale_accumulate_rows<T, R>(acc, alpha, sp, vp, shared, L.dv);
  for (int r = 1; r < R; ++r) {
    if (vis[r] == shared) continue;
    const float one = 1.0f, *p = sp[r] + shared;
    Isa::template scale_accumulate_rows<T, 1>(&acc[r], &one, &p, vp + shared, vis[r] - shared,
                                              L.dv);
  }
}

// attend_rows for n rows, n <= R (Isa::kRows at the top).
template <class Isa, typename T, int R = Isa::kRows>
inline void attend_rows_n(int64_t n, const typename Isa::Q* const* qr, const float* panel,
                          const T* const* vp, const uint32_t* vpanel, const int64_t* vis,
                          const Layout& L, RowState* st) {
  if constexpr (R > 1) {
    if (n < R) return attend_rows_n<Isa, T, R - 1>(n, qr, panel, vp, vpanel, vis, L, st);
  }
  attend_rows<Isa, T, R>(qr, panel, vp, vpanel, vis, L, st);
}

// Pointers to keys [start, start + n) of head h of a sequence (its block table `table`).
template <typename T>
inline void tile_rows(const T* cache, int64_t b, int64_t t, int64_t hoff, const int32_t* table,
                      int64_t bs, int64_t start, int64_t n, const T** out) {
  int64_t blk = start / bs, off = start % bs;
  for (int64_t j = 0; j < n; ++j) {
    out[j] = cache + table[blk] * b + off * t + hoff;
    if (++off == bs) off = 0, ++blk;
  }
}

// A prefetch into L2 as an asm statement: GCC dropped `_mm_prefetch` / `__builtin_prefetch`
// from these loops (no prefetch instruction was emitted), so it is spelled out.
inline void prefetch_l2(const void* p) {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}

template <typename T>
inline void prefetch_keys(const T* const* kp, const T* const* vp, int64_t n, const Layout& L) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t b = 0; b < L.dk * int64_t(sizeof(T)); b += 64)
      prefetch_l2(reinterpret_cast<const char*>(kp[j]) + b);
    for (int64_t b = 0; b < L.dv * int64_t(sizeof(T)); b += 64)
      prefetch_l2(reinterpret_cast<const char*>(vp[j]) + b);
  }
}

// The item's rows over its sequence's keys, tile by tile, prefetching the next tile while this
// one computes.
template <class Isa, typename T>
void attend_item(const Work& w, const Layout& L, const typename Isa::Q* q, const T* kc, const T* vc,
                 const int32_t* table, int64_t q0, int64_t ctx, Scratch& sc) {
  const int64_t nrows = w.row1 - w.row0, G = L.group, bs = L.block_size, h = w.head;
  sc.acc.assign(nrows * L.dv, 0.0f);
  sc.rows.assign(nrows, RowState{});
  int64_t limit[kTileRows];  // keys of the sequence row r sees
  const typename Isa::Q* qr[kTileRows];
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t row = w.row0 + r, t = row / G;
    sc.rows[r].acc = sc.acc.data() + r * L.dv;
    limit[r] = ctx + t + 1;
    qr[r] = q + (q0 + t) * L.qs0 + (h * G + row % G) * L.qs1;
  }
  float* panel = sc.panel(L.dk);
  uint32_t* vpanel = Isa::kPairValues ? sc.vpanel(L.dv) : nullptr;
  const int64_t keys = limit[nrows - 1];
  const T* kp[2][kKeys];
  const T* vp[2][kKeys];
  tile_rows(kc, L.kb, L.kt, h * L.kh, table, bs, 0, std::min(kKeys, keys), kp[0]);
  tile_rows(vc, L.vb, L.vt, h * L.vh, table, bs, 0, std::min(kKeys, keys), vp[0]);
  for (int64_t start = 0, i = 0; start < keys; start += kKeys, i ^= 1) {
    const int64_t n = std::min(kKeys, keys - start), next = std::min(kKeys, keys - start - n);
    if (next > 0) {
      tile_rows(kc, L.kb, L.kt, h * L.kh, table, bs, start + n, next, kp[i ^ 1]);
      tile_rows(vc, L.vb, L.vt, h * L.vh, table, bs, start + n, next, vp[i ^ 1]);
    }
    // 16 keys at a time, each group prefetching the next tile's keys at its place: a tile's
    // rows all at once would queue more misses than the core keeps in flight.
    for (int64_t j = 0; j < n; j += 16) {
      Isa::pack_keys(kp[i] + j, std::min<int64_t>(16, n - j), L.dk, panel + j);
      if (j < next)
        prefetch_keys(kp[i ^ 1] + j, vp[i ^ 1] + j, std::min<int64_t>(16, next - j), L);
    }
    if constexpr (Isa::kPairValues) Isa::pack_values(vp[i], n, L.dv, vpanel);
    int64_t vis[kTileRows];
    int64_t r = 0;
    for (int64_t x = 0; x < nrows; ++x) vis[x] = std::min(n, limit[x] - start);
    while (vis[r] <= 0) ++r;  // the last row sees this tile
    for (; r < nrows; r += Isa::kRows) {
      const int64_t m = std::min<int64_t>(Isa::kRows, nrows - r);
      attend_rows_n<Isa, T>(m, qr + r, panel, vp[i], vpanel, vis + r, L, sc.rows.data() + r);
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
  Scratch sc;
  for (int64_t i = i0; i < i1; ++i) {
    const Work& w = items[i];
    const int64_t q0 = b.loc[w.seq], ctx = b.lens[w.seq] - (b.loc[w.seq + 1] - b.loc[w.seq]);
    attend_item<Isa, T>(w, L, static_cast<const typename Isa::Q*>(b.q), b.k, b.v, b.tables + w.seq * b.tstride, q0, ctx, sc);
    store_item<Isa>(w, L, sc.rows, q0, b.out, b.os0, b.os1);
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
// AVX512-BF16: bfloat16 q rows against a bfloat16 cache, scores by vdpbf16ps (q in b.q as bf16).
void attention_items_avx512bf16_dot(const attention::Batch<uint16_t>& b,
                                    const attention::Layout& L, const attention::Work* items,
                                    int64_t i0, int64_t i1);

}  // namespace deepserve_cpu
