"""An e4m3 KV cache in the CPU kernel sets (kernels/kv_quant.py): the write saturates and divides
by the scale, and every set's paged attention over e4m3 blocks gives exactly what it gives over
the same blocks widened to the query's dtype (the reference and invariant torch sets widen on
gather; the native CPU attention does not read e4m3 and hands those calls to its fallback)."""

from __future__ import annotations

import pytest
import torch
from paged_kv import PagedCase

from deepserve.kernels import kv_quant, reference
from deepserve.kernels.reference.attention import write_kv
from deepserve.kernels.reference.invariant import invariant_kernels
from deepserve.kernels.registry import cpu_kernels, invariant_cpu_kernels

FP8 = torch.float8_e4m3fn
# each set, and the set whose attention it must equal over the widened blocks: the native ops
# read float32 / bfloat16 caches only, so their e4m3 calls are their torch fallback's
SETS = {
    "reference": lambda: (reference.KERNELS, reference.KERNELS),
    "cpu_native": lambda: (cpu_kernels(), reference.KERNELS),
    "invariant": lambda: (invariant_cpu_kernels(), invariant_kernels()),
}
# (sequence, context, queries): pure decode, and prefill chunks mixed with decodes
STEPS = {"decode": [(0, 39, 1), (1, 15, 1), (2, 69, 1)], "mixed": [(0, 30, 10), (1, 16, 1)]}


def _caches(case: PagedCase, layout: str) -> tuple[tuple, tuple]:
    """(the case's cache in e4m3, the same codes widened to float32), as (k, v) pairs."""
    codes = case.cache.k.to(FP8)
    wide = codes.float()
    dv = case.cache.v.shape[-1]
    if layout == "mla":
        return (codes, codes[..., :dv]), (wide, wide[..., :dv])
    vcodes = case.cache.v.to(FP8)
    return (codes, vcodes), (wide, vcodes.float())


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("layout", ["gqa", "mla"])
@pytest.mark.parametrize("name", list(SETS))
def test_attention_over_e4m3_blocks_equals_attention_over_them_widened(name, layout, step):
    kernels, oracle = SETS[name]()
    case = PagedCase(layout, [70, 40, 70])
    seqs = STEPS[step]
    (k8, v8), (k32, v32) = _caches(case, layout)
    q = torch.cat([case.queries[i][c : c + n] for i, c, n in seqs])
    meta = case.cache.meta(seqs)
    got = kernels.paged_attention(q, k8, v8, meta, 0.125)
    want = oracle.paged_attention(q, k32, v32, case.cache.meta(seqs), 0.125)
    assert got.dtype == q.dtype
    assert torch.equal(got, want)


def test_bfloat16_queries_read_e4m3_blocks_as_bfloat16():
    case = PagedCase("gqa", [40], dtype=torch.bfloat16)
    (k8, v8), _ = _caches(case, "gqa")
    q = case.queries[0][39:40]
    meta = case.cache.meta([(0, 39, 1)])
    got = reference.KERNELS.paged_attention(q, k8, v8, meta, 0.125)
    want = reference.KERNELS.paged_attention(
        q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), meta, 0.125
    )
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_write_kv_saturates_to_e4m3s_finite_range():
    cache = torch.zeros(2, 4, 3, dtype=FP8)
    values = torch.tensor([[1.0, 1000.0, -1e6], [0.1, -2.0, 448.0]])
    write_kv(cache, torch.tensor([5, 0]), values)
    flat = cache.view(-1, 3).float()
    assert flat[5].tolist() == [1.0, 448.0, -448.0]  # no NaN from an overflow
    assert flat[0].tolist() == [values[1, 0].to(FP8).item(), -2.0, 448.0]


def test_quantize_divides_by_the_scale_and_dequantize_multiplies_it_back():
    x = torch.tensor([3.0, -0.75, 600.0])
    codes = kv_quant.quantize(x, FP8, scale=2.0)
    assert codes.float().tolist() == [1.5, -0.375, 288.0]
    assert kv_quant.dequantize(codes, torch.float32, 2.0).tolist() == [3.0, -0.75, 576.0]


def test_an_unquantized_cache_is_a_plain_cast():
    x = torch.randn(4, 8)
    assert kv_quant.quantize(x, torch.float32) is x
    assert torch.equal(kv_quant.quantize(x, torch.bfloat16), x.to(torch.bfloat16))
