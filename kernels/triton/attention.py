"""Fixed-split paged attention over the block-table KV cache, for prefill, chunked prefill and decode.

Keys are cut into splits of `SPLIT` positions counted from position 0; one program computes one tile
of up to `BLOCK_M` query rows of one sequence, for one head and one split, walking the split's keys in
blocks of `BLOCK_N` with an online softmax; a second kernel folds a row's splits in order. A query at
position p therefore always sees splits 0..p // SPLIT and, inside each, the same key blocks, whether
it arrives in a 2K-token prefill, a chunk, or a decode step: rows of a tile are independent in the
tensor-core products, and a row whose keys end earlier than its tile-mates' keeps its state
untouched (not merely rescaled by exp(0)) on the blocks it cannot see.

Prefill and mixed steps fold a tile's splits inside the program that walks them (`_varlen_kernel`),
with `_merge_split`, the fold `_combine_kernel` applies to the partials of the split-per-program
decode kernels: no per-split partials reach memory, whose size grows with context x query rows
(a 24K-token prompt's 8K-token chunk asked for 3.2e9 of them, past 32-bit offsets). Offsets are
64-bit wherever rows, blocks or splits multiply a stride.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.triton.kv_codes import widen_kv
from deepserve.kernels.triton.lang import constexpr, jit, next_power_of_2, tl

SPLIT = 512  # keys per split: fixed, whatever the context length or batch
BLOCK_M = 16  # query rows per program
BLOCK_N = 64  # keys per step inside a split
BLOCK_D = 64  # head-dim chunk of the q.k products


@jit
def _walk_split(
    q_rows, k_ptr, v_ptr, table, pos, row_ok, key_lo, key_hi, k_head, v_head,
    s_qd, s_kb, s_ks, s_kd, s_vb, s_vs, s_vd, scale, DK, DV, block_size,
    BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
    PRECISION: constexpr,
):  # fmt: skip
    """One split's keys for BLOCK_M query rows (pointers `q_rows`, positions `pos`): the online
    softmax's (max, sum, accumulator). The one body of every fixed-split kernel, so that a row
    gets the same bits whichever kernel walks it (decode_attention.py's head-grouped one too)."""
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for n0 in range(key_lo, key_hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < key_hi
        blk = tl.load(table + keys // block_size, mask=key_ok, other=0).to(tl.int64)
        slot = keys % block_size
        scores = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for d0 in range(0, DK, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            q = tl.load(
                q_rows[:, None] + d[None, :] * s_qd,
                mask=row_ok[:, None] & (d[None, :] < DK),
                other=0.0,
            )
            k = tl.load(
                k_ptr + blk[None, :] * s_kb + slot[None, :] * s_ks + k_head + d[:, None] * s_kd,
                mask=(d[:, None] < DK) & key_ok[None, :],
                other=0.0,
            )
            k = widen_kv(k, q.dtype)
            scores = tl.dot(q, k, scores, input_precision=PRECISION)
        visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :] & row_ok[:, None]
        scores = tl.where(visible, scores * scale, float("-inf"))
        sees = tl.max(visible.to(tl.int32), axis=1) > 0
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_use = tl.where(sees, m_new, 0.0)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(scores - m_use[:, None])
        v = tl.load(
            v_ptr + blk[:, None] * s_vb + slot[:, None] * s_vs + v_head + dv[None, :] * s_vd,
            mask=key_ok[:, None] & dv_ok[None, :],
            other=0.0,
        )
        v = widen_kv(v, q_rows.dtype.element_ty)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = tl.where(sees[:, None], acc * alpha[:, None] + pv, acc)
        l_i = tl.where(sees, l_i * alpha + tl.sum(p, axis=1), l_i)
        m_i = tl.where(sees, m_new, m_i)
    return m_i, l_i, acc


@jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, tile_seq_ptr, tile_row_ptr, qstart_ptr, ctx_ptr, o_ptr,
    s_qt, s_qh, s_qd, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, s_tb, s_ot, s_oh,
    scale, DK, DV, block_size, GROUP,
    HEADS: constexpr, SPLIT: constexpr, BLOCK_M: constexpr, BLOCK_N: constexpr,
    BLOCK_D: constexpr, BLOCK_DV: constexpr, PRECISION: constexpr,
):  # fmt: skip
    """One tile of query rows: every split the tile sees, walked and folded in order. HEADS 1:
    BLOCK_M query tokens of one head (program_id(1) the head). Otherwise BLOCK_M // HEADS tokens
    x HEADS query heads of one KV head (program_id(1); HEADS is GROUP rounded up to a power of
    2), so a key block loaded once serves all of them; each row walks the same splits and key
    blocks either way, in the same order."""
    tile, p = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_row_ptr + tile)
    q_begin = tl.load(qstart_ptr + seq)
    q_end = tl.load(qstart_ptr + seq + 1)
    ctx = tl.load(ctx_ptr + seq)
    r = tl.arange(0, BLOCK_M)
    rows = first + r // HEADS
    if HEADS == 1:
        kvh = p // GROUP
        head = p + 0 * r
        row_ok = rows < q_end
    else:
        kvh = p
        head = p * GROUP + r % HEADS
        row_ok = (rows < q_end) & (r % HEADS < GROUP)
    pos = ctx + rows - q_begin
    last_pos = ctx + tl.minimum(first + BLOCK_M // HEADS, q_end) - 1 - q_begin
    q_rows = q_ptr + rows.to(tl.int64) * s_qt + head * s_qh
    table = tables_ptr + seq.to(tl.int64) * s_tb
    m_i, l_i, acc = _walk_split(
        q_rows, k_ptr, v_ptr, table, pos, row_ok, 0, tl.minimum(SPLIT, last_pos + 1),
        kvh * s_kh, kvh * s_vh, s_qd, s_kb, s_ks, s_kd, s_vb, s_vs, s_vd,
        scale, DK, DV, block_size, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION,
    )  # fmt: skip
    for split in range(1, last_pos // SPLIT + 1):
        key_lo = split * SPLIT
        ms, ls, a_s = _walk_split(
            q_rows, k_ptr, v_ptr, table, pos, row_ok, key_lo,
            tl.minimum(key_lo + SPLIT, last_pos + 1), kvh * s_kh, kvh * s_vh, s_qd, s_kb, s_ks,
            s_kd, s_vb, s_vs, s_vd, scale, DK, DV, block_size, BLOCK_M, BLOCK_N, BLOCK_D,
            BLOCK_DV, PRECISION,
        )  # fmt: skip
        m_i, l_i, acc = _merge_split(m_i, l_i, acc, ms, ls, a_s, split <= pos // SPLIT)
    dv = tl.arange(0, BLOCK_DV)
    out = o_ptr + rows.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + dv[None, :]
    val = acc / l_i[:, None]
    tl.store(out, val.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))


@jit
def _merge_split(m_i, l_i, acc, ms, ls, a_s, take):
    """Fold one split's (max, sum, accumulator) of rows `[R]` / `[R, BLOCK_DV]` into the running
    ones where `take`: the one fold of every fixed-split path, so a row gets the same bits whether
    its splits are folded in registers (`_varlen_kernel`) or from partials (`_combine_kernel`)."""
    m_new = tl.maximum(m_i, ms)
    old, new = tl.exp(m_i - m_new), tl.exp(ms - m_new)
    acc_new = acc * old[:, None] + a_s * new[:, None]
    l_new = l_i * old + ls * new
    return (
        tl.where(take, m_new, m_i),
        tl.where(take, l_new, l_i),
        tl.where(take[:, None], acc_new, acc),
    )


@jit
def _store_split(
    pm_ptr, pl_ptr, pacc_ptr, part, acc_rows, row_ok, m_i, l_i, acc, DV,
    BLOCK_DV: constexpr,
):  # fmt: skip
    """One split's partials for BLOCK_M rows, read back by `_combine_kernel`: `part` and
    `acc_rows` are the rows' offsets (split included) into the (max, sum) and accumulator ones."""
    dv = tl.arange(0, BLOCK_DV)
    tl.store(pm_ptr + part, m_i, mask=row_ok)
    tl.store(pl_ptr + part, l_i, mask=row_ok)
    pacc = pacc_ptr + acc_rows[:, None] + dv[None, :]
    tl.store(pacc, acc, mask=row_ok[:, None] & (dv[None, :] < DV))


@jit
def _combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, pos_ptr, o_ptr,
    s_pt, s_ph, s_ps, s_at, s_ah, s_as, s_ot, s_oh, DV,
    SPLIT: constexpr, BLOCK_DV: constexpr,
):  # fmt: skip
    """Folds the partials of one (row, head) left by a split-per-program kernel (decode steps)."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    splits = tl.load(pos_ptr + t) // SPLIT + 1  # every one of them holds a key this row sees
    one = tl.arange(0, 1)  # a tile of one row, so the fold is `_merge_split` itself
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = (one[:, None] >= 0) & (dv[None, :] < DV)
    base = t * s_pt + h * s_ph + one
    acc_base = pacc_ptr + (t * s_at + h * s_ah + one)[:, None] + dv[None, :]
    m = tl.load(pm_ptr + base)
    l_sum = tl.load(pl_ptr + base)
    acc = tl.load(acc_base, mask=dv_ok, other=0.0)
    for s in range(1, splits):
        ms = tl.load(pm_ptr + base + s * s_ps)
        ls = tl.load(pl_ptr + base + s * s_ps)
        a_s = tl.load(acc_base + s * s_as, mask=dv_ok, other=0.0)
        m, l_sum, acc = _merge_split(m, l_sum, acc, ms, ls, a_s, one >= 0)
    out = o_ptr + (t * s_ot + h * s_oh + one)[:, None] + dv[None, :]
    tl.store(out, (acc / l_sum[:, None]).to(o_ptr.dtype.element_ty), mask=dv_ok)


@dataclass
class _StepLayout:
    """Per-step tensors shared by every layer's call (built once per AttentionMetadata)."""

    attn: AttentionMetadata
    tile_seq: torch.Tensor  # [tiles] int32
    tile_row: torch.Tensor  # [tiles] int32: first query row of the tile


class TritonPagedAttention:
    """`paged_attention(q, k_cache, v_cache, attn, scale)` as in kernels/reference/attention.py."""

    def __init__(
        self,
        split: int = SPLIT,
        block_m: int = BLOCK_M,
        num_warps: int = 4,
        grouped_rows: int = 0,
        grouped_warps: int = 4,
    ) -> None:
        self.split = split  # a multiple of BLOCK_N; tests use a small one
        self.block_m, self.num_warps = block_m, num_warps  # query rows per program, its warps
        # > 0: tiles of that many (token, head) rows over one KV head (`_varlen_kernel` with
        # HEADS > 1) where a KV head serves several query heads. Under 64 rows the same bits as
        # one head a tile (H100, benchmarks/gpu/tile_bits.py): from 64 rows Triton issues wgmma,
        # whose accumulator layout sums a row's max and softmax denominator in another order.
        self.grouped_rows, self.grouped_warps = grouped_rows, grouped_warps
        self._layout: _StepLayout | None = None  # the current step's, reused by every layer
        self._layout_tokens = block_m  # query tokens per tile the layout was built for

    def _step_layout(
        self, attn: AttentionMetadata, device: torch.device, tokens: int
    ) -> _StepLayout:
        if self._layout is not None and self._layout.attn is attn and self._layout_tokens == tokens:
            return self._layout
        if attn.num_tokens == attn.num_seqs:
            self._layout = self._decode_layout(attn, device)
        else:
            self._layout = self._host_layout(attn, device, tokens)
        self._layout_tokens = tokens
        return self._layout

    def _host_layout(
        self, attn: AttentionMetadata, device: torch.device, tokens: int | None = None
    ) -> _StepLayout:
        """Tiles of `tokens` query tokens (None: block_m) of one sequence, from the host lengths."""
        tokens = tokens or self.block_m
        tile_seq, tile_row, start = [], [], 0
        for i, n in enumerate(attn.query_lens_cpu):
            for r in range(0, n, tokens):
                tile_seq.append(i)
                tile_row.append(start + r)
            start += n
        host = torch.tensor([tile_seq, tile_row], dtype=torch.int32)
        return _StepLayout(
            attn=attn,
            tile_seq=host[0].to(device, non_blocking=True),
            tile_row=host[1].to(device, non_blocking=True),
        )

    def _decode_layout(self, attn: AttentionMetadata, device: torch.device) -> _StepLayout:
        """One query per sequence: the layout from device tensors alone, so a decode step can be
        captured in a CUDA graph and replayed at other lengths (the kernel reads each length)."""
        rows = torch.arange(attn.num_seqs, dtype=torch.int32, device=device)
        return _StepLayout(attn=attn, tile_seq=rows, tile_row=rows)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        tokens, hq, dk = q.shape
        hkv, dv = k_cache.shape[2], v_cache.shape[-1]
        out = torch.empty(tokens, hq, dv, device=q.device, dtype=q.dtype)
        if tokens == 0:
            return out
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        qsl, ctx, tables = attn.query_start_loc, attn.context_lens, attn.block_tables
        group = hq // hkv
        grouped = self.grouped_rows and group > 1 and attn.num_tokens > attn.num_seqs
        heads = next_power_of_2(group) if grouped else 1
        rows = max(self.grouped_rows, heads) if grouped else self.block_m
        lay = self._step_layout(attn, q.device, rows // heads)
        _varlen_kernel[(lay.tile_seq.numel(), hkv if grouped else hq)](
            q, k_cache, v_cache, tables, lay.tile_seq, lay.tile_row, qsl, ctx, out,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), tables.stride(0),
            out.stride(0), out.stride(1), scale, dk, dv, attn.block_size, group,
            HEADS=heads, SPLIT=self.split, BLOCK_M=rows, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            BLOCK_DV=next_power_of_2(dv), PRECISION=precision,
            num_warps=self.grouped_warps if grouped else self.num_warps, num_stages=2,
        )  # fmt: skip
        return out
