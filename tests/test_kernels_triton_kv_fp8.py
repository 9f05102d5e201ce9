"""The Triton attention and KV-write kernels on an e4m3 KV cache (`--kv-cache-dtype fp8`): every
attention kernel over e4m3 blocks gives exactly its result over the same blocks widened to float32
(it widens what it loads, and the scales are the model's), and the fused writes store torch's
saturated e4m3 codes. Runs on CUDA when there is one, else small shapes in Triton's interpreter
(patched for e4m3 by test_kernels_triton_fp8); skipped without triton. The production shapes and
the timing are the GPU job's (benchmarks/gpu/kernel_checks.py `run_kv_fp8`)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")

import test_kernels_triton_fp8  # noqa: E402,F401  (patches the interpreter for e4m3 when used)
from paged_kv import PagedCase  # noqa: E402
from test_kernels_gpu_fast import _caches, _decode_metadata, _rand  # noqa: E402

from deepserve.kernels import kv_quant  # noqa: E402
from deepserve.kernels.reference import KERNELS  # noqa: E402
from deepserve.kernels.reference.attention import write_kv  # noqa: E402
from deepserve.kernels.triton import attention  # noqa: E402
from deepserve.kernels.triton.decode_attention import (  # noqa: E402
    InvariantPagedAttention,
    decode_attention,
)
from deepserve.kernels.triton.kernelset import FastPagedAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def _e4m3(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The caches in e4m3, and those codes widened to float32, with V still K's leading columns
    where it was (MLA's latent)."""
    shared = v_cache.data_ptr() == k_cache.data_ptr()
    base = k_cache if shared else torch.cat([k_cache, v_cache], dim=-1)
    codes = base.to(FP8)
    wide = codes.float()
    dk = k_cache.shape[-1]
    if shared:
        dv = v_cache.shape[-1]
        return (codes, codes[..., :dv]), (wide, wide[..., :dv])
    return (codes[..., :dk], codes[..., dk:]), (wide[..., :dk], wide[..., dk:])


@pytest.mark.parametrize("layout", ["latent", "gqa"])
def test_decode_attention_over_e4m3_equals_it_over_the_widened_cache(layout):
    k_cache, v_cache, hq = _caches(layout)
    (k8, v8), (k32, v32) = _e4m3(k_cache, v_cache)
    attn = _decode_metadata([1, 9, 30], 4, 40)
    q = _rand(3, hq, k_cache.shape[-1], seed=7)
    got = decode_attention(q, k8, v8, attn, 0.3)
    assert torch.equal(got, decode_attention(q, k32, v32, attn, 0.3))
    want = KERNELS.paged_attention(q, k8, v8, attn, 0.3)  # the reference widens on gather
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
@pytest.mark.parametrize("kind", ["fast", "invariant"])
def test_paged_attention_over_e4m3_equals_it_over_the_widened_cache(kind, layout):
    """Both sets' paged attention: a prefill, a chunk mixed with a decode, and a decode step."""
    if kind == "fast":
        op = FastPagedAttention()
        op.varlen.split = 2 * attention.BLOCK_N  # interpreter: a small split, several of them
    else:
        op = InvariantPagedAttention(split=2 * attention.BLOCK_N)
    case = PagedCase(layout, [150, 40], device=DEVICE)
    (k8, v8), (k32, v32) = _e4m3(case.cache.k, case.cache.v)
    for seqs in ([(0, 0, 150)], [(0, 120, 30), (1, 39, 1)], [(0, 149, 1), (1, 39, 1)]):
        q = torch.cat([case.queries[i][c : c + n] for i, c, n in seqs])
        got = op(q, k8, v8, case.cache.meta(seqs), 0.125)
        assert torch.equal(got, op(q, k32, v32, case.cache.meta(seqs), 0.125)), seqs
        want = KERNELS.paged_attention(q, k8, v8, case.cache.meta(seqs), 0.125)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mla_kv_write_stores_torchs_e4m3_codes():
    from deepserve.kernels import reference
    from deepserve.kernels.rope import apply_rope, build_rope_tables, rope_at
    from deepserve.kernels.triton import mla

    tokens, lora, rope = 3, 32, 16
    ckv, norm = _rand(tokens, lora + rope, seed=10) * 4, _rand(lora, seed=11) * 200
    cos, sin = rope_at(
        build_rope_tables(rope, 10000.0, None, 64, DEVICE),
        torch.tensor([0, 9, 40]).to(DEVICE),
        torch.float32,
    )
    cache = torch.zeros(6, 4, lora + rope, device=DEVICE, dtype=FP8)
    slots = torch.tensor([5, 17, 2], device=DEVICE)
    assert mla.kv_write_(ckv, norm, 1e-6, cos, sin, cache, slots)
    latent = reference.rms_norm(ckv[:, :lora], norm, 1e-6)
    k_pe = apply_rope(ckv[:, lora:].unsqueeze(1), cos, sin)[:, 0]
    want = kv_quant.quantize(torch.cat([latent, k_pe], -1), FP8)
    assert want.float().abs().max() == kv_quant.FP8_MAX  # some rows saturate
    got = kv_quant.index_rows(cache.view(-1, lora + rope), slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_rope_qk_write_kv_stores_what_the_unfused_write_stores():
    from deepserve.kernels.rope import apply_rope, build_rope_tables, rope_at
    from deepserve.kernels.triton import rope

    tokens, hq, hkv, d = 3, 3, 1, 8
    qkv = _rand(tokens, (hq + 2 * hkv) * d, seed=13) * 100
    cos, sin = rope_at(
        build_rope_tables(d, 10000.0, None, 64, DEVICE),
        torch.tensor([0, 9, 40]).to(DEVICE),
        torch.float32,
    )
    layer = torch.zeros(5, 4, 2 * hkv * d, device=DEVICE, dtype=FP8)  # llama's [K | V] rows
    want_layer = layer.clone()
    k_cache, v_cache = (p.unflatten(-1, (hkv, d)) for p in layer.chunk(2, dim=-1))
    want_k, want_v = (p.unflatten(-1, (hkv, d)) for p in want_layer.chunk(2, dim=-1))
    slots = torch.tensor([17, 2, 9], device=DEVICE)
    qk = apply_rope(qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d), cos, sin)
    write_kv(want_k, slots, qk[:, hq:])
    write_kv(want_v, slots, qkv[:, (hq + hkv) * d :].view(tokens, hkv, d))
    assert rope.rope_qk_write_kv_(qkv, cos, sin, k_cache, v_cache, slots, hq)
    assert torch.equal(layer.view(torch.uint8), want_layer.view(torch.uint8))


def test_the_fast_set_reads_e4m3_through_its_own_kernels():
    """No silent fallback: the default set's attention is the Triton one for an e4m3 cache too."""
    from deepserve.kernels.registry import fast_kernels

    assert isinstance(fast_kernels().paged_attention, FastPagedAttention)
