"""The native CPU paged attention (kernels/cpu/csrc/attention.cpp, through the default CPU set of
kernels/cpu/kernelset.py) against the torch reference (kernels/reference/attention.py) on
scattered paged caches: decode, prefill and mixed batches, GQA and MLA layouts, float32 and
bfloat16."""

from __future__ import annotations

import pytest
import torch
from paged_kv import PagedCase

from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.reference import attention as attention_ref
from deepserve.kernels.registry import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_native.load(), reason="native CPU kernels unavailable")


class Ref:
    paged_attention = staticmethod(attention_ref.paged_attention)


class VarlenRef:
    """The reference's general path: it gathers only a sequence's own blocks, where the decode
    path also reads table padding, which the MLA case's poisoned (NaN) free blocks would spoil."""

    paged_attention = staticmethod(attention_ref._varlen_attention)


class Native:
    paged_attention = staticmethod(cpu_kernels().paged_attention)


def assert_native_matches_reference(case: PagedCase, seqs, atol=1e-5, ref=Ref):
    for out, want in zip(case.run(Native, seqs), case.run(ref, seqs), strict=True):
        torch.testing.assert_close(out, want, atol=atol, rtol=atol)


def test_native_decode_attention_matches_reference_for_mixed_lengths():
    # lengths around block edges (16): one token, a partial block, full blocks, one past a block
    lengths = [1, 15, 16, 17, 40, 100]
    case = PagedCase("gqa", lengths)
    assert_native_matches_reference(case, [(i, n - 1, 1) for i, n in enumerate(lengths)])


def test_native_varlen_attention_matches_reference_for_prefill_mixed_with_decode():
    case = PagedCase("gqa", [20, 31, 17, 1, 60])
    # a fresh prompt, a decode, a chunk after cached context, a one-token prompt, and a prefill
    # longer than one key tile (64 keys)
    seqs = [(0, 0, 20), (1, 30, 1), (2, 10, 7), (3, 0, 1), (4, 0, 60)]
    assert_native_matches_reference(case, seqs)


def test_native_varlen_attention_matches_reference_for_chunk_after_long_context():
    case = PagedCase("gqa", [90, 50])
    assert_native_matches_reference(case, [(0, 57, 33), (1, 49, 1)])


@pytest.mark.parametrize("seqs", [[(0, 29, 1), (1, 4, 1)], [(0, 20, 10), (1, 0, 5)]])
def test_native_attention_mla_values_are_a_slice_of_the_keys(seqs):
    case = PagedCase("mla", [30, 5])
    assert case.cache.v.data_ptr() == case.cache.k.data_ptr()
    assert_native_matches_reference(case, seqs, ref=VarlenRef)


def test_native_attention_reads_llamas_kv_column_slices_of_one_layer():
    """The engine's llama cache is one `[blocks, block_size, 2 * Hkv * D]` layer per step with K
    and V as column slices: strided views the kernel reads without a copy."""
    case = PagedCase("gqa", [33, 18])
    layer = torch.cat([case.cache.k.flatten(2), case.cache.v.flatten(2)], dim=-1)
    width = case.cache.k.shape[2] * case.cache.k.shape[3]
    case.cache.k = layer[..., :width].unflatten(-1, case.cache.k.shape[2:])
    case.cache.v = layer[..., width:].unflatten(-1, case.cache.v.shape[2:])
    assert_native_matches_reference(case, [(0, 32, 1), (1, 10, 8)])


ISAS = cpu_native.supported_isas() if cpu_native.load() else []


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_native_attention_bfloat16_cache_matches_float64_reference(isa, layout):
    # on AVX512-BF16 bfloat16 q is scored, and p @ V summed, in bf16 pairs (vdpbf16ps): a path
    # of its own; the 150-token prompt spans three key tiles, the last one partial
    case = PagedCase(layout, [150, 9], dtype=torch.bfloat16)
    seqs = [(0, 0, 150), (1, 8, 1)]
    wide = PagedCase(layout, [150, 9])
    wide.cache.k, wide.cache.v = case.cache.k.double(), case.cache.v.double()
    wide.queries = [q.double() for q in case.queries]
    with cpu_native.use_isa(isa):
        got = case.run(Native, seqs)
    for out, ref in zip(got, wide.run(VarlenRef, seqs), strict=True):
        assert out.dtype == torch.bfloat16
        # the final rounding to bfloat16 (half a bfloat16 ulp) and, on the pairs path, the
        # probabilities rounded to bfloat16 before p @ V
        torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("block", [7, 24])
def test_native_attention_matches_reference_when_key_tiles_split_cache_blocks(block):
    # key tiles are 64 positions of the sequence: here they start and end inside cache blocks
    case = PagedCase("gqa", [150, 70], block=block)
    assert_native_matches_reference(case, [(0, 0, 150), (1, 69, 1), (1, 20, 30)])


@pytest.mark.parametrize("block", [7, 24])
def test_native_attention_rows_keep_their_bits_in_chunks_and_decode_for_any_block_size(block):
    case = PagedCase("gqa", [150], block=block)
    whole = case.run(Native, [(0, 0, 150)])[0]
    chunks = [case.run(Native, [(0, c, min(50, 150 - c))])[0] for c in range(0, 150, 50)]
    assert torch.equal(torch.cat(chunks), whole)
    for pos in (63, 64, 149):
        assert torch.equal(case.run(Native, [(0, pos, 1)])[0][0], whole[pos])


def test_native_attention_row_does_not_depend_on_the_batch():
    case = PagedCase("gqa", [50, 20, 7])
    alone = case.run(Native, [(0, 40, 10)])[0]
    batched = case.run(Native, [(1, 19, 1), (0, 40, 10), (2, 0, 7)])[1]
    assert torch.equal(alone, batched)


def test_unsupported_head_size_falls_back_to_the_reference():
    case = PagedCase("gqa", [12])
    case.cache.k, case.cache.v = case.cache.k[..., :60], case.cache.v[..., :60]
    case.queries = [q[..., :60] for q in case.queries]
    assert_native_matches_reference(case, [(0, 11, 1)])
