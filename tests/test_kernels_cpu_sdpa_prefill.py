"""The default CPU set's bf16 prefill attention through torch's SDPA (kernels/cpu/sdpa_prefill.py):
long query runs against a float64 reference beside decode rows and short chunks of the same step,
which keep the native kernel's bits; what it does not cover keeps the native kernel."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from paged_kv import PagedCase

from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.cpu import ops as cpu_ops
from deepserve.kernels.cpu import sdpa_prefill
from deepserve.kernels.cpu.packed import vendor_gemm_faster
from deepserve.kernels.reference import attention as attention_ref
from deepserve.kernels.registry import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_native.load(), reason="native CPU kernels unavailable")


class Sdpa:
    paged_attention = staticmethod(
        partial(sdpa_prefill.paged_attention, native=cpu_ops.native_paged_attention)
    )


class Native:
    paged_attention = staticmethod(cpu_ops.native_paged_attention)


class Reference:
    paged_attention = staticmethod(attention_ref._varlen_attention)


def _float64(case: PagedCase, lengths: list[int]) -> PagedCase:
    wide = PagedCase("gqa", lengths)
    wide.cache.k, wide.cache.v = case.cache.k.double(), case.cache.v.double()
    wide.queries = [q.double() for q in case.queries]
    return wide


def test_long_runs_match_the_float64_reference_beside_decodes_and_short_chunks():
    """A fresh 300-token prompt (causal), 140 queries after 60 cached tokens (the mask path), a
    decode row and a 5-token chunk, in one step."""
    lengths = [300, 9, 200, 140]
    case = PagedCase("gqa", lengths, dtype=torch.bfloat16)
    seqs = [(0, 0, 300), (1, 8, 1), (2, 60, 140), (3, 0, 5)]
    got = case.run(Sdpa, seqs)
    for out, want in zip(got, _float64(case, lengths).run(Reference, seqs), strict=True):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=8e-3)


def test_rows_outside_long_runs_get_the_native_kernels_bits():
    lengths = [300, 9, 200]
    case = PagedCase("gqa", lengths, dtype=torch.bfloat16)
    step = case.run(Sdpa, [(0, 0, 300), (1, 8, 1), (2, 100, 50)])
    native = case.run(Native, [(1, 8, 1), (2, 100, 50)])
    assert torch.equal(step[1], native[0]) and torch.equal(step[2], native[1])


def test_a_step_without_a_long_run_is_the_native_kernel():
    case = PagedCase("gqa", [200, 9], dtype=torch.bfloat16)
    seqs = [(0, 70, sdpa_prefill.SDPA_MIN_QUERIES - 1), (1, 8, 1)]
    for got, want in zip(case.run(Sdpa, seqs), case.run(Native, seqs), strict=True):
        assert torch.equal(got, want)


def test_float32_and_mla_caches_keep_the_native_kernel():
    mla = PagedCase("mla", [150], dtype=torch.bfloat16)
    q = mla.queries[0]
    assert not sdpa_prefill.covers(q, mla.cache.k, mla.cache.v)
    gqa = PagedCase("gqa", [150])
    assert not sdpa_prefill.covers(gqa.queries[0], gqa.cache.k, gqa.cache.v)


@pytest.mark.skipif(not vendor_gemm_faster(), reason="the default set routes here on AMX CPUs")
def test_the_default_set_on_an_amx_cpu_runs_bf16_prefill_through_sdpa():
    case = PagedCase("gqa", [300], dtype=torch.bfloat16)

    class Default:
        paged_attention = staticmethod(cpu_kernels().paged_attention)

    seqs = [(0, 0, 300)]
    assert torch.equal(case.run(Default, seqs)[0], case.run(Sdpa, seqs)[0])
