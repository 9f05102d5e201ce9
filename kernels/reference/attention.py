"""Reference paged attention over one flattened, variable-length batch, plus the KV-cache write.

`paged_attention(q, k_cache, v_cache, attn, scale)`:
- q `[T, Hq, Dk]`: the step's query rows; sequence i owns rows
  `query_start_loc[i]:query_start_loc[i+1]`, at positions `context_lens[i] .. seq_lens[i]-1`.
- k_cache `[num_blocks, block_size, Hkv, Dk]`, v_cache `[num_blocks, block_size, Hkv, Dv]`: one
  layer's paged cache (views into the engine's cache tensor), already holding this step's KV.
  The cache must be initialized memory (e.g. torch.zeros): padded slots are gathered and then
  masked, and a NaN from uninitialized memory would survive a zero attention weight.
- Hq is a multiple of Hkv (GQA; MLA's absorbed form is Hkv = 1 with Dv < Dk, and v_cache may be a
  leading slice of k_cache's latent; when K and V are column slices of one contiguous layer we
  gather whole block rows once for both).
- returns `[T, Hq, Dv]` in q's dtype; scores and softmax in float32.
- a quantized (e4m3) cache is widened to q's dtype as its blocks are gathered; its scales are the
  caller's (kernels/kv_quant.py: folded into `scale` and the output).

Two paths, both exact for what they cover: a vectorized one when every sequence brings one query
(pure decode: block tables gathered into a padded `[B, L]` KV view with an additive mask, fed to
torch's fused scaled_dot_product_attention when K and V share a head size), and a
per-sequence loop for any other composition (prefill chunks mixed with decodes). Per-step values
(block ids, masks) are computed once and kept in `attn.scratch` for the other layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepserve.kernels import kv_quant
from deepserve.kernels.attention_metadata import AttentionMetadata


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store `values[T, ...]` at flat slots `slot_mapping[T]` of `cache[num_blocks, block_size, ...]`
    (saturated to e4m3 when the cache is; a scale is the caller's, divided out before)."""
    flat = kv_quant.byte_view(cache.view(-1, *cache.shape[2:]))
    flat.index_copy_(0, slot_mapping, kv_quant.byte_view(kv_quant.quantize(values, cache.dtype)))


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


def _shared_rows(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """When K and V are column slices of one contiguous `[num_blocks, block_size, W]` layer (llama's
    `[K | V]` layout, or MLA where V is the latent prefix of K), return that layer as block rows
    `[num_blocks, block_size * W]` plus V's column offset: one gather of whole contiguous rows then
    serves both, much faster than gathering two strided views."""
    width = k_cache.stride(1)
    bs = k_cache.shape[1]
    offset = v_cache.storage_offset() - k_cache.storage_offset()
    dense = all(
        c.stride(3) == 1 and (c.shape[2] == 1 or c.stride(2) == c.shape[3])
        for c in (k_cache, v_cache)
    )
    if not (
        dense
        and k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
        and k_cache.stride()[:2] == v_cache.stride()[:2] == (bs * width, width)
        and offset >= 0
        and offset + v_cache.shape[2] * v_cache.shape[3] <= width
        and k_cache.shape[2] * k_cache.shape[3] <= width
        and k_cache.shape[:2] == v_cache.shape[:2]
    ):
        return None
    rows = k_cache.as_strided((k_cache.shape[0], bs * width), (bs * width, 1))
    return rows, offset


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `[..., nb]` -> K `[..., nb * bs, Hkv, Dk]` and V `[..., nb * bs, Hkv, Dv]` (views),
    a quantized cache's widened to `dtype` (its other dtypes as they are)."""
    lead, bs = blocks.shape, k_cache.shape[1]
    length = lead[-1] * bs
    hkv, dk, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    shared = _shared_rows(k_cache, v_cache)
    flat = blocks.reshape(-1)  # index_select: ~8x faster than advanced indexing for whole rows
    if shared is None:
        k = _widen(kv_quant.index_rows(k_cache, flat), dtype).view(*lead[:-1], length, hkv, dk)
        return k, _widen(kv_quant.index_rows(v_cache, flat), dtype).view(
            *lead[:-1], length, hkv, dv
        )
    rows, offset = shared
    gathered = _widen(kv_quant.index_rows(rows, flat), dtype).view(*lead[:-1], length, -1)
    k = gathered[..., : hkv * dk].unflatten(-1, (hkv, dk))
    return k, gathered[..., offset : offset + hkv * dv].unflatten(-1, (hkv, dv))


def _widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return kv_quant.dequantize(x, dtype) if kv_quant.is_quantized(x.dtype) else x


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _decode_plan(
    attn: AttentionMetadata, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids `[B, nb]` covering the longest sequence, and an additive mask `[B, 1, 1, nb*bs]`
    (0 for a sequence's own tokens, -inf for padding)."""
    plan = attn.scratch.get("ref_decode")
    if plan is None:
        nblocks = -(-max(attn.seq_lens_cpu) // attn.block_size)
        blocks = attn.block_tables[:, :nblocks].long()
        positions = torch.arange(nblocks * attn.block_size, device=device)
        pad = positions[None, :] >= attn.seq_lens[:, None]
        bias = torch.zeros(pad.shape, dtype=torch.float32, device=device).masked_fill_(
            pad, float("-inf")
        )
        plan = attn.scratch["ref_decode"] = (blocks, bias[:, None, None, :])
    return plan


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    batch, hq, dk = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    blocks, bias = _decode_plan(attn, q.device)
    k, v = _gather_kv(k_cache, v_cache, blocks, q.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
    if dk == dv and q.dtype == k.dtype == v.dtype:
        # torch's fused attention reads the strided gathered views as they are (matmul would copy
        # K and V to contiguous first) and keeps scores and softmax in float32.
        out = F.scaled_dot_product_attention(
            q.view(batch, hq, 1, dk),
            k,
            v,
            attn_mask=bias if bias.dtype == q.dtype else bias.to(q.dtype),
            scale=scale,
            enable_gqa=hq != hkv,
        )
        return out.view(batch, hq, dv)
    scores = torch.matmul(_float(q).view(batch, hkv, hq // hkv, dk), _float(k).transpose(-1, -2))
    probs = torch.softmax(torch.add(bias, scores, alpha=scale), dim=-1)
    out = torch.matmul(probs if v.dtype == torch.float32 else probs.to(v.dtype), v)
    return out.view(batch, hq, dv) if out.dtype == q.dtype else out.view(batch, hq, dv).to(q.dtype)


def _varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    hq, hkv, dv = q.shape[1], k_cache.shape[2], v_cache.shape[-1]
    group = hq // hkv
    out = q.new_empty(q.shape[0], hq, dv)
    start = 0
    for i, n in enumerate(attn.query_lens_cpu):
        if n == 0:
            continue
        length, ctx = attn.seq_lens_cpu[i], attn.context_lens_cpu[i]
        blocks = attn.block_tables[i, : -(-length // attn.block_size)].long()
        k, v = _gather_kv(k_cache, v_cache, blocks, q.dtype)
        k, v = k[:length].transpose(0, 1), v[:length].transpose(0, 1)  # [Hkv, L, D]
        # rows ordered (group, query) per kv head so GQA needs no KV copy
        qi = (
            q[start : start + n]
            .view(n, hkv, group, -1)
            .permute(1, 2, 0, 3)
            .reshape(hkv, group * n, -1)
        )
        rows = torch.arange(n, device=q.device).repeat(group) + ctx
        masked = torch.arange(length, device=q.device)[None, :] > rows[:, None]
        scores = torch.matmul(_float(qi), _float(k).transpose(-1, -2)) * scale
        probs = torch.softmax(scores.masked_fill_(masked, float("-inf")), dim=-1)
        o = torch.matmul(probs.to(v.dtype), v)  # [Hkv, G*n, Dv]
        out[start : start + n] = o.view(hkv, group, n, dv).permute(2, 0, 1, 3).reshape(n, hq, dv)
        start += n
    return out
