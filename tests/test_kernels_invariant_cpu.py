"""The CPU batch-invariant ops: each row's bits independent of the batch around it, and the same
function as the torch reference (within float32 tolerance). Attention rows must be bitwise equal
whether the prompt is prefilled at once, in chunks of any size, decoded a token at a time, or batched
with neighbours of other lengths."""

from __future__ import annotations

import pytest
import torch
from paged_kv import PagedCase

from deepserve.kernels import reference
from deepserve.kernels.reference.invariant import KV_SPLIT, MatmulPlan, invariant_kernels

BI = invariant_kernels()


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_bits_do_not_depend_on_row_count_or_position(dtype):
    w = _rand(384, 576, seed=1, dtype=dtype)
    x = _rand(300, 576, seed=2, dtype=dtype)
    alone = torch.stack([BI.linear(x[i : i + 1], w)[0] for i in range(0, 300, 7)])
    for m in [1, 2, 3, 5, 6, 7, 9, 11, 13, 64, 293]:
        for off in [0, 7]:
            y = BI.linear(x[off : off + m], w)
            for i in range(off, min(off + m, 300)):
                if i % 7 == 0:
                    assert torch.equal(y[i - off], alone[i // 7]), (m, off, i)


def test_reference_linear_is_batch_variant_here():
    """The problem the flag fixes exists on this machine (so the test above can fail)."""
    w, x = _rand(640, 576, seed=1), _rand(64, 576, seed=2)
    full = reference.linear(x, w)
    assert any(not torch.equal(reference.linear(x[:m], w), full[:m]) for m in range(1, 12))


def test_linear_matches_reference():
    w, x = _rand(640, 576, seed=3), _rand(37, 2, 576, seed=4)
    torch.testing.assert_close(BI.linear(x, w), reference.linear(x, w), rtol=1e-5, atol=1e-4)


def test_bmm_row_bits_do_not_depend_on_row_count():
    a, b = _rand(4, 90, 64, seed=5), _rand(4, 64, 512, seed=6)
    full = BI.bmm(a, b)
    for m in [1, 2, 3, 5, 17, 90]:
        assert torch.equal(BI.bmm(a[:, :m], b), full[:, :m]), m
    torch.testing.assert_close(full, reference.bmm(a, b), rtol=1e-5, atol=1e-4)


def test_bmm_rows_in_bfloat16_do_not_depend_on_row_count():
    a, b = _rand(3, 90, 64, seed=7, dtype=torch.bfloat16), _rand(3, 64, 256, seed=8)
    full = BI.bmm(a, b.bfloat16())
    for m in [1, 2, 3, 33, 47, 90]:
        assert torch.equal(BI.bmm(a[:, :m], b.bfloat16()), full[:, :m]), m


def test_a_chunked_plan_runs_each_chunk_as_its_own_call():
    """MatmulPlan.run: calls of at most `chunk` rows, each padded to the tile, the padding cut."""
    seen = []
    plan = MatmulPlan(tile=4, compute=torch.float32, chunk=8)
    x = _rand(2, 19, 5)
    y = plan.run(x, lambda p: seen.append(p.shape[-2]) or p * 2)
    assert seen == [8, 8, 4] and torch.equal(y, x * 2)
    assert plan.run(x[:, :0], lambda p: p).shape == (2, 0, 5)


@pytest.mark.parametrize("hidden", [576, 7168, 40000])
def test_rms_norm_rows_equal_alone_and_match_reference(hidden):
    x, w = _rand(9, hidden, seed=7) * 3, _rand(hidden, seed=8)
    full = BI.rms_norm(x, w, 1e-5)
    for i in range(9):
        assert torch.equal(BI.rms_norm(x[i : i + 1], w, 1e-5)[0], full[i])
    torch.testing.assert_close(full, reference.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_rows_equal_alone_over_a_large_vocab(op):
    x = _rand(6, 129280, seed=9) * 4
    fn = getattr(BI, op)
    full = fn(x, -1)
    for i in range(6):
        assert torch.equal(fn(x[i : i + 1], -1)[0], full[i])
    torch.testing.assert_close(full, getattr(reference, op)(x, -1))


# ---- paged attention --------------------------------------------------------------------------


def _case(layout: str) -> PagedCase:
    return PagedCase(layout, [2 * KV_SPLIT + 37, 5, 40, KV_SPLIT + 1])


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_rows_equal_across_prefill_chunking_and_decode(layout):
    case = _case(layout)
    n = case.lengths[0]
    whole = case.run(BI, [(0, 0, n)])[0]
    for chunk in [7, 16, KV_SPLIT, 200]:
        rows = [case.run(BI, [(0, c, min(chunk, n - c))])[0] for c in range(0, n, chunk)]
        assert torch.equal(torch.cat(rows), whole), chunk
    for pos in [0, 1, KV_SPLIT - 1, KV_SPLIT, n - 1]:
        assert torch.equal(case.run(BI, [(0, pos, 1)])[0][0], whole[pos]), pos


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_rows_equal_inside_mixed_batches(layout):
    case = _case(layout)
    alone = [case.run(BI, [(i, n - 1, 1)])[0] for i, n in enumerate(case.lengths)]
    decodes = [(i, n - 1, 1) for i, n in enumerate(case.lengths)]
    for batch in [decodes, decodes[::-1], decodes[1:], [(0, 100, 50), *decodes[1:]]]:
        for (i, _, m), o in zip(batch, case.run(BI, batch), strict=True):
            if m == 1:
                assert torch.equal(o[0], alone[i][0]), (batch, i)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_matches_reference(layout):
    case = _case(layout)
    n0, n3 = case.lengths[0], case.lengths[3]
    for seqs in [[(0, 0, n0)], [(0, 60, 90), (1, 4, 1), (2, 39, 1)], [(3, 0, n3)]]:
        got = torch.cat(case.run(BI, seqs))
        ref = torch.cat(case.run(reference.KERNELS, seqs))
        assert not got.isnan().any()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
