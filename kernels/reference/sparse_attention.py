"""DeepSeek-V4's attention ops in torch over slot lists of the flattened paged cache: the contract
(kernels/kernel_set.py names the fields) and the oracle of the invariant and Triton versions.

Every op takes row ids ("slots") into `[N, width]` views of the cache (`cache.view(-1, width)`,
or its columns `[:, cols]`: stride(0) = width, stride(1) = 1), built on the device by the model,
so one call covers a whole step of any mix of sequences without a host loop, a boolean `[T, L]`
mask or a host sync; -1 in a slot list means "no key". Every shape is a host value (exact in an
eager step, an upper bound inside a CUDA graph's capture), every choice a device tensor.

`sparse_attention(q, window_kv, window_slots, entry_kv, entry_slots, sinks, scale)`: multi-query
attention of `q [T, H, D]` over one shared K=V head: token t's keys are `window_kv[window_slots[t]]`
(`[T, W]`) then `entry_kv[entry_slots[t]]` (`[T, E]`, or None), in that order. Each head has a sink
logit `sinks [H]` (float32) that joins the softmax's denominator but brings no value. Scores and
softmax in float32; returns `[T, H, D]` in q's dtype; a query with no key gets zeros. A row's
result depends only on its q, its slot lists and the keys' values.

`indexer_topk(q, weights, keys, entry_slots, token_seq, visible, k, scale)`: the lightning
indexer's choice. `entry_slots [S, G]` holds each sequence's entry rows (past a sequence's count
anything: `visible` masks it); token t scores entry j of its sequence
(`keys[entry_slots[token_seq[t], j]]`) as `sum_h weights[t, h] * relu(q[t, h] . key) * scale`
over its first `visible[t]` entries, heads summed in order, float32; keeps the best
`k' = min(k, G)` (ties to the lower j) and returns them sorted ascending by j (so the attention's
key order depends only on the chosen set), `[T, k']` int64, -1 padded at the end.

`compress_pool(rows, tokens, previous, has_previous, ape, kv_cols, gate_cols, dim, series)`: the
compressors' gated pooling of a group's `ratio` tokens into one entry (before its norm and rope),
`[G, dim]` float32; one group's result never depends on G.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 256  # query rows per pass at most
GATHER_BUDGET = 1 << 22  # gathered key elements per pass (16 MiB in float32): long prompts' bound


def row_blocks(rows: int, per_row: int) -> list[slice]:
    """Query rows in passes that gather at most GATHER_BUDGET key elements (`per_row` each),
    QUERY_BLOCK rows at most, one row at least (query rows are independent)."""
    step = max(1, min(QUERY_BLOCK, GATHER_BUDGET // max(per_row, 1)))
    return [slice(start, start + step) for start in range(0, rows, step)]


def key_width(window_slots: torch.Tensor, entry_slots: torch.Tensor | None) -> int:
    """Keys per query row: the window's and the entries' slots."""
    return window_slots.shape[1] + (0 if entry_slots is None else entry_slots.shape[1])


def gather_rows(view: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`view[slots]` in float32 with -1 slots read as row 0, and the `slots >= 0` mask."""
    valid = slots >= 0
    return view[slots.clamp(min=0)].float(), valid


def sparse_attention(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_slots: torch.Tensor,
    entry_kv: torch.Tensor | None,
    entry_slots: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for rows in row_blocks(q.shape[0], key_width(window_slots, entry_slots) * q.shape[-1]):
        entries = None if entry_slots is None else entry_slots[rows]
        keys, valid = gather_keys(window_kv, window_slots[rows], entry_kv, entries)
        out[rows] = _attend(q[rows].float(), keys, valid, sinks.float(), scale).to(q.dtype)
    return out


def gather_keys(
    window_kv: torch.Tensor,
    window_slots: torch.Tensor,
    entry_kv: torch.Tensor | None,
    entry_slots: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys `[t, W + E, D]` float32 of some query rows (window first) and their validity."""
    keys, valid = gather_rows(window_kv, window_slots)
    if entry_kv is not None and entry_slots is not None and entry_slots.shape[1] > 0:
        entries, seen = gather_rows(entry_kv, entry_slots)
        keys, valid = torch.cat([keys, entries], dim=1), torch.cat([valid, seen], dim=1)
    return keys, valid


def _attend(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale  # [t, H, L]
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    sink = sinks[None, :, None].expand(q.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs, keys)  # [t, H, D]


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
    entries = entry_slots.shape[1]
    k = min(k, entries)
    out = torch.empty(q.shape[0], k, dtype=torch.long, device=q.device)
    if k == 0:
        return out
    for rows in row_blocks(q.shape[0], entries * max(keys.shape[1], q.shape[1])):
        key_rows, _ = gather_rows(keys, entry_slots[token_seq[rows]])  # [t, G, Di]
        dots = torch.relu(torch.matmul(q[rows].float(), key_rows.transpose(1, 2))) * scale
        scores = (dots * weights[rows].float()[..., None]).sum(dim=1)  # [t, G]
        out[rows] = choose(scores, visible[rows], k)
    return out


def choose(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` best of each row's first `visible` scores (ties to the lower index), sorted
    ascending by index, -1 padded at the end. A stable sort keeps the lower index first among
    equal scores on every device, so the choice never depends on the kernel or the batch."""
    ids = torch.arange(scores.shape[1], device=scores.device)
    scores = scores.masked_fill(ids[None, :] >= visible[:, None], float("-inf"))
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    ranks = torch.arange(k, device=scores.device)
    # entries past a row's visible count sort last as `entries`, then read -1
    best = best.masked_fill(ranks[None, :] >= visible[:, None], scores.shape[1])
    best = torch.sort(best, dim=-1).values
    return best.masked_fill(best == scores.shape[1], -1)


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
    """`[G, dim]` float32: each group's tokens' kv columns weighted by the softmax (over the
    group's tokens, per column) of their gate columns plus the position-in-group bias `ape`.
    CSA (series 2) pools group g-1's first series (gate -inf without a group before) and group
    g's second over 2 * ratio candidates, previous first."""
    kv_rows, gate_rows = rows[:, kv_cols], rows[:, gate_cols]  # gather these columns only
    kv, gate = kv_rows[tokens].float(), gate_rows[tokens].float() + ape  # [G, ratio, s * dim]
    if series == 2:
        first = slice(0, dim)
        prev_gate = gate_rows[:, first][previous].float() + ape[:, first]
        prev_gate = prev_gate.masked_fill(~has_previous[:, None, None], float("-inf"))
        kv = torch.cat([kv_rows[:, first][previous].float(), kv[..., dim:]], dim=1)
        gate = torch.cat([prev_gate, gate[..., dim:]], dim=1)
    return (kv * torch.softmax(gate, 1)).sum(dim=1)
