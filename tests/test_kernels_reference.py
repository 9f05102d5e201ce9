"""Reference kernels against independent references: paged attention vs torch SDPA on contiguous KV,
RoPE inverse frequencies vs transformers' rope init functions, RMSNorm vs torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepserve.kernels import reference
from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.reference.attention import paged_attention, write_kv
from deepserve.kernels.rope import apply_rope, rope_inv_freq

BLOCK = 4


class PagedBatch:
    """Random KV for several sequences scattered over a shuffled block pool, and the metadata for one
    step in which sequence i brings `query_lens[i]` new tokens after `context_lens[i]` cached ones."""

    def __init__(self, context_lens, query_lens, hkv, dk, dv, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        need = [-(-n // BLOCK) for n in self.lens]
        perm = torch.randperm(sum(need) + 3, generator=gen)[: sum(need)] + 1
        self.tables = torch.zeros(len(need), max(need), dtype=torch.int32)
        self.k_cache = torch.zeros(sum(need) + 4, BLOCK, hkv, dk)
        self.v_cache = torch.zeros(sum(need) + 4, BLOCK, hkv, dv)
        self.keys, self.values, slots, start = [], [], [], 0
        for i, (n, nb) in enumerate(zip(self.lens, need, strict=True)):
            self.tables[i, :nb] = perm[start : start + nb]
            start += nb
            k, v = torch.randn(n, hkv, dk, generator=gen), torch.randn(n, hkv, dv, generator=gen)
            pos = torch.arange(n)
            s = self.tables[i][pos // BLOCK].long() * BLOCK + pos % BLOCK
            write_kv(self.k_cache, s, k)
            write_kv(self.v_cache, s, v)
            self.keys.append(k)
            self.values.append(v)
            slots.append(s[context_lens[i] :])
        loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.attn = AttentionMetadata(
            query_start_loc=loc,
            seq_lens=torch.tensor(self.lens, dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            slot_mapping=torch.cat(slots),
            block_tables=self.tables,
            block_size=BLOCK,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(self.lens),
            context_lens_cpu=list(context_lens),
        )
        self.context_lens, self.query_lens = list(context_lens), list(query_lens)


def sdpa_reference(batch: PagedBatch, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Each sequence alone: torch SDPA over its contiguous K/V with a causal mask offset by context."""
    outs, start = [], 0
    for i, n in enumerate(batch.query_lens):
        qi = q[start : start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        k, v = batch.keys[i].transpose(0, 1)[None], batch.values[i].transpose(0, 1)[None]
        rows = torch.arange(n)[:, None] + batch.context_lens[i]
        mask = torch.arange(batch.lens[i])[None, :] <= rows
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    "context_lens,query_lens",
    [
        ([0], [13]),  # one prefill
        ([0, 5, 9, 0], [7, 1, 6, 1]),  # prefill, decode, chunk with context, one-token prompt
        ([3, 17, 8], [1, 1, 1]),  # pure decode: the vectorized path
    ],
)
def test_paged_attention_matches_sdpa_for_any_batch_composition(context_lens, query_lens):
    batch = PagedBatch(context_lens, query_lens, hkv=2, dk=8, dv=8)
    q = torch.randn(sum(query_lens), 6, 8)
    out = paged_attention(q, batch.k_cache, batch.v_cache, batch.attn, 0.3)
    torch.testing.assert_close(out, sdpa_reference(batch, q, 0.3), atol=1e-5, rtol=1e-5)


def test_decode_fast_path_agrees_with_general_path():
    batch = PagedBatch([3, 17, 8, 30], [1, 1, 1, 1], hkv=1, dk=12, dv=12, seed=3)
    q = torch.randn(4, 4, 12)
    fast = paged_attention(q, batch.k_cache, batch.v_cache, batch.attn, 0.25)
    from deepserve.kernels.reference.attention import _varlen_attention

    general = _varlen_attention(q, batch.k_cache, batch.v_cache, batch.attn, 0.25)
    torch.testing.assert_close(fast, general, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [4, 1, 2]])
def test_paged_attention_mla_latent_view_as_values(query_lens):
    """MLA absorbed decode: one latent head; values are the leading columns of the cached keys."""
    lora, rope = 16, 4
    batch = PagedBatch([5, 9, 2], query_lens, hkv=1, dk=lora + rope, dv=lora, seed=1)
    batch.v_cache = batch.k_cache[..., :lora]
    batch.values = [k[..., :lora] for k in batch.keys]
    q = torch.randn(sum(query_lens), 8, lora + rope)
    out = paged_attention(q, batch.k_cache, batch.v_cache, batch.attn, 0.2)
    torch.testing.assert_close(out, sdpa_reference(batch, q, 0.2), atol=1e-5, rtol=1e-5)


def test_paged_attention_bfloat16_close_to_float32():
    batch = PagedBatch([0, 6], [9, 1], hkv=2, dk=8, dv=8, seed=2)
    q = torch.randn(10, 4, 8)
    ref = paged_attention(q, batch.k_cache, batch.v_cache, batch.attn, 0.35)
    out = paged_attention(
        q.bfloat16(), batch.k_cache.bfloat16(), batch.v_cache.bfloat16(), batch.attn, 0.35
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_rms_norm_matches_torch():
    x, w = torch.randn(5, 64), torch.randn(64)
    expected = F.rms_norm(x, (64,), w, eps=1e-6)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6), expected, atol=1e-6, rtol=1e-5)


def _hf_rope_config(dim: int, base: float, scaling: dict, max_pos: int):
    from transformers import LlamaConfig

    params = dict(scaling, rope_theta=base)
    return LlamaConfig(
        hidden_size=dim * 2,
        num_attention_heads=2,
        head_dim=dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "default"},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
    ],
)
def test_rope_inv_freq_matches_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    dim, base = 64, 500000.0
    config = _hf_rope_config(
        dim, base, scaling, 4 * scaling.get("original_max_position_embeddings", 4096)
    )
    if scaling["rope_type"] == "default":
        expected = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        expected_factor = 1.0
    else:
        expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    inv_freq, factor = rope_inv_freq(dim, base, scaling)
    torch.testing.assert_close(inv_freq, expected, atol=0, rtol=1e-6)
    assert factor == pytest.approx(expected_factor)


def test_apply_rope_matches_transformers_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x, pos = torch.randn(6, 3, 16), torch.arange(6) * 7
    inv_freq, _ = rope_inv_freq(16, 10000.0, None)
    freqs = pos[:, None].float() * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    ref, _ = apply_rotary_pos_emb(x, x, emb.cos(), emb.sin(), unsqueeze_dim=1)
    torch.testing.assert_close(apply_rope(x, freqs.cos()[:, None], freqs.sin()[:, None]), ref)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 3]])
def test_paged_attention_kv_as_column_slices_of_one_layer(query_lens):
    """Llama's cache layout: K and V are the two halves of each token's row in one [NB, BS, W]
    tensor (the fast whole-row gather path) - same result as separate K and V tensors."""
    batch = PagedBatch([4, 11, 7], query_lens, hkv=2, dk=8, dv=8, seed=4)
    layer = torch.cat([batch.k_cache.flatten(2), batch.v_cache.flatten(2)], dim=-1).contiguous()
    k_view = layer[..., :16].unflatten(-1, (2, 8))
    v_view = layer[..., 16:].unflatten(-1, (2, 8))
    q = torch.randn(sum(query_lens), 4, 8)
    out = paged_attention(q, k_view, v_view, batch.attn, 0.3)
    torch.testing.assert_close(out, sdpa_reference(batch, q, 0.3), atol=1e-5, rtol=1e-5)
