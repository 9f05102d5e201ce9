"""Paged attention for pure decode steps (one query per sequence), capturable in a CUDA graph.

One program takes one sequence, up to `BLOCK_H` query heads that share one KV head, and one split
of that sequence's keys, walking them straight from the block table: every KV row is read once
per head group, not once per head, and the query heads form the rows of the tensor-core
products (MLA's 16 heads over one latent "head" is FlashMLA's layout; GQA groups are padded to
16 rows). K may be wider than V and V may be K's leading columns (MLA's absorbed form: the
latent is both). The launch's split count is fixed by the batch size alone (up to `MAX_SPLITS`)
and each sequence's split width is derived from its length on the device (`_split_width`), so the
launch depends on no host value that changes between steps; a second kernel folds the splits.

`decode_attention` is not batch invariant (the split width follows the length and the batch).
`InvariantPagedAttention` is `--batch-invariant`'s: pure decode steps take `_invariant_split_kernel`,
which does attention.py's `_split_kernel` arithmetic row for row (the same fixed splits, key
blocks, head-dim chunks, tile shape and warps, so a decode row gets the bits it gets in a prefill
or mixed step) but puts the query heads that share a KV head in the tile's rows instead of query
tokens: every KV row is read once per head group, not once per head (16x fewer reads for MLA).
What does not live here: prefill (attention.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.triton import attention
from deepserve.kernels.triton.kv_codes import widen_kv
from deepserve.kernels.triton.lang import cdiv, constexpr, jit, next_power_of_2, tl

BLOCK_H = 16  # query heads per program: the smallest row count of a tensor-core product
TARGET_PROGRAMS = 264  # two waves of the H200's 132 SMs
# `--batch-invariant`'s decode: value columns split over programs (`value_runs`) until this
# many; each run recomputes its split's scores, so one wave, not two
INVARIANT_PROGRAMS = 132
MIN_VALUE_RUN = 64
# Splits a sequence uses: up to BASE_SPLITS as the length grows, then more once each of them would
# hold MIN_SPLIT_KEYS keys, up to the launch's count (MAX_SPLITS at batch 1). Below
# BASE_SPLITS * MIN_SPLIT_KEYS keys a split's fixed cost (its query load, partials, the fold) is
# not worth more programs; past it, a long context at a small batch would otherwise leave most
# SMs idle while a few programs walk tens of thousands of keys each.
# 256: a batch-1 sequence of 16K-64K keys then fills the 132 SMs about once (V2-Lite's MLA at
# 32K keys: 64 / 85 us against 73 / 88 with 512 in two calls, `--only decode_tiles`,
# run-gpu17-2 / -4); longer ones spread over MAX_SPLITS either way.
BASE_SPLITS = 32
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 256


@jit
def _split_width(seq_len, NUM_SPLITS, BASE: constexpr, MIN_KEYS: constexpr, BLOCK_N: constexpr):
    """Keys per split of a sequence of `seq_len` keys (a multiple of BLOCK_N; the split and the
    combine kernel derive it alike): spread over the launch's splits, but no narrower than the
    BASE-split width or MIN_KEYS, whichever is less."""
    spread = tl.cdiv(seq_len, NUM_SPLITS)
    base = tl.minimum(tl.cdiv(seq_len, tl.minimum(NUM_SPLITS, BASE)), MIN_KEYS)
    return tl.cdiv(tl.maximum(spread, base), BLOCK_N) * BLOCK_N


@jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, pm_ptr, pl_ptr, pacc_ptr,
    s_qb, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_tb, s_pb, s_ph, s_ab, s_ah, s_as,
    scale, HQ, GROUP, DV, block_size, NUM_SPLITS,
    BASE: constexpr, MIN_KEYS: constexpr, DM: constexpr, DT: constexpr, DT_REAL: constexpr, BLOCK_DV: constexpr, SHARED_V: constexpr,
    HEAD_BLOCKS: constexpr, BLOCK_H: constexpr, BLOCK_N: constexpr, PRECISION: constexpr,
):  # fmt: skip
    b, hg, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    kvh = hg // HEAD_BLOCKS
    heads = kvh * GROUP + (hg % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = (heads < (kvh + 1) * GROUP) & (heads < HQ)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = _split_width(seq_len, NUM_SPLITS, BASE, MIN_KEYS, BLOCK_N)
    key_lo = split * per_split
    if key_lo >= seq_len:
        return
    key_hi = tl.minimum(key_lo + per_split, seq_len)
    dm = tl.arange(0, DM)
    q_rows = q_ptr + b * s_qb + heads[:, None] * s_qh
    q_main = tl.load(q_rows + dm[None, :], mask=head_ok[:, None], other=0.0)
    if DT > 0:
        dt = DM + tl.arange(0, DT)
        dt_ok = dt < DM + DT_REAL
        q_tail = tl.load(q_rows + dt[None, :], mask=head_ok[:, None] & dt_ok[None, :], other=0.0)
    dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    for n0 in range(key_lo, key_hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < key_hi
        blk = tl.load(tables_ptr + b * s_tb + keys // block_size, mask=key_ok, other=0)
        row = blk.to(tl.int64) * s_kb + (keys % block_size) * s_ks + kvh * s_kh
        k_main = tl.load(k_ptr + row[:, None] + dm[None, :], mask=key_ok[:, None], other=0.0)
        k_main = widen_kv(k_main, q_main.dtype)
        scores = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
        if DT > 0:
            k_tail = tl.load(
                k_ptr + row[:, None] + dt[None, :],
                mask=key_ok[:, None] & dt_ok[None, :],
                other=0.0,
            )
            k_tail = widen_kv(k_tail, q_main.dtype)
            scores = tl.dot(q_tail, tl.trans(k_tail), scores, input_precision=PRECISION)
        scores = tl.where(key_ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        if SHARED_V:
            v = k_main
        else:
            vrow = blk.to(tl.int64) * s_vb + (keys % block_size) * s_vs + kvh * s_vh
            v = tl.load(
                v_ptr + vrow[:, None] + dv[None, :],
                mask=key_ok[:, None] & (dv[None, :] < DV),
                other=0.0,
            )
            v = widen_kv(v, q_main.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    part = b * s_pb + heads * s_ph + split
    tl.store(pm_ptr + part, m_i, mask=head_ok)
    tl.store(pl_ptr + part, l_i, mask=head_ok)
    pacc = pacc_ptr + b * s_ab + heads[:, None] * s_ah + split * s_as + dv[None, :]
    tl.store(pacc, acc, mask=head_ok[:, None] & (dv[None, :] < DV))


@jit
def _decode_combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, seq_lens_ptr, o_ptr,
    s_pb, s_ph, s_ab, s_ah, s_as, s_ob, s_oh, DV, NUM_SPLITS,
    BASE: constexpr, MIN_KEYS: constexpr, BLOCK_N: constexpr, BLOCK_DV: constexpr,
    SPLITS_P2: constexpr, BLOCK_S: constexpr,
):  # fmt: skip
    """One (sequence, head, BLOCK_DV columns): the splits' partials weighted by exp(m_s - M)
    against their largest max M, BLOCK_S splits a load. Spread over the columns and with no
    chain from one split to the next: at batch 1 the fold used to be 16 programs each walking
    its head's 256 splits one after another, longer than the splits' own walk."""
    b, h, d = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = _split_width(seq_len, NUM_SPLITS, BASE, MIN_KEYS, BLOCK_N)
    splits = tl.cdiv(seq_len, per_split)
    base = b * s_pb + h * s_ph
    every = tl.arange(0, SPLITS_P2)
    m_all = tl.load(pm_ptr + base + every, mask=every < splits, other=float("-inf"))
    top = tl.max(m_all, axis=0)
    l_all = tl.load(pl_ptr + base + every, mask=every < splits, other=0.0)
    l_sum = tl.sum(l_all * tl.exp(m_all - top), axis=0)
    dv = d * BLOCK_DV + tl.arange(0, BLOCK_DV)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    acc_base = pacc_ptr + b * s_ab + h * s_ah
    for s0 in range(0, splits, BLOCK_S):
        sv = s0 + tl.arange(0, BLOCK_S)
        ok = sv < splits
        w = tl.exp(tl.load(pm_ptr + base + sv, mask=ok, other=float("-inf")) - top)
        a = tl.load(
            acc_base + sv[:, None] * s_as + dv[None, :],
            mask=ok[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        acc += tl.sum(a * w[:, None], axis=0)
    out = acc / l_sum
    tl.store(o_ptr + b * s_ob + h * s_oh + dv, out.to(o_ptr.dtype.element_ty), mask=dv < DV)


COMBINE_DV = 64  # columns per fold program
COMBINE_SPLITS = 32  # splits per fold load


def num_splits(batch: int, kv_programs: int) -> int:
    """Key splits per sequence: enough programs to fill the GPU twice, from the batch size alone."""
    return max(1, min(MAX_SPLITS, cdiv(TARGET_PROGRAMS, batch * kv_programs)))


def _shares_rows(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """V is K's leading columns (MLA's latent): one load serves both products."""
    return (
        v_cache.data_ptr() == k_cache.data_ptr()
        and v_cache.stride() == k_cache.stride()
        and v_cache.shape[-1] == next_power_of_2(v_cache.shape[-1])
    )


@dataclass(frozen=True)
class DecodeTile:
    """The split kernel's keys per iteration and launch shape (the GPU job sweeps them:
    kernel_checks `time_long_decode_tiles`)."""

    block_n: int
    num_warps: int
    num_stages: int


# heads wider than 256 (MLA's 576-wide latent): V2-Lite's MLA at batch 1 over 32K / 131K keys
# and batch 64 over 4K, 64 / 128 / 191 us against 75 / 193 / 251 with 8 warps (run-gpu17-2,
# `--only decode_tiles`, before the fold was spread over the columns)
WIDE_TILE = DecodeTile(32, 4, 2)
# an e4m3 cache widens its tiles in registers: on 4 warps the MLA tile spills (compile_check:
# 255 registers, 19 spill stores), on 8 it does not; its speed was measured on 8 (kv_fp8)
WIDE_FP8_TILE = DecodeTile(32, 8, 2)
NARROW_TILE = DecodeTile(64, 4, 2)


def default_tile(head_dim: int, kv_dtype: torch.dtype) -> DecodeTile:
    """The split kernel's tile for a query head of `head_dim` over a cache of `kv_dtype`."""
    if head_dim <= 256:
        return NARROW_TILE
    return WIDE_FP8_TILE if kv_dtype.itemsize == 1 else WIDE_TILE


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    min_split_keys: int = MIN_SPLIT_KEYS,
    tile: DecodeTile | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """kernels/reference/attention.py's `paged_attention` for steps where every sequence brings one
    query (q `[B, Hq, Dk]`; caches `[num_blocks, block_size, Hkv, D]`, last dim contiguous).
    `min_split_keys`: see MIN_SPLIT_KEYS (tests lower it to reach many splits at small sizes);
    `tile`: the split kernel's (default: `default_tile`); `splits`:
    the launch's split count (default: `num_splits`)."""
    batch, hq, dk = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    group = hq // hkv
    shared = _shares_rows(k_cache, v_cache)
    dm = dv if shared else next_power_of_2(dk) // (2 if next_power_of_2(dk) != dk else 1)
    dm = min(dm, dk)
    dt = dk - dm
    if dm & (dm - 1) or dm < 16:
        raise ValueError(f"decode_attention takes a leading head part of 2^a >= 16, not {dm}")
    head_blocks = cdiv(group, BLOCK_H)
    splits = splits or num_splits(batch, hkv * head_blocks)
    out = torch.empty(batch, hq, dv, device=q.device, dtype=q.dtype)
    part_m = torch.empty(batch, hq, splits, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(batch, hq, splits, dv, device=q.device, dtype=torch.float32)
    block_dv = next_power_of_2(dv)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    tile = tile or default_tile(dk, k_cache.dtype)
    tables, seq_lens = attn.block_tables, attn.seq_lens
    _decode_split_kernel[(batch, hkv * head_blocks, splits)](
        q, k_cache, v_cache, tables, seq_lens, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        part_m.stride(0), part_m.stride(1), *part_acc.stride()[:3],
        scale, hq, group, dv, attn.block_size, splits, BASE=BASE_SPLITS, MIN_KEYS=min_split_keys,
        DM=dm, DT=max(16, next_power_of_2(dt)) if dt else 0, DT_REAL=dt, BLOCK_DV=block_dv, SHARED_V=shared, HEAD_BLOCKS=head_blocks,
        BLOCK_H=BLOCK_H, BLOCK_N=tile.block_n, PRECISION=precision,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    # columns spread over programs only while (sequence, head) pairs alone leave the GPU idle:
    # at batch 64 the spread fold took 479 us a V2-Lite step against 96 for whole rows (run-gpu17-5
    # / run-gpu16-6 profiles)
    fold_dv = min(COMBINE_DV, block_dv) if batch * hq < TARGET_PROGRAMS else block_dv
    _decode_combine_kernel[(batch, hq, cdiv(dv, fold_dv))](
        part_m, part_l, part_acc, seq_lens, out,
        part_m.stride(0), part_m.stride(1), *part_acc.stride()[:3], out.stride(0), out.stride(1),
        dv, splits, BASE=BASE_SPLITS, MIN_KEYS=min_split_keys, BLOCK_N=tile.block_n, BLOCK_DV=fold_dv,
        SPLITS_P2=next_power_of_2(splits), BLOCK_S=min(COMBINE_SPLITS, next_power_of_2(splits)),
        num_warps=4,
    )  # fmt: skip
    return out


@jit
def _invariant_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, pm_ptr, pl_ptr, pacc_ptr,
    s_qt, s_qh, s_qd, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, s_tb,
    s_pt, s_ph, s_ps, s_at, s_ah, s_as,
    scale, HQ, DK, DV, block_size, GROUP, HEAD_BLOCKS, DV_BLOCKS,
    SPLIT: constexpr, BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr,
    BLOCK_DV: constexpr, PRECISION: constexpr,
):  # fmt: skip
    """attention.py's `_walk_split` with rows = the query heads of one token (one KV head), for
    one split and one run of BLOCK_DV value columns (program_id(2) = split * DV_BLOCKS + run):
    every run computes the split's same scores, max and sum, and its own columns of p @ V, each
    column's chain over the keys the same whatever the run's width."""
    t, hg, sd = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    split, dv_lo = sd // DV_BLOCKS, (sd % DV_BLOCKS) * BLOCK_DV
    kvh = hg // HEAD_BLOCKS
    heads = kvh * GROUP + (hg % HEAD_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (heads < (kvh + 1) * GROUP) & (heads < HQ)
    last_pos = tl.load(seq_lens_ptr + t) - 1
    pos = tl.zeros((BLOCK_M,), tl.int32) + last_pos
    key_lo = split * SPLIT
    key_hi = tl.minimum(key_lo + SPLIT, last_pos + 1)
    if key_lo >= key_hi:  # past the sequence: the combine never reads this split
        return
    dv_run = tl.minimum(DV - dv_lo, BLOCK_DV)
    m_i, l_i, acc = attention._walk_split(
        q_ptr + t * s_qt + heads * s_qh, k_ptr, v_ptr, tables_ptr + t * s_tb, pos, row_ok,
        key_lo, key_hi, kvh * s_kh, kvh * s_vh + dv_lo * s_vd, s_qd, s_kb, s_ks, s_kd, s_vb,
        s_vs, s_vd, scale, DK, dv_run, block_size, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        PRECISION,
    )  # fmt: skip
    attention._store_split(
        pm_ptr, pl_ptr, pacc_ptr, t * s_pt + heads * s_ph + split * s_ps,
        t * s_at + heads * s_ah + split * s_as + dv_lo, row_ok, m_i, l_i, acc, dv_run, BLOCK_DV,
    )  # fmt: skip


def value_runs(programs: int, dv: int) -> int:
    """BLOCK_DV for the invariant decode's (token, head group, split) programs: value columns
    halved (down to 64) until the runs fill INVARIANT_PROGRAMS. At batch 1 a 512-key split of
    a 128-token context is one program per layer; its runs recompute the scores (half of its
    work on MLA) and split p @ V."""
    block_dv = next_power_of_2(dv)
    while block_dv > MIN_VALUE_RUN and programs * cdiv(dv, block_dv) < INVARIANT_PROGRAMS:
        block_dv //= 2
    return block_dv


def invariant_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    split: int = attention.SPLIT,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """attention.py's `TritonPagedAttention` for a step where every sequence brings one query,
    bitwise, from device tensors and the block-table width alone (capturable in a CUDA graph).
    The stages only pipeline the key loads: 4 give the same bits as 2 and take 22-46% off
    (H100, benchmarks/gpu/decode_matmul.py); 8 warps changed the bits at batch 64."""
    tokens, hq, dk = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    group = hq // hkv
    out = torch.empty(tokens, hq, dv, device=q.device, dtype=q.dtype)
    if tokens == 0:
        return out
    splits = cdiv(attn.block_tables.shape[1] * attn.block_size, split)
    part_m = torch.empty(tokens, hq, splits, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(tokens, hq, splits, dv, device=q.device, dtype=torch.float32)
    block_dv = next_power_of_2(dv)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    head_blocks = cdiv(group, attention.BLOCK_M)
    run = value_runs(tokens * hkv * head_blocks, dv)
    tables = attn.block_tables
    _invariant_split_kernel[(tokens, hkv * head_blocks, splits * cdiv(dv, run))](
        q, k_cache, v_cache, tables, attn.seq_lens, part_m, part_l, part_acc,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), tables.stride(0),
        *part_m.stride(), *part_acc.stride()[:3],
        scale, hq, dk, dv, attn.block_size, group, head_blocks, cdiv(dv, run),
        SPLIT=split, BLOCK_M=attention.BLOCK_M, BLOCK_N=attention.BLOCK_N,
        BLOCK_D=attention.BLOCK_D, BLOCK_DV=run, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    positions = _last_positions(attn)
    attention._combine_kernel[(tokens, hq)](
        part_m, part_l, part_acc, positions, out,
        *part_m.stride(), *part_acc.stride()[:3], out.stride(0), out.stride(1), dv,
        SPLIT=split, BLOCK_DV=block_dv, num_warps=4,
    )  # fmt: skip
    return out


def _last_positions(attn: AttentionMetadata) -> torch.Tensor:
    """Each sequence's query position, made once a step for every layer (a launch each was 27
    a step on V2-Lite)."""
    positions = attn.scratch.get("decode_positions")
    if positions is None:
        positions = attn.scratch["decode_positions"] = (attn.seq_lens - 1).to(torch.int32)
    return positions


class DecodeOrVarlen:
    """Paged attention that sends pure decode steps (one query per sequence) to `decode` and the
    rest (prefill, chunks mixed with decodes) to `varlen` (attention.py's kernel)."""

    def __init__(self, decode: Callable[..., torch.Tensor], varlen: Callable[..., torch.Tensor]):
        self.decode, self.varlen = decode, varlen

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if attn.num_tokens == attn.num_seqs:
            return self.decode(q, k_cache, v_cache, attn, scale)
        return self.varlen(q, k_cache, v_cache, attn, scale)


class InvariantPagedAttention(DecodeOrVarlen):
    """`--batch-invariant`'s paged attention: pure decode steps through the head-grouped kernel,
    the rest through attention.py's fixed-split kernel; a query row gets the same bits either way."""

    def __init__(self, split: int = attention.SPLIT) -> None:
        # `split`: a multiple of attention.BLOCK_N; tests use a small one
        decode = functools.partial(invariant_decode_attention, split=split)
        # prefill tiles of 2 tokens x 16 heads on MLA: a latent block read once for all heads
        varlen = attention.TritonPagedAttention(split, grouped_rows=32, grouped_warps=8)
        super().__init__(decode, varlen)
