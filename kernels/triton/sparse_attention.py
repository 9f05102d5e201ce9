"""DeepSeek-V4's attention ops as Triton kernels, batched over a step's tokens and capturable in
a CUDA graph (the contract: kernels/kernel_set.py's `sparse_attention`, `indexer_topk`,
`compress_pool`; the torch oracle: kernels/reference/sparse_attention.py).

`sparse_attention`: multi-query attention over one shared K=V latent head. One program takes
one token and `BLOCK_H` of its heads, so every key row is read once per head block and Q.K^T is
a tensor-core product with the heads as its rows. A token's keys are its window slots, then its
entry slots; each list is cut into fixed splits of `SPLIT` keys counted from its start, walked
in tiles of `BLOCK_N` keys with an online softmax and folded in list order by `_merge_split`.
Short steps (decode) give each split its own program and fold the partials in a second kernel;
long ones fold them in registers; the bits are the same either way, and -1 padding at a list's
end only adds splits that are skipped, so a row's result depends on its own lists alone
(batch invariant by construction). The sink logit joins the denominator at the end (`_finish`).

`indexer_topk`: one program per (token, block of entries) scores the block against all index
heads in one tensor-core product (heads summed by one fixed reduction tree); blocks at or past
the token's visible count store -inf without reading. The top-k is topk.py's one-launch radix
select, already in entry order; `topk_ascending` here is its torch twin (int64 keys packing the
score's monotone bits above the reversed entry index: unique, so the chosen set and its order do
not depend on torch.topk's tie handling), which the GPU job compares it with.

`compress_pool`: one program per (group, column block) softmaxes the group's candidates per
column in float32 and pools their kv columns; a group's result never depends on the others.

Every launch takes its shapes from tensor shapes and reads lengths on the device: no host sync,
so all three can be captured in a CUDA graph.

What does not live here: the model's choice of slots (engine/models/deepseek_v4.py).
"""

from __future__ import annotations

import torch

from deepserve.kernels.triton import topk
from deepserve.kernels.triton.lang import cdiv, constexpr, jit, next_power_of_2, tl

SPLIT = 128  # keys per split of a list: fixed, whatever the list length or the batch
BLOCK_H = 16  # heads per program: the smallest row count of a tensor-core product
# Steps with at most this many (token, head block) programs give each split its own program
# (decode: a batch-1 step would otherwise run 4 programs); longer ones fold in registers, as
# per-split partials grow with tokens x heads x splits x D.
SPLIT_PROGRAMS_MAX = 256


@jit
def _walk_tile(
    q, kv_ptr, slot, m_i, l_i, acc, s_kv, s_kd, scale, D,
    BLOCK_D: constexpr, PRECISION: constexpr,
):  # fmt: skip
    """One tile of keys (`slot` row ids, -1 = none) into the online softmax's state. A tile
    without a key leaves it bitwise as it was: alpha is exp(0) = 1 and p is 0 (or everything
    stays (-inf, 0, 0) while no key has come yet)."""
    d = tl.arange(0, BLOCK_D)
    key_ok = slot >= 0
    rows = tl.where(key_ok, slot, 0).to(tl.int64) * s_kv
    kv = tl.load(
        kv_ptr + rows[:, None] + d[None, :] * s_kd,
        mask=key_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )
    scores = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale
    scores = tl.where(key_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(scores - m_use[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@jit
def _walk_split(
    q, kv_ptr, slots_ptr, lo, hi, s_kv, s_kd, scale, D,
    BLOCK_H: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr, PRECISION: constexpr,
    SKIP_EMPTY: constexpr,
):  # fmt: skip
    """Keys `slots_ptr[lo:hi]` (row ids into `kv_ptr`, -1 = none) for the query tile `q`
    [BLOCK_H, BLOCK_D]: the online softmax's (max, sum, accumulator) in float32, so -1 padding
    never changes a bit. SKIP_EMPTY branches around tiles without a key (long padded lists)
    at the price of the loop's software pipelining; the bits are the same."""
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + j, mask=j < hi, other=-1)
        if SKIP_EMPTY:
            if tl.max(slot, axis=0) >= 0:
                m_i, l_i, acc = _walk_tile(
                    q, kv_ptr, slot, m_i, l_i, acc, s_kv, s_kd, scale, D, BLOCK_D, PRECISION
                )
        else:
            m_i, l_i, acc = _walk_tile(
                q, kv_ptr, slot, m_i, l_i, acc, s_kv, s_kd, scale, D, BLOCK_D, PRECISION
            )
    return m_i, l_i, acc


@jit
def _merge_split(m_i, l_i, acc, ms, ls, a_s):
    """Fold one split's (max, sum, accumulator) into the running ones; a split without a key
    (max -inf) leaves them untouched. The one fold of both paths."""
    take = ms > float("-inf")
    m_new = tl.maximum(m_i, ms)
    m_use = tl.where(take, m_new, 0.0)  # no -inf - -inf where the result is not taken
    old, new = tl.exp(m_i - m_use), tl.exp(ms - m_use)
    return (
        tl.where(take, m_new, m_i),
        tl.where(take, l_i * old + ls * new, l_i),
        tl.where(take[:, None], acc * old[:, None] + a_s * new[:, None], acc),
    )


@jit
def _finish(m_i, l_i, acc, sink):
    """The output rows: the sink logit joins the denominator; a row without a key gets zeros."""
    top = tl.maximum(m_i, sink)
    keep = tl.exp(m_i - top)
    return acc * (keep / (l_i * keep + tl.exp(sink - top)))[:, None]


@jit
def _split_range(split, W, E, WINDOW_SPLITS, SPLIT: constexpr):
    """Split `split` of a token's keys: (is it in the entry list, its first and end index)."""
    in_entries = split >= WINDOW_SPLITS
    lo = tl.where(in_entries, (split - WINDOW_SPLITS) * SPLIT, split * SPLIT)
    hi = tl.minimum(lo + SPLIT, tl.where(in_entries, E, W))
    return in_entries, lo, hi


@jit
def _walk_token_split(
    q, t, split, wkv_ptr, ws_ptr, ekv_ptr, es_ptr, s_wt, s_et, s_wkv, s_wkd, s_ekv, s_ekd,
    scale, D, W, E, WINDOW_SPLITS,
    SPLIT: constexpr, BLOCK_H: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr,
    PRECISION: constexpr, SKIP_EMPTY: constexpr,
):  # fmt: skip
    in_entries, lo, hi = _split_range(split, W, E, WINDOW_SPLITS, SPLIT)
    if in_entries:
        m_i, l_i, acc = _walk_split(
            q, ekv_ptr, es_ptr + t * s_et, lo, hi, s_ekv, s_ekd, scale, D,
            BLOCK_H, BLOCK_N, BLOCK_D, PRECISION, SKIP_EMPTY,
        )  # fmt: skip
    else:
        m_i, l_i, acc = _walk_split(
            q, wkv_ptr, ws_ptr + t * s_wt, lo, hi, s_wkv, s_wkd, scale, D,
            BLOCK_H, BLOCK_N, BLOCK_D, PRECISION, SKIP_EMPTY,
        )  # fmt: skip
    return m_i, l_i, acc


@jit
def _load_q(q_ptr, t, heads, head_ok, s_qt, s_qh, s_qd, D, BLOCK_D: constexpr):
    d = tl.arange(0, BLOCK_D)
    ptrs = q_ptr + t * s_qt + heads[:, None] * s_qh + d[None, :] * s_qd
    return tl.load(ptrs, mask=head_ok[:, None] & (d[None, :] < D), other=0.0)


@jit
def _fold_kernel(
    q_ptr, wkv_ptr, ws_ptr, ekv_ptr, es_ptr, sinks_ptr, o_ptr,
    s_qt, s_qh, s_qd, s_wt, s_et, s_wkv, s_wkd, s_ekv, s_ekd, s_ot, s_oh, s_od,
    scale, H, D, W, E, WINDOW_SPLITS, SPLITS,
    SPLIT: constexpr, BLOCK_H: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr,
    PRECISION: constexpr, SKIP_EMPTY: constexpr,
):  # fmt: skip
    """One token, one head block: every split walked and folded in order, in registers."""
    t, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    q = _load_q(q_ptr, t, heads, head_ok, s_qt, s_qh, s_qd, D, BLOCK_D)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for split in range(0, SPLITS):
        ms, ls, a_s = _walk_token_split(
            q, t, split, wkv_ptr, ws_ptr, ekv_ptr, es_ptr, s_wt, s_et, s_wkv, s_wkd, s_ekv,
            s_ekd, scale, D, W, E, WINDOW_SPLITS, SPLIT, BLOCK_H, BLOCK_N, BLOCK_D, PRECISION,
            SKIP_EMPTY,
        )  # fmt: skip
        m_i, l_i, acc = _merge_split(m_i, l_i, acc, ms, ls, a_s)
    sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0)
    d = tl.arange(0, BLOCK_D)
    out = o_ptr + t * s_ot + heads[:, None] * s_oh + d[None, :] * s_od
    val = _finish(m_i, l_i, acc, sink)
    tl.store(out, val.to(o_ptr.dtype.element_ty), mask=head_ok[:, None] & (d[None, :] < D))


@jit
def _split_kernel(
    q_ptr, wkv_ptr, ws_ptr, ekv_ptr, es_ptr, pm_ptr, pl_ptr, pacc_ptr,
    s_qt, s_qh, s_qd, s_wt, s_et, s_wkv, s_wkd, s_ekv, s_ekd,
    scale, H, D, W, E, WINDOW_SPLITS, SPLITS,
    SPLIT: constexpr, BLOCK_H: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr,
    PRECISION: constexpr, SKIP_EMPTY: constexpr,
):  # fmt: skip
    """One token, one head block, one split: its partials (written even when the split has no
    key, as (-inf, 0, 0), which the fold skips)."""
    t, hb, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    q = _load_q(q_ptr, t, heads, head_ok, s_qt, s_qh, s_qd, D, BLOCK_D)
    m_i, l_i, acc = _walk_token_split(
        q, t, split, wkv_ptr, ws_ptr, ekv_ptr, es_ptr, s_wt, s_et, s_wkv, s_wkd, s_ekv,
        s_ekd, scale, D, W, E, WINDOW_SPLITS, SPLIT, BLOCK_H, BLOCK_N, BLOCK_D, PRECISION,
        SKIP_EMPTY,
    )  # fmt: skip
    part = (t * H + heads) * SPLITS + split  # partials [T, H, SPLITS] and [T, H, SPLITS, D]
    tl.store(pm_ptr + part, m_i, mask=head_ok)
    tl.store(pl_ptr + part, l_i, mask=head_ok)
    d = tl.arange(0, BLOCK_D)
    pacc = pacc_ptr + part[:, None] * D + d[None, :]
    tl.store(pacc, acc, mask=head_ok[:, None] & (d[None, :] < D))


@jit
def _combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, sinks_ptr, o_ptr, s_ot, s_oh, s_od, H, D, SPLITS,
    BLOCK_D: constexpr,
):  # fmt: skip
    """Folds the partials of one (token, head) in split order: a tile of one row, so the fold
    and the finish are the register path's own."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    one = tl.arange(0, 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = (one[:, None] >= 0) & (d[None, :] < D)
    base = (t * H + h) * SPLITS + one
    m_i = tl.full((1,), float("-inf"), tl.float32)
    l_i = tl.zeros((1,), tl.float32)
    acc = tl.zeros((1, BLOCK_D), tl.float32)
    for s in range(0, SPLITS):
        ms = tl.load(pm_ptr + base + s)
        ls = tl.load(pl_ptr + base + s)
        a_s = tl.load(pacc_ptr + (base + s)[:, None] * D + d[None, :], mask=d_ok, other=0.0)
        m_i, l_i, acc = _merge_split(m_i, l_i, acc, ms, ls, a_s)
    sink = tl.load(sinks_ptr + h + one)
    val = _finish(m_i, l_i, acc, sink)
    out = o_ptr + (t * s_ot + h * s_oh + one)[:, None] + d[None, :] * s_od  # one is 0
    tl.store(out, val.to(o_ptr.dtype.element_ty), mask=d_ok)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` with unit stride along its last dim (the kernels step through a row by 1)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def attention_launch(
    dim: int, dtype: torch.dtype, block_h: int, skip_empty: bool, split: int = SPLIT
) -> dict:
    """The tile constants and launch options of the attention kernels for head size `dim`:
    the 512-wide latent takes 32-key tiles and 8 warps (its [16, 512] float32 accumulator and
    the key tile fit the registers and shared memory; 64-key tiles spill)."""
    wide = dim > 256
    return dict(
        SPLIT=split, BLOCK_H=block_h, BLOCK_N=32 if wide else 64,
        BLOCK_D=max(16, next_power_of_2(dim)),
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        SKIP_EMPTY=skip_empty, num_warps=8 if wide else 4, num_stages=2,
    )  # fmt: skip


def sparse_attention(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_slots: torch.Tensor,
    entry_kv: torch.Tensor | None,
    entry_slots: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    block_h: int = BLOCK_H,
    split_programs_max: int = SPLIT_PROGRAMS_MAX,
    skip_empty: bool = True,
    split: int = SPLIT,
) -> torch.Tensor:
    """`[T, H, D]`: each head of q[t] over the keys window_kv[window_slots[t]] then
    entry_kv[entry_slots[t]] (-1 = no key; K = V), with the per-head sink logit `sinks [H]` in
    the denominator; float32 scores and softmax, the output in q's dtype (V4SPEC.md, op 1).
    `split_programs_max` (the largest grid given one program per split) changes the launch, not
    the bits; `block_h` (heads per program), `skip_empty` (branch around key tiles of -1
    only) and `split` (keys per split: where the folds fall) are tuning knobs: a set keeps one
    value of each."""
    tokens, heads, dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    if entry_kv is None or entry_slots is None:
        entry_kv, entry_slots = window_kv, window_slots[:, :0]
    window_slots, entry_slots = _rows_contiguous(window_slots), _rows_contiguous(entry_slots)
    window, entries = window_slots.shape[1], entry_slots.shape[1]
    window_splits = cdiv(window, split)
    splits = window_splits + cdiv(entries, split)
    head_blocks = cdiv(heads, block_h)
    consts = attention_launch(dim, q.dtype, block_h, skip_empty, split)
    common = (
        *q.stride(), window_slots.stride(0), entry_slots.stride(0), *window_kv.stride(),
        *entry_kv.stride(),
    )  # fmt: skip
    shape = (scale, heads, dim, window, entries, window_splits, splits)
    sinks = sinks.float()
    if tokens * head_blocks > split_programs_max or splits == 0:
        _fold_kernel[(tokens, head_blocks)](
            q, window_kv, window_slots, entry_kv, entry_slots, sinks, out, *common,
            *out.stride(), *shape, **consts,
        )  # fmt: skip
        return out
    part_m = torch.empty(tokens, heads, splits, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(tokens, heads, splits, dim, device=q.device, dtype=torch.float32)
    _split_kernel[(tokens, head_blocks, splits)](
        q, window_kv, window_slots, entry_kv, entry_slots, part_m, part_l, part_acc, *common,
        *shape, **consts,
    )  # fmt: skip
    _combine_kernel[(tokens, heads)](
        part_m, part_l, part_acc, sinks, out, *out.stride(), heads, dim, splits,
        BLOCK_D=consts["BLOCK_D"], num_warps=4,
    )  # fmt: skip
    return out


# ---- indexer_topk ----------------------------------------------------------------------------


@jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, slots_ptr, seq_ptr, visible_ptr, out_ptr,
    s_qt, s_qh, s_qd, s_wt, s_wh, s_kn, s_kd, s_ss, s_sg, s_ot,
    scale, HI, DI, G,
    BLOCK_HI: constexpr, BLOCK_DI: constexpr, BLOCK_G: constexpr, PRECISION: constexpr,
):  # fmt: skip
    """Scores of one token over one block of its sequence's entries: relu(q . key) * scale,
    times the head's weight, summed over the heads; -inf at and past `visible[t]` (a block that
    starts there stores -inf without reading a key, so a short sequence costs little)."""
    t, gb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    j = gb * BLOCK_G + tl.arange(0, BLOCK_G)
    visible = tl.load(visible_ptr + t)
    out = out_ptr + t * s_ot + j
    if gb * BLOCK_G >= visible:
        tl.store(out, tl.full((BLOCK_G,), float("-inf"), tl.float32), mask=j < G)
        return
    seen = (j < visible) & (j < G)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + seq * s_ss + j * s_sg, mask=seen, other=-1)
    key_ok = seen & (slot >= 0)
    h = tl.arange(0, BLOCK_HI)
    d = tl.arange(0, BLOCK_DI)
    q = tl.load(
        q_ptr + t * s_qt + h[:, None] * s_qh + d[None, :] * s_qd,
        mask=(h[:, None] < HI) & (d[None, :] < DI),
        other=0.0,
    )
    rows = tl.where(key_ok, slot, 0).to(tl.int64) * s_kn
    keys = tl.load(
        keys_ptr + rows[:, None] + d[None, :] * s_kd,
        mask=key_ok[:, None] & (d[None, :] < DI),
        other=0.0,
    )
    dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [BLOCK_HI, BLOCK_G]
    weights = tl.load(w_ptr + t * s_wt + h * s_wh, mask=h < HI, other=0.0)
    scores = tl.sum(tl.maximum(dots, 0.0) * scale * weights[:, None], axis=0)
    tl.store(out, tl.where(seen, scores, float("-inf")), mask=j < G)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    entry_slots: torch.Tensor,
    token_seq: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    block_g: int = 64,
) -> torch.Tensor:
    """`[T, G]` float32: score[t, j] = sum_h weights[t, h] * relu(q[t, h] . keys[slot]) * scale
    over entry j of token t's sequence (slot = entry_slots[token_seq[t], j]), -inf where
    j >= visible[t]. The head sum is one reduction tree of the kernel's, whatever the batch."""
    tokens, heads, dim = q.shape
    entries = entry_slots.shape[1]
    out = torch.empty(tokens, entries, device=q.device, dtype=torch.float32)
    if tokens == 0 or entries == 0:
        return out
    _indexer_scores_kernel[(tokens, cdiv(entries, block_g))](
        q, weights, keys, entry_slots, token_seq, visible, out,
        *q.stride(), *weights.stride(), *keys.stride(), *entry_slots.stride(), out.stride(0),
        scale, heads, dim, entries,
        BLOCK_HI=max(16, next_power_of_2(heads)), BLOCK_DI=max(16, next_power_of_2(dim)),
        BLOCK_G=block_g, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


LOW_32 = (1 << 32) - 1


def topk_ascending(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """`[T, min(k, G)]` int64: the entries of the k highest scores (ties to the lower index),
    sorted ascending, -1 at the end of a row past its `visible` count. Each score's float32
    bits are made monotone as an int32 and packed above the reversed index into one int64, so
    every key is unique and any topk or sort returns the same set in the same order."""
    tokens, entries = scores.shape
    k = min(k, entries)
    if k == 0:
        return torch.empty(tokens, 0, dtype=torch.long, device=scores.device)
    bits = (scores + 0.0).view(torch.int32)  # + 0.0: -0.0 and 0.0 are one score
    monotone = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    index = torch.arange(entries, device=scores.device, dtype=torch.int64)
    packed = (monotone << 32) | (LOW_32 - index)
    top = LOW_32 - (packed.topk(k, dim=1).values & LOW_32)
    ranks = torch.arange(k, device=scores.device)
    chosen = torch.where(ranks[None, :] < visible[:, None], top, entries)  # entries: past the end
    chosen = chosen.sort(dim=1).values
    return chosen.masked_fill(chosen == entries, -1)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    entry_slots: torch.Tensor,
    token_seq: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    scale: float,
) -> torch.Tensor:
    """The lightning indexer's choice for every token of a step (V4SPEC.md, op 2): the top-k
    entries of `indexer_scores`, ascending, -1 padded at the end."""
    scores = indexer_scores(q, weights, keys, entry_slots, token_seq, visible, scale)
    return topk.topk_ascending(scores, visible, k)


# ---- compress_pool ---------------------------------------------------------------------------


@jit
def _pool_candidates(
    rows_ptr, slots, row_ok, ape_ptr, kv_col, gate_col, ape_col, c, c_ok, s_rn, s_ad,
    BLOCK_R: constexpr,
):  # fmt: skip
    """kv and gate (+ ape) of `[R]` candidate rows at columns `c`, float32; gate -inf where a
    candidate row does not take part."""
    r = tl.arange(0, BLOCK_R)
    base = tl.where(row_ok, slots, 0).to(tl.int64) * s_rn
    ok = row_ok[:, None] & c_ok[None, :]
    kv = tl.load(rows_ptr + base[:, None] + kv_col + c[None, :], mask=ok, other=0.0)
    gate = tl.load(rows_ptr + base[:, None] + gate_col + c[None, :], mask=ok, other=0.0)
    ape = tl.load(ape_ptr + r[:, None] * s_ad + ape_col + c[None, :], mask=ok, other=0.0)
    gate = tl.where(row_ok[:, None], gate.to(tl.float32) + ape, float("-inf"))
    return kv.to(tl.float32), gate


@jit
def _compress_pool_kernel(
    rows_ptr, tokens_ptr, prev_ptr, has_prev_ptr, ape_ptr, out_ptr,
    s_rn, s_tg, s_tr, s_pg, s_pr, s_ar, s_og,
    kv_col, gate_col, RATIO, DIM,
    SERIES: constexpr, BLOCK_R: constexpr, BLOCK_C: constexpr,
):  # fmt: skip
    """One group, one block of columns: the softmax over the candidates' gates (+ ape) per
    column and the weighted sum of their kv, in float32 (two passes over one register tile)."""
    g, cb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < DIM
    r = tl.arange(0, BLOCK_R)
    own = tl.load(tokens_ptr + g * s_tg + r * s_tr, mask=r < RATIO, other=0)
    if SERIES == 1:
        kv, gate = _pool_candidates(
            rows_ptr, own, r < RATIO, ape_ptr, kv_col, gate_col, 0, c, c_ok, s_rn, s_ar, BLOCK_R,
        )  # fmt: skip
        top = tl.max(gate, axis=0)
        p = tl.exp(gate - top[None, :])
        pooled = tl.sum(p * kv, axis=0) / tl.sum(p, axis=0)
    else:  # CSA: the previous group's first `DIM` columns, then the group's own second ones
        prev_ok = r < RATIO * tl.load(has_prev_ptr + g).to(tl.int32)  # none without a previous
        prev = tl.load(prev_ptr + g * s_pg + r * s_pr, mask=prev_ok, other=0)
        kv_a, gate_a = _pool_candidates(
            rows_ptr, prev, prev_ok, ape_ptr, kv_col, gate_col, 0, c, c_ok,
            s_rn, s_ar, BLOCK_R,
        )  # fmt: skip
        kv_b, gate_b = _pool_candidates(
            rows_ptr, own, r < RATIO, ape_ptr, kv_col + DIM, gate_col + DIM, DIM, c, c_ok,
            s_rn, s_ar, BLOCK_R,
        )  # fmt: skip
        top = tl.maximum(tl.max(gate_a, axis=0), tl.max(gate_b, axis=0))
        p_a = tl.exp(gate_a - top[None, :])
        p_b = tl.exp(gate_b - top[None, :])
        total = tl.sum(p_a, axis=0) + tl.sum(p_b, axis=0)
        pooled = (tl.sum(p_a * kv_a, axis=0) + tl.sum(p_b * kv_b, axis=0)) / total
    tl.store(out_ptr + g * s_og + c, pooled, mask=c_ok)


def pool_tiles(ratio: int, dim: int) -> tuple[int, int]:
    """(candidate rows, columns) of a pool program's tile: at most 4,096 float32 per tensor."""
    block_r = max(2, next_power_of_2(ratio))
    return block_r, max(16, min(128, 4096 // block_r, next_power_of_2(dim)))


def compress_pool(
    rows: torch.Tensor,
    tokens: torch.Tensor,
    previous: torch.Tensor,
    has_previous: torch.Tensor,
    ape: torch.Tensor,
    kv_cols: slice,
    gate_cols: slice,
    dim: int,
    series: int,
) -> torch.Tensor:
    """`[G, dim]` float32: each group's gated pool of its tokens' kv columns (V4SPEC.md, op 3;
    series 2 also pools the previous group's first `dim` columns, before its own)."""
    groups, ratio = tokens.shape
    out = torch.empty(groups, dim, device=rows.device, dtype=torch.float32)
    if groups == 0:
        return out
    assert rows.stride(1) == 1 and ape.stride(1) == 1, "column-contiguous rows and ape"
    kv_col, _, kv_step = kv_cols.indices(rows.shape[1])
    gate_col, _, gate_step = gate_cols.indices(rows.shape[1])
    assert kv_step == gate_step == 1, "contiguous column slices"
    block_r, block_c = pool_tiles(ratio, dim)
    _compress_pool_kernel[(groups, cdiv(dim, block_c))](
        rows, tokens, previous, has_previous.view(torch.uint8), ape, out,
        rows.stride(0), *tokens.stride(), *previous.stride(), ape.stride(0), out.stride(0),
        kv_col, gate_col, ratio, dim,
        SERIES=series, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out
