"""Top-k selection returned as ascending index lists, in one launch per call (DeepSeek-V4's
lightning indexer: each token attends to the k best-scored compressed entries, read in entry
order).

One program per row. Scores become monotone 32-bit keys (the float32 bits with the negative
ones' magnitude bits flipped, -0.0 folded into 0.0), so the k-th largest key is found by a radix
select from the top byte down: four 256-bin histogram passes over the row, no sort. The row's entries are
then walked in index order once, keeping every key above that threshold and, of the keys equal
to it, the lowest indices first: the chosen set is torch's `topk` on (key, reversed index), and
the output is already ascending, with -1 padding past the row's `visible` count. The result of a
row depends on that row alone (batch invariant), and the launch reads no length on the host (CUDA
graph capturable).

Where the choice is the whole row (visible <= k, every decode step of a short context) the
passes are skipped. What does not live here: the scores (sparse_attention.py's indexer) and
the torch twin (sparse_attention.topk_ascending, which the tests compare with).
"""

from __future__ import annotations

import torch

from deepserve.kernels.triton.lang import constexpr, jit, tl

BLOCK = 1024  # entries per pass step of a program
DIGITS = constexpr(256)  # a radix select pass decides 8 bits of the threshold


@jit
def _keys(score_row, idx, ok):
    """Unsigned monotone keys in int64 ([0, 2^32)) of the row's scores at `idx`; 0 where not ok
    (below every real key: those entries are never chosen ahead of a real one, see the count)."""
    s = tl.load(score_row + idx, mask=ok, other=0.0) + 0.0
    bits = s.to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(ok, mono.to(tl.int64) + 2147483648, -1)


@jit
def _threshold(score_row, n, take, BLOCK: constexpr):
    """(the take-th largest key of the row's first n, how many keys equal to it are taken):
    a radix select on 8-bit digits from the top, one 256-bin histogram pass per digit over the
    keys that share the digits chosen so far."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 2 * DIGITS)
    prefix = tl.zeros((), tl.int64)
    need = take  # keys still to take at or below the prefix
    for p in range(4):
        shift = 24 - 8 * p
        hist = tl.zeros((2 * DIGITS,), tl.int32)
        for b0 in range(0, n, BLOCK):
            idx = b0 + offs
            key = _keys(score_row, idx, idx < n)
            # keys outside the prefix (and masked ones, -1) land in the upper, unused half
            same = (key >> (shift + 8)) == (prefix >> (shift + 8))
            digit = tl.where(same & (key >= 0), (key >> shift) & (DIGITS - 1), DIGITS)
            hist += tl.histogram(digit.to(tl.int32), 2 * DIGITS)
        hist = tl.where(bins < DIGITS, hist, 0)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # keys with digit >= bin
        chosen = tl.sum((at_or_above >= need) & (bins < DIGITS)).to(tl.int64) - 1
        above = tl.sum(tl.where(bins > chosen, hist, 0))
        need -= above
        prefix |= chosen << shift
    return prefix, need


@jit
def _topk_ascending_kernel(
    scores_ptr, visible_ptr, ids_ptr, entries, s_row, s_out, k, width, BLOCK: constexpr
):
    row = tl.program_id(0).to(tl.int64)
    score_row = scores_ptr + row * s_row
    out_row = ids_ptr + row * s_out
    n = tl.minimum(tl.load(visible_ptr + row).to(tl.int32), entries)
    take = tl.minimum(n, k)
    offs = tl.arange(0, BLOCK)
    threshold = tl.zeros((), tl.int64) - 1  # every visible key is above it: take them all
    ties = tl.zeros((), tl.int32)
    if take < n:
        threshold, ties = _threshold(score_row, n, take, BLOCK)
    written = tl.zeros((), tl.int32)
    tied = tl.zeros((), tl.int32)
    for b0 in range(0, n, BLOCK):
        idx = b0 + offs
        ok = idx < n
        key = _keys(score_row, idx, ok)
        equal = (key == threshold) & ok
        tie_rank = tied + tl.cumsum(equal.to(tl.int32), 0) - equal.to(tl.int32)
        chosen = ok & ((key > threshold) | (equal & (tie_rank < ties)))
        pos = written + tl.cumsum(chosen.to(tl.int32), 0) - chosen.to(tl.int32)
        tl.store(out_row + pos, idx.to(tl.int64), mask=chosen)
        written += tl.sum(chosen.to(tl.int32))
        tied += tl.sum(equal.to(tl.int32))
    for p0 in range(0, width, BLOCK):
        pos = p0 + offs
        tl.store(out_row + pos, tl.full((BLOCK,), -1, tl.int64), mask=(pos >= take) & (pos < width))


def topk_ascending(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """`[T, min(k, G)]` int64 from `[T, G]` float32 scores: per row the entries of the
    min(k, visible) highest scores among its first `visible` (ties to the lower index), in
    ascending order, then -1."""
    tokens, entries = scores.shape
    width = min(k, entries)
    out = torch.empty(tokens, width, dtype=torch.long, device=scores.device)
    if tokens == 0 or width == 0:
        return out
    scores = scores.contiguous()
    _topk_ascending_kernel[(tokens,)](
        scores, visible, out, entries, scores.stride(0), out.stride(0), k, width,
        BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    return out
