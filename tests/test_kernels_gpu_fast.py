"""The default CUDA path's Triton kernels against their torch oracles: fused MoE (both tile
shapes, and a row's bits alone vs in a batch under the fixed tile), the graph-safe decode
attention (MLA-style shared latent and GQA layouts over shuffled block tables), and the
fixed-split kernel's device-side decode layout, bitwise against its host layout. Runs on CUDA
when there is one, else small shapes in Triton's interpreter; skipped without triton."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")

import test_kernels_invariant_triton  # noqa: E402,F401  (patches the interpreter when used)

from deepserve.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from deepserve.kernels.reference import attention as attention_ref  # noqa: E402
from deepserve.kernels.triton import attention, fused_moe  # noqa: E402
from deepserve.kernels.triton.decode_attention import decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE)


@pytest.mark.parametrize("tokens", [1, 5])
def test_fused_moe_matches_the_loop_and_rows_are_batch_invariant(tokens):
    e, h, i, k = 4, 32, 16, 2
    gate_up, down = _rand(e, 2 * i, h, seed=1) / h**0.5, _rand(e, h, i, seed=2) / i**0.5
    x = _rand(tokens, h, seed=3)
    ids = _rand(tokens, e, seed=4).topk(k, dim=-1)[1]
    w = _rand(tokens, k, seed=5).abs()
    want = fused_moe.fused_moe_reference(x, gate_up, down, w, ids)
    for cfg in (fused_moe.DECODE, fused_moe.PREFILL, fused_moe.LARGE):
        got = fused_moe.fused_moe(x, gate_up, down, w, ids, cfg)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    alone = fused_moe.fused_moe(x[-1:], gate_up, down, w[-1:], ids[-1:], fused_moe.DECODE)
    assert torch.equal(alone, fused_moe.fused_moe(x, gate_up, down, w, ids, fused_moe.DECODE)[-1:])


def test_fused_moe_adds_the_shared_output_as_a_separate_add_would():
    e, h, i, k = 4, 32, 16, 2
    gate_up, down = _rand(e, 2 * i, h, seed=1) / h**0.5, _rand(e, h, i, seed=2) / i**0.5
    x, shared = _rand(3, h, seed=3), _rand(3, h, seed=6)
    ids = _rand(3, e, seed=4).topk(k, dim=-1)[1]
    w = _rand(3, k, seed=5).abs()
    alone = fused_moe.fused_moe(x, gate_up, down, w, ids)
    assert torch.equal(fused_moe.fused_moe(x, gate_up, down, w, ids, add=shared), alone + shared)


def test_fused_moe_clamps_gate_and_up_at_the_swiglu_limit():
    """DeepSeek-V4's clamped SwiGLU: gate <= limit, -limit <= up <= limit, before silu(gate)*up;
    the inputs are scaled so that both clamps bite."""
    e, h, i, k, limit = 4, 32, 16, 2, 0.5
    gate_up, down = _rand(e, 2 * i, h, seed=1), _rand(e, h, i, seed=2) / i**0.5
    x = _rand(3, h, seed=3)
    ids = _rand(3, e, seed=4).topk(k, dim=-1)[1]
    w = _rand(3, k, seed=5).abs()
    want = fused_moe.fused_moe_reference(x, gate_up, down, w, ids, swiglu_limit=limit)
    unclamped = fused_moe.fused_moe_reference(x, gate_up, down, w, ids)
    assert not torch.allclose(want, unclamped, rtol=1e-2, atol=1e-2)
    got = fused_moe.fused_moe(x, gate_up, down, w, ids, swiglu_limit=limit)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fused_moe_tile_widens_once_the_experts_average_a_full_wide_block():
    small = fused_moe.default_config(6, 64)  # DECODE's tile, FP8 experts without x quantized
    assert small is fused_moe.DECODE_W8A16 and small.block_m == fused_moe.DECODE.block_m
    assert fused_moe.default_config(fused_moe.PREFILL_MIN_PAIRS, 64) is fused_moe.PREFILL
    assert fused_moe.default_config(12000, 64) is fused_moe.LARGE
    assert fused_moe.default_config(12000, 256) is fused_moe.PREFILL


@pytest.mark.parametrize("kernel", [True, False])
def test_align_gives_every_pair_one_row_of_its_experts_block(kernel):
    align = fused_moe.align_kernel if kernel else fused_moe.align_reference  # large calls' path
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]], device=DEVICE)
    table, block_expert = align(ids, 4, block_m=2)
    flat = ids.reshape(-1).tolist()
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        rows = [p for p in table[2 * b : 2 * b + 2].tolist() if p < len(flat)]
        assert expert >= 0 or not rows
        assert all(flat[p] == expert for p in rows)
        seen += rows
    assert sorted(seen) == list(range(len(flat)))


def _decode_metadata(lens: list[int], block_size: int, num_blocks: int) -> AttentionMetadata:
    width = max(-(-n // block_size) for n in lens)
    g = torch.Generator().manual_seed(9)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)

    def t(v, dt=torch.int32):
        return torch.tensor(v, dtype=dt, device=DEVICE)

    return AttentionMetadata(
        query_start_loc=t(list(range(len(lens) + 1))),
        seq_lens=t(lens),
        context_lens=t([n - 1 for n in lens]),
        slot_mapping=t([0] * len(lens), torch.int64),
        block_tables=tables.to(DEVICE, torch.int32),
        block_size=block_size,
        query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
        context_lens_cpu=[n - 1 for n in lens],
    )


def _caches(layout: str):
    if layout == "latent":  # MLA: one 96-wide row per token, V its first 64 columns
        cache = _rand(40, 4, 96, seed=6).unsqueeze(2)
        return cache, cache[..., :64], 4
    cache = _rand(40, 4, 2 * 2 * 32, seed=6)  # GQA: [K | V], 2 KV heads of 32, 6 query heads
    return cache[..., :64].unflatten(-1, (2, 32)), cache[..., 64:].unflatten(-1, (2, 32)), 6


@pytest.mark.parametrize("layout", ["latent", "gqa"])
def test_decode_attention_matches_reference(layout):
    k_cache, v_cache, hq = _caches(layout)
    lens = [1, 9, 30]
    attn = _decode_metadata(lens, 4, 40)
    q = _rand(len(lens), hq, k_cache.shape[-1], seed=7)
    want = attention_ref.paged_attention(q, k_cache, v_cache, attn, 0.3)
    got = decode_attention(q, k_cache, v_cache, attn, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_attention_matches_reference_when_a_long_context_takes_more_than_base_splits():
    # 3,000 keys, splits of at least 64 (the interpreter's stand-in for 512): 47 splits, past 32
    cache = _rand(400, 16, 96, seed=10).unsqueeze(2)
    attn = _decode_metadata([3000, 70], 16, 400)
    q = _rand(2, 4, 96, seed=11)
    want = attention_ref.paged_attention(q, cache, cache[..., :64], attn, 0.2)
    got = decode_attention(q, cache, cache[..., :64], attn, 0.2, min_split_keys=64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_attention_folds_whole_rows_when_sequences_and_heads_fill_the_gpu():
    # 17 sequences x 16 heads = 272 (sequence, head) pairs: one fold program each, all columns
    cache = _rand(400, 8, 96, seed=12).unsqueeze(2)
    lens = [5 + 11 * i for i in range(17)]
    attn = _decode_metadata(lens, 8, 400)
    q = _rand(len(lens), 16, 96, seed=13)
    want = attention_ref.paged_attention(q, cache, cache[..., :64], attn, 0.2)
    got = decode_attention(q, cache, cache[..., :64], attn, 0.2, min_split_keys=64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fixed_split_decode_layout_equals_the_host_layout():
    k_cache, v_cache, hq = _caches("gqa")
    attn = _decode_metadata([3, 17, 30], 4, 40)
    q = _rand(3, hq, 32, seed=8)
    kernel = attention.TritonPagedAttention(split=64)
    on_device = kernel(q, k_cache, v_cache, attn, 0.3)
    kernel._layout = kernel._host_layout(attn, q.device)
    assert torch.equal(on_device, kernel(q, k_cache, v_cache, attn, 0.3))


def test_mla_kv_write_and_rope_into_match_the_torch_ops():
    from deepserve.kernels import reference
    from deepserve.kernels.rope import apply_rope, build_rope_tables, rope_at
    from deepserve.kernels.triton import mla

    tokens, lora, rope, heads = 3, 32, 16, 5
    ckv, norm = _rand(tokens, lora + rope, seed=10), _rand(lora, seed=11)
    cos, sin = rope_at(
        build_rope_tables(rope, 10000.0, None, 64, DEVICE),
        torch.tensor([0, 9, 40]).to(DEVICE),
        torch.float32,
    )
    cache = torch.zeros(6, 4, lora + rope, device=DEVICE)
    slots = torch.tensor([5, 17, 2], device=DEVICE)
    assert mla.kv_write_(ckv, norm, 1e-6, cos, sin, cache, slots)
    latent = reference.rms_norm(ckv[:, :lora], norm, 1e-6)
    k_pe = apply_rope(ckv[:, lora:].unsqueeze(1), cos, sin)[:, 0]
    torch.testing.assert_close(cache.view(-1, lora + rope)[slots], torch.cat([latent, k_pe], -1))
    q = _rand(tokens, heads, 8 + rope, seed=12)
    out = torch.zeros(tokens, heads, 4 + rope, device=DEVICE)
    assert mla.rope_into_(q[..., 8:], cos, sin, out[..., 4:])
    torch.testing.assert_close(out[..., 4:], apply_rope(q[..., 8:], cos, sin))
    assert out[..., :4].eq(0).all()
    latent = _rand(heads, tokens, 4, seed=14).transpose(0, 1)  # the bmm's [H, T, lora], strided
    whole = torch.zeros(tokens, heads, 4 + rope, device=DEVICE)
    assert mla.absorbed_query_(latent, q[..., 8:], cos, sin, whole)
    assert torch.equal(whole, torch.cat([latent, out[..., 4:]], dim=-1))


def test_tiny_deepseek_with_the_fast_kernels_matches_the_reference_kernels():
    """The whole model on the default CUDA KernelSet (fused MoE, MLA ops, both attention
    kernels) against the reference KernelSet: a prefill, then decode steps."""
    from model_loop import SequenceLoop

    from deepserve.engine.models.common import WeightStore
    from deepserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
    from deepserve.engine.testmodels.tiny_deepseek import TINY_CONFIG, _tensors
    from deepserve.kernels.reference import KERNELS
    from deepserve.kernels.registry import fast_kernels

    config = dict(TINY_CONFIG, vocab_size=300)
    weights = _tensors(config, torch.Generator().manual_seed(0))
    logits = []
    for kernels in (KERNELS, fast_kernels()):
        store = WeightStore(weights, torch.device(DEVICE), torch.float32)
        loop = SequenceLoop(DeepseekV3ForCausalLM(config, store, kernels, "t"), 32, block_size=4)
        logits.append([loop.logits([5, 9, 2, 7, 1]), loop.logits([3]), loop.logits([8])])
    for want, got in zip(*logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# float16, not bfloat16: the interpreter truncates float32 -> bfloat16 where CUDA rounds to
# nearest (benchmarks/gpu/kernel_checks.py checks bfloat16 bitwise on the device)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_qk_write_kv_equals_apply_rope_and_write_kv_bitwise(dtype):
    from deepserve.kernels.reference.attention import write_kv
    from deepserve.kernels.rope import apply_rope, build_rope_tables, rope_at
    from deepserve.kernels.triton import rope

    tokens, hq, hkv, d = 3, 3, 1, 8
    qkv = _rand(tokens, (hq + 2 * hkv) * d, seed=13).to(dtype)
    cos, sin = rope_at(
        build_rope_tables(d, 10000.0, None, 64, DEVICE), torch.tensor([0, 9, 40]).to(DEVICE), dtype
    )
    layer = torch.zeros(5, 4, 2 * hkv * d, device=DEVICE, dtype=dtype)  # llama's [K | V] rows
    k_cache, v_cache = (part.unflatten(-1, (hkv, d)) for part in layer.chunk(2, dim=-1))
    slots = torch.tensor([17, 2, 9], device=DEVICE)
    want_layer = layer.clone()
    want_k, want_v = (part.unflatten(-1, (hkv, d)) for part in want_layer.chunk(2, dim=-1))
    qk = apply_rope(qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d), cos, sin)
    write_kv(want_k, slots, qk[:, hq:])
    write_kv(want_v, slots, qkv[:, (hq + hkv) * d :].view(tokens, hkv, d))
    assert rope.rope_qk_write_kv_(qkv, cos, sin, k_cache, v_cache, slots, hq)
    assert torch.equal(qkv[:, : hq * d].view(tokens, hq, d), qk[:, :hq])
    assert torch.equal(layer, want_layer)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_default_prefill_attention_matches_the_reference(layout):
    """The default set's varlen attention (32 query rows per program) on a prefill and a chunk
    mixed with a decode."""
    from dataclasses import replace

    from paged_kv import PagedCase

    from deepserve.kernels.reference import KERNELS
    from deepserve.kernels.triton.kernelset import FastPagedAttention

    fast = FastPagedAttention()
    fast.varlen.split = 2 * attention.BLOCK_N  # interpreter: a small split, several of them
    kernels = replace(KERNELS, paged_attention=fast)
    case = PagedCase(layout, [150, 40], device=DEVICE)
    for seqs in ([(0, 0, 150)], [(0, 120, 30), (1, 39, 1)]):
        got, want = case.run(kernels, seqs), case.run(KERNELS, seqs)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
