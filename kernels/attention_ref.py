"""Reference paged attention over one flattened, variable-length batch, plus the KV-cache write.

`paged_attention(q, k_cache, v_cache, attn, scale)`:
- q `[T, Hq, Dk]`: the step's query rows; sequence i owns rows
  `query_start_loc[i]:query_start_loc[i+1]`, at positions `context_lens[i] .. seq_lens[i]-1`.
- k_cache `[num_blocks, block_size, Hkv, Dk]`, v_cache `[num_blocks, block_size, Hkv, Dv]`: one
  layer's paged cache (views into the engine's cache tensor), already holding this step's KV.
- Hq is a multiple of Hkv (GQA; MLA's absorbed decode is Hkv = 1 with Dv < Dk, and v_cache may be a
  prefix view of k_cache's latent, which we detect to gather it once).
- returns `[T, Hq, Dv]` in q's dtype; scores and softmax in float32.

Two paths, both exact for what they cover: a vectorized one when every sequence brings one query
(pure decode: block tables gathered into a padded `[B, L]` KV view and masked), and a per-sequence
loop for any other composition (prefill chunks mixed with decodes).
"""

from __future__ import annotations

import torch

from deepserve.engine.attention import AttentionMetadata


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store `values[T, ...]` at flat slots `slot_mapping[T]` of `cache[num_blocks, block_size, ...]`."""
    cache.view(-1, *cache.shape[2:])[slot_mapping] = values.to(cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    if attn.num_tokens == attn.num_seqs:
        return _decode_attention(q, k_cache, v_cache, attn, scale)
    return _varlen_attention(q, k_cache, v_cache, attn, scale)


def _shares_latent(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when v_cache is a leading slice of k_cache's last dim (MLA latent), so one gather serves both."""
    return (
        v_cache.data_ptr() == k_cache.data_ptr()
        and v_cache.shape[:-1] == k_cache.shape[:-1]
        and v_cache.stride() == k_cache.stride()
    )


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Blocks `[..., nb]` of a paged cache -> contiguous KV `[..., length, H, D]`."""
    kv = cache[blocks]  # [..., nb, block_size, H, D]
    return kv.flatten(-4, -3)[..., :length, :, :]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hkv, G*n, Dk], k [B, Hkv, L, Dk], v [B, Hkv, L, Dv], mask broadcastable to scores
    (True = attend) -> [B, Hkv, G*n, Dv]."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    batch, hq, dk = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    max_len = max(attn.seq_lens_cpu)
    nblocks = -(-max_len // attn.block_size)
    blocks = attn.block_tables[:, :nblocks].long()
    k = _gather(k_cache, blocks, max_len).transpose(1, 2)  # [B, Hkv, L, Dk]
    if _shares_latent(k_cache, v_cache):
        v = k[..., :dv]
    else:
        v = _gather(v_cache, blocks, max_len).transpose(1, 2)  # [B, Hkv, L, Dv]
    positions = torch.arange(max_len, device=q.device)
    mask = (positions[None, :] < attn.seq_lens[:, None]).view(batch, 1, 1, max_len)
    qg = q.view(batch, hkv, hq // hkv, dk)
    out = _attend(qg, k, v, mask, scale)  # [B, Hkv, G, Dv]
    return out.reshape(batch, hq, dv).to(q.dtype)


def _varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    hq, hkv, dv = q.shape[1], k_cache.shape[2], v_cache.shape[-1]
    group = hq // hkv
    shared = _shares_latent(k_cache, v_cache)
    out = q.new_empty(q.shape[0], hq, dv)
    start = 0
    for i, n in enumerate(attn.query_lens_cpu):
        if n == 0:
            continue
        length, ctx = attn.seq_lens_cpu[i], attn.context_lens_cpu[i]
        blocks = attn.block_tables[i, : -(-length // attn.block_size)].long()
        k = _gather(k_cache, blocks, length).transpose(0, 1)  # [Hkv, L, Dk]
        v = k[..., :dv] if shared else _gather(v_cache, blocks, length).transpose(0, 1)
        # rows ordered (group, query) per kv head so GQA needs no KV copy
        qi = (
            q[start : start + n]
            .view(n, hkv, group, -1)
            .permute(1, 2, 0, 3)
            .reshape(hkv, group * n, -1)
        )
        rows = torch.arange(n, device=q.device).repeat(group) + ctx
        mask = torch.arange(length, device=q.device)[None, :] <= rows[:, None]
        o = _attend(qi, k, v, mask, scale)  # [Hkv, G*n, Dv]
        out[start : start + n] = o.view(hkv, group, n, dv).permute(2, 0, 1, 3).reshape(n, hq, dv)
        start += n
    return out
