"""DeepSeek-V4's reference attention ops (kernels/reference/sparse_attention.py): sink attention
against the softmax written out, and the indexer's top-k choice: causal, -1 padded, ties to the
lower entry, and blind to entries a query cannot see (so chunking never changes it); and their
`--batch-invariant` versions (kernels/reference/invariant.py) against them."""

from __future__ import annotations

import torch

from deepserve.kernels.reference.sparse_attention import indexer_topk, sink_attention


def test_sink_attention_is_softmax_with_a_sink_column():
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(5, 3, 8, generator=gen), torch.randn(7, 8, generator=gen)
    sinks = torch.randn(3, generator=gen)
    visible = torch.rand(5, 7, generator=gen) > 0.4
    visible[0] = False  # sees nothing: only the sink, so zeros
    got = sink_attention(q, kv, visible, sinks, 0.3)
    for t in range(5):
        for h in range(3):
            logits = torch.cat([(kv @ q[t, h]) * 0.3, sinks[h : h + 1]])
            logits[:-1][~visible[t]] = float("-inf")
            p = torch.softmax(logits, 0)[:-1]
            assert torch.allclose(got[t, h], p @ kv, atol=1e-6)
    assert torch.equal(got[0], torch.zeros(3, 8))


def test_indexer_topk_is_causal_padded_and_breaks_ties_low():
    keys = torch.tensor([[1.0], [2.0], [2.0], [0.5], [2.0]])
    q = torch.ones(3, 1, 1)
    weights = torch.ones(3, 1)
    visible = torch.tensor([0, 2, 5])
    ids = indexer_topk(q, weights, keys, visible, 2, 1.0)
    assert ids.tolist() == [[-1, -1], [1, 0], [1, 2]]


def test_indexer_topk_ignores_entries_a_query_cannot_see():
    gen = torch.Generator().manual_seed(1)
    q, w = torch.randn(4, 8, 16, generator=gen), torch.randn(4, 8, generator=gen)
    keys = torch.randn(40, 16, generator=gen)
    visible = torch.tensor([3, 10, 20, 25])
    short = indexer_topk(q, w, keys[:25], visible, 6, 0.25)
    long = indexer_topk(q, w, keys, visible, 6, 0.25)
    assert torch.equal(short, long)


def test_invariant_sink_attention_matches_the_reference_and_ignores_key_layout():
    from deepserve.kernels.reference.invariant import RowTiledMatmul, SplitSinkAttention

    gen = torch.Generator().manual_seed(2)
    q, kv = torch.randn(6, 4, 16, generator=gen), torch.randn(300, 16, generator=gen)
    sinks = torch.randn(4, generator=gen)
    visible = torch.rand(6, 300, generator=gen) > 0.5
    visible[0] = False
    op = SplitSinkAttention(RowTiledMatmul())
    got = op(q, kv, visible, sinks, 0.25)
    assert torch.allclose(got, sink_attention(q, kv, visible, sinks, 0.25), atol=1e-5)
    # the same visible keys behind 50 more invisible ones, for one query alone: the same bits
    shifted = torch.cat([torch.randn(50, 16, generator=gen), kv])
    seen = torch.cat([torch.zeros(6, 50, dtype=torch.bool), visible], dim=1)
    assert torch.equal(op(q[3:4], shifted, seen[3:4], sinks, 0.25), got[3:4])


def test_invariant_indexer_topk_matches_the_reference():
    from deepserve.kernels.reference.invariant import RowTiledMatmul, TiledIndexer

    gen = torch.Generator().manual_seed(3)
    q, w = torch.randn(5, 8, 16, generator=gen), torch.randn(5, 8, generator=gen)
    keys = torch.randn(70, 16, generator=gen)
    visible = torch.tensor([0, 3, 20, 64, 70])
    got = TiledIndexer(RowTiledMatmul())(q, w, keys, visible, 12, 0.25)
    assert torch.equal(got, indexer_topk(q, w, keys, visible, 12, 0.25))
