"""Causal varlen flash attention on tensor cores, for fresh prefill chunks over per-head keys and
values: MLA's prefill in the decompressed form (the model decompresses the context's keys and
values from the latent cache, then calls `flash_prefill`).

Queries `[T, H, Dn + Dr]` and keys `[L, H, Dn + Dr]` come in two parts each, a main part (MLA's
no-rope dims) and a tail (the rope dims), so that a 192-dim head is two power-of-two products and
the rope key, one per token in MLA, is read through a head stride of 0 instead of copied per head.
Sequence s owns query rows `query_start_loc[s]:query_start_loc[s+1]` at positions
`context_lens[s] + i`, and key rows from `key_start_loc[s]` (key j at position j); a query sees the
keys at positions up to its own.

One program takes `BLOCK_M` query rows of one sequence and one head and walks the keys in blocks of
`BLOCK_N` from position 0 with an online softmax (exp2, the scale folded in): first the blocks
every row of the tile sees, unmasked, then the diagonal blocks, masked. A row's result depends only
on its own keys and this fixed block order: a block it cannot see leaves its state exactly as it
was (its max is kept, so the rescale is by exp2(0) = 1 and the masked terms add 0), whatever its
tile-mates see, so the tile a row lands in does not change its bits. Offsets are 64-bit.

What does not live here: paged attention over the block table (attention.py, decode_attention.py),
the decompression itself (the model's matmul).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepserve.kernels.attention_metadata import CausalVarlen
from deepserve.kernels.triton.lang import constexpr, jit, next_power_of_2, tl


@dataclass(frozen=True)
class FlashConfig:
    """One fixed tile configuration (the same for every batch, so rows stay batch invariant)."""

    # H200 (run-gpu13-1, V2-Lite's decompressed geometry): 3 stages beat 2 by 1.2x, 221 vs
    # 178 TFLOP/s on a fresh 2,000-token prompt and 460 vs 374 on an 8,192-token chunk over 32,768
    block_m: int = 128  # query rows per program
    block_n: int = 64  # keys per step
    num_warps: int = 8
    num_stages: int = 3


DEFAULT = FlashConfig()


@jit
def _key_block(
    m_i, l_i, acc, qn, qr, kn_ptr, kr_ptr, v_ptr, k_begin, n0, pos, last_pos,
    s_knt, s_krt, s_vt, scale_log2, DN, DR, DV,
    BLOCK_N: constexpr, BLOCK_DN: constexpr, BLOCK_DR: constexpr, BLOCK_DV: constexpr,
    MASKED: constexpr, PRECISION: constexpr,
):  # fmt: skip
    """One block of keys folded into the rows' (max, sum, accumulator)."""
    keys = n0 + tl.arange(0, BLOCK_N)
    key_ok = keys <= last_pos
    krow = (k_begin + keys).to(tl.int64)
    dn, dr, dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    kn = tl.load(
        kn_ptr + krow[:, None] * s_knt + dn[None, :],
        mask=key_ok[:, None] & (dn[None, :] < DN),
        other=0.0,
    )
    scores = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)
    kr = tl.load(
        kr_ptr + krow[:, None] * s_krt + dr[None, :],
        mask=key_ok[:, None] & (dr[None, :] < DR),
        other=0.0,
    )
    scores = tl.dot(qr, tl.trans(kr), scores, input_precision=PRECISION) * scale_log2
    # the mask is applied around the arithmetic, never inside it, so that a key a row sees gets
    # the same instructions (FMA contraction included) in a masked block as in an unmasked one
    if MASKED:
        visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        m_new = tl.maximum(m_i, tl.max(tl.where(visible, scores, float("-inf")), axis=1))
        p = tl.where(visible, tl.math.exp2(scores - m_new[:, None]), 0.0)
    else:
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.math.exp2(scores - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    v = tl.load(
        v_ptr + krow[:, None] * s_vt + dv[None, :],
        mask=key_ok[:, None] & (dv[None, :] < DV),
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@jit
def _flash_prefill_kernel(
    qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, o_ptr,
    tile_seq_ptr, tile_row_ptr, qstart_ptr, kstart_ptr, ctx_ptr,
    s_qnt, s_qnh, s_qrt, s_qrh, s_knt, s_knh, s_krt, s_krh, s_vt, s_vh, s_ot, s_oh,
    scale_log2, DN, DR, DV,
    BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_DN: constexpr, BLOCK_DR: constexpr,
    BLOCK_DV: constexpr, PRECISION: constexpr,
):  # fmt: skip
    tile, h = tl.program_id(0), tl.program_id(1).to(tl.int64)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_row_ptr + tile)
    q_begin = tl.load(qstart_ptr + seq)
    q_end = tl.load(qstart_ptr + seq + 1)
    k_begin = tl.load(kstart_ptr + seq).to(tl.int64)
    ctx = tl.load(ctx_ptr + seq)
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    pos = ctx + rows - q_begin
    first_pos = ctx + first - q_begin
    last_pos = ctx + tl.minimum(first + BLOCK_M, q_end) - 1 - q_begin
    r64 = rows.to(tl.int64)
    dn, dr, dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    qn = tl.load(
        qn_ptr + r64[:, None] * s_qnt + h * s_qnh + dn[None, :],
        mask=row_ok[:, None] & (dn[None, :] < DN),
        other=0.0,
    )
    qr = tl.load(
        qr_ptr + r64[:, None] * s_qrt + h * s_qrh + dr[None, :],
        mask=row_ok[:, None] & (dr[None, :] < DR),
        other=0.0,
    )
    kn_h, kr_h, v_h = kn_ptr + h * s_knh, kr_ptr + h * s_krh, v_ptr + h * s_vh
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    # keys below the tile's first position are seen by every row; the first block holds key 0,
    # which every row sees, so no row's max stays -inf past it
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _key_block(
            m_i, l_i, acc, qn, qr, kn_h, kr_h, v_h, k_begin, n0, pos, last_pos,
            s_knt, s_krt, s_vt, scale_log2, DN, DR, DV,
            BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV, False, PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, last_pos + 1, BLOCK_N):
        m_i, l_i, acc = _key_block(
            m_i, l_i, acc, qn, qr, kn_h, kr_h, v_h, k_begin, n0, pos, last_pos,
            s_knt, s_krt, s_vt, scale_log2, DN, DR, DV,
            BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV, True, PRECISION,
        )  # fmt: skip
    out = o_ptr + r64[:, None] * s_ot + h * s_oh + dv[None, :]
    val = acc / l_i[:, None]
    tl.store(out, val.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))


def _tiles(seqs: CausalVarlen, block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(sequence, first query row) of every tile, built on the host once per step and block_m."""
    key = ("flash_tiles", block_m)
    if key not in seqs.scratch:
        tile_seq, tile_row, start = [], [], 0
        for i, n in enumerate(seqs.query_lens_cpu):
            tile_seq += [i] * len(range(0, n, block_m))
            tile_row += range(start, start + n, block_m)
            start += n
        host = torch.tensor([tile_seq, tile_row], dtype=torch.int32)
        seqs.scratch[key] = tuple(host.to(device, non_blocking=True))
    return seqs.scratch[key]


def _dot_width(d: int) -> int:
    return max(16, next_power_of_2(d))  # tensor-core products take K >= 16


def flash_prefill(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    seqs: CausalVarlen,
    scale: float,
    cfg: FlashConfig = DEFAULT,
) -> torch.Tensor:
    """softmax(q.k * scale) v over each query's causal keys -> `[T, H, Dv]` in q's dtype.

    q_nope `[T, H, Dn]`, q_rope `[T, H, Dr]`; k_nope `[L, H, Dn]`; k_rope `[L, H, Dr]` (a head
    stride of 0, as `expand` gives, shares one rope key among the heads); v `[L, H, Dv]`. Any
    strides with the last dim contiguous."""
    tokens, heads, dn = q_nope.shape
    dr, dv = q_rope.shape[-1], v.shape[-1]
    out = torch.empty(tokens, heads, dv, device=q_nope.device, dtype=q_nope.dtype)
    if tokens == 0:
        return out
    for t in (q_nope, q_rope, k_nope, k_rope, v):
        assert t.stride(-1) == 1, "flash_prefill reads the last dim contiguous"
    tile_seq, tile_row = _tiles(seqs, cfg.block_m, q_nope.device)
    precision = "ieee" if q_nope.dtype == torch.float32 else "tf32"
    _flash_prefill_kernel[(tile_seq.numel(), heads)](
        q_nope, q_rope, k_nope, k_rope, v, out, tile_seq, tile_row,
        seqs.query_start_loc, seqs.key_start_loc, seqs.context_lens,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_rope.stride(0), k_rope.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * math.log2(math.e), dn, dr, dv,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DN=_dot_width(dn),
        BLOCK_DR=_dot_width(dr), BLOCK_DV=_dot_width(dv), PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
