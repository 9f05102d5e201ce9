"""The CPU batch-invariant ops: each row's bits independent of the batch around it, and the same
function as the torch reference (within float32 tolerance). Attention rows must be bitwise equal
whether the prompt is prefilled at once, in chunks of any size, decoded a token at a time, or batched
with neighbours of other lengths."""

from __future__ import annotations

import pytest
import torch

from deepserve.engine.attention import AttentionMetadata
from deepserve.kernels import reference
from deepserve.kernels.batch_invariant import KV_SPLIT, cpu_kernels

BI = cpu_kernels()
BLOCK = 16


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


class Cache:
    """A paged KV cache with one sequence per block-table row, blocks scattered at random."""

    def __init__(self, lengths, hkv, dk, dv, mla=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        nblocks = sum(-(-n // BLOCK) for n in lengths) + 3
        perm = torch.randperm(nblocks, generator=g).tolist()
        self.tables, used = [], 0
        for n in lengths:
            nb = -(-n // BLOCK)
            self.tables.append(perm[used : used + nb])
            used += nb
        if mla:
            self.k = torch.randn(nblocks, BLOCK, 1, dk, generator=g)
            self.v = self.k[..., :dv]
        else:
            self.k = torch.randn(nblocks, BLOCK, hkv, dk, generator=g)
            self.v = torch.randn(nblocks, BLOCK, hkv, dv, generator=g)
        # what no step wrote yet: poison, so reading past a sequence shows up
        self.k[perm[used:]] = float("nan")
        self.v_poison = perm[used:]

    def meta(self, seqs: list[tuple[int, int, int]]) -> AttentionMetadata:
        """seqs: (sequence index, context length, query count)."""
        width = max(len(t) for t in self.tables)
        tables = [self.tables[i] + [0] * (width - len(self.tables[i])) for i, _, _ in seqs]
        qlens = [n for _, _, n in seqs]
        ctx = [c for _, c, _ in seqs]
        lens = [c + n for _, c, n in seqs]
        loc = [0]
        for n in qlens:
            loc.append(loc[-1] + n)
        return AttentionMetadata(
            query_start_loc=torch.tensor(loc, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            slot_mapping=torch.zeros(sum(qlens), dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            block_size=BLOCK,
            query_lens_cpu=qlens,
            seq_lens_cpu=lens,
            context_lens_cpu=ctx,
        )


LAYOUTS = {"gqa": dict(hq=9, hkv=3, dk=64, dv=64), "mla": dict(hq=4, hkv=1, dk=80, dv=64)}


def _setup(layout: str):
    shape = LAYOUTS[layout]
    lengths = [2 * KV_SPLIT + 37, 5, 40, KV_SPLIT + 1]
    cache = Cache(lengths, shape["hkv"], shape["dk"], shape["dv"], mla=layout == "mla")
    queries = [_rand(n, shape["hq"], shape["dk"], seed=20 + i) for i, n in enumerate(lengths)]
    return cache, queries, lengths


def _run(kernels, cache, queries, seqs):
    """Attention for `seqs` [(seq, ctx, n)] in one batch -> list of that step's rows per seq."""
    q = torch.cat([queries[i][c : c + n] for i, c, n in seqs])
    out = kernels.paged_attention(q, cache.k, cache.v, cache.meta(seqs), 0.125)
    return list(out.split([n for _, _, n in seqs]))


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_rows_equal_across_prefill_chunking_and_decode(layout):
    cache, queries, lengths = _setup(layout)
    s, n = 0, lengths[0]
    whole = _run(BI, cache, queries, [(s, 0, n)])[0]
    for chunk in [7, 16, KV_SPLIT, 200]:
        rows = [
            _run(BI, cache, queries, [(s, c, min(chunk, n - c))])[0] for c in range(0, n, chunk)
        ]
        assert torch.equal(torch.cat(rows), whole), chunk
    for pos in [0, 1, KV_SPLIT - 1, KV_SPLIT, n - 1]:
        assert torch.equal(_run(BI, cache, queries, [(s, pos, 1)])[0][0], whole[pos]), pos


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_rows_equal_inside_mixed_batches(layout):
    cache, queries, lengths = _setup(layout)
    alone = [_run(BI, cache, queries, [(i, n - 1, 1)])[0] for i, n in enumerate(lengths)]
    decodes = [(i, n - 1, 1) for i, n in enumerate(lengths)]
    for batch in [decodes, decodes[::-1], decodes[1:], [(0, 100, 50), *decodes[1:]]]:
        outs = _run(BI, cache, queries, batch)
        for (i, _, m), o in zip(batch, outs, strict=True):
            if m == 1:
                assert torch.equal(o[0], alone[i][0]), (batch, i)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_matches_reference(layout):
    cache, queries, lengths = _setup(layout)
    for seqs in [[(0, 0, lengths[0])], [(0, 60, 90), (1, 4, 1), (2, 39, 1)], [(3, 0, lengths[3])]]:
        got = torch.cat(_run(BI, cache, queries, seqs))
        ref = torch.cat(_run(reference.KERNELS, cache, queries, seqs))
        assert not got.isnan().any()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
