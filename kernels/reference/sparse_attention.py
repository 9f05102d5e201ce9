"""DeepSeek-V4's attention ops in torch, on one sequence's gathered keys: the oracle of the native
and GPU kernels to come.

`sink_attention(q, kv, visible, sinks, scale)`: multi-query attention of `q [T, H, D]` over one
shared K=V head `kv [L, D]`, where `visible [T, L]` (bool) says which keys each query sees (its
sliding window and the compressed entries chosen for it), and each head has a learned sink logit
`sinks [H]` that joins the softmax's denominator but brings no value. Scores and softmax in
float32; returns `[T, H, D]` in q's dtype. A query that sees no key gets zeros.

`indexer_topk(q, weights, keys, visible, k, scale)`: the lightning indexer's choice. Query t
scores compressed entry g as `sum_h weights[t, h] * relu(q[t, h] . keys[g]) * scale` over its
first `visible[t]` entries (the ones complete before it) and keeps the best `k`, best first; ties
go to the lower entry index, so the choice never depends on the kernel or the batch. Returns
`[T, min(k, G)]` int64 entry ids, -1 where a query sees fewer than k entries.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 512  # query rows per pass: bounds the [H, rows, L] score tensor of long prompts


def sink_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    keys = kv.float()
    for start in range(0, q.shape[0], QUERY_BLOCK):
        rows = slice(start, start + QUERY_BLOCK)
        out[rows] = _sink_attention_block(q[rows].float(), keys, visible[rows], sinks, scale)
    return out


def _sink_attention_block(
    q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    scores = torch.matmul(q.transpose(0, 1), kv.T) * scale  # [H, T, L]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    sink = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs, kv).transpose(0, 1)  # [T, H, D]


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    scale: float,
) -> torch.Tensor:
    entries = keys.shape[0]
    k = min(k, entries)
    if k == 0:
        return torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
    dots = torch.relu(torch.matmul(q.float(), keys.float().T)) * scale  # [T, Hi, G]
    scores = (dots * weights.float()[..., None]).sum(dim=1)  # [T, G]
    ids = torch.arange(entries, device=q.device)
    scores = scores.masked_fill(ids[None, :] >= visible[:, None], float("-inf"))
    # a stable descending sort keeps the lower index first among equal scores
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    ranks = torch.arange(k, device=q.device)
    return order.masked_fill(ranks[None, :] >= visible[:, None], -1)
