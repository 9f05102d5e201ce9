"""DeepSeek-V4's reference ops over slot lists (kernels/reference/sparse_attention.py): sparse
attention against the softmax written out, the indexer's top-k choice (causal, ascending, -1
padded at the end, ties to the lower entry, blind to entries a token cannot see), the compressors'
pooling against its formula; and the `--batch-invariant` versions (kernels/reference/invariant.py)
against them, with the bits of a row independent of where the -1s sit and of upper-bound widths."""

from __future__ import annotations

import torch

from deepserve.kernels.reference.invariant import RowTiledMatmul, SplitSparseAttention, TiledIndexer
from deepserve.kernels.reference.sparse_attention import (
    compress_pool,
    indexer_topk,
    sparse_attention,
)


def _cache(rows: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


def test_sparse_attention_is_softmax_over_listed_keys_with_a_sink_column():
    gen = torch.Generator().manual_seed(0)
    cache = _cache(20, 24, 0)
    window_kv, entry_kv = cache[:, :8], cache[:, 16:]  # strided views, as the model passes them
    q, sinks = torch.randn(3, 2, 8, generator=gen), torch.randn(2, generator=gen)
    window = torch.tensor([[-1, -1], [4, 5], [-1, 7]])
    entries = torch.tensor([[-1, -1, -1], [9, -1, -1], [0, 3, 11]])
    got = sparse_attention(q, window_kv, window, entry_kv, entries, sinks, 0.3)
    for t in range(3):
        keys = torch.cat(
            [window_kv[window[t][window[t] >= 0]], entry_kv[entries[t][entries[t] >= 0]]]
        )
        for h in range(2):
            logits = torch.cat([(keys @ q[t, h]) * 0.3, sinks[h : h + 1]])
            p = torch.softmax(logits, 0)[:-1]
            assert torch.allclose(got[t, h], p @ keys, atol=1e-6)


def test_sparse_attention_without_keys_gives_zeros():
    cache = _cache(5, 8, 1)
    q, sinks = torch.randn(2, 3, 8), torch.randn(3)
    got = sparse_attention(q, cache, torch.full((2, 4), -1), None, None, sinks, 0.5)
    assert torch.equal(got, torch.zeros(2, 3, 8))


def test_indexer_topk_is_causal_ascending_padded_and_breaks_ties_low():
    keys = torch.tensor([[1.0], [2.0], [2.0], [0.5], [2.0], [9.0]])
    slots = torch.tensor([[0, 1, 2, 3, 4]])  # row 5 (9.0) belongs to no entry
    q, weights = torch.ones(4, 1, 1), torch.ones(4, 1)
    visible = torch.tensor([0, 1, 2, 5])
    ids = indexer_topk(q, weights, keys, slots, torch.zeros(4, dtype=torch.long), visible, 2, 1.0)
    assert ids.tolist() == [[-1, -1], [0, -1], [0, 1], [1, 2]]


def test_indexer_topk_reads_each_tokens_own_sequence():
    keys = torch.tensor([[1.0], [5.0], [3.0], [4.0]])
    slots = torch.tensor([[0, 1], [2, 3]])  # sequence 1's best is its entry 1 (4.0)
    q, weights = torch.ones(2, 1, 1), torch.ones(2, 1)
    ids = indexer_topk(q, weights, keys, slots, torch.tensor([1, 0]), torch.tensor([2, 2]), 1, 1.0)
    assert ids.tolist() == [[1], [1]]


def test_indexer_topk_ignores_entries_a_token_cannot_see():
    gen = torch.Generator().manual_seed(1)
    q, w = torch.randn(4, 8, 16, generator=gen), torch.randn(4, 8, generator=gen)
    keys = torch.randn(60, 16, generator=gen)
    slots = torch.randperm(60, generator=gen)[:40][None]
    seq, visible = torch.zeros(4, dtype=torch.long), torch.tensor([3, 10, 20, 25])
    short = indexer_topk(q, w, keys, slots[:, :25], seq, visible, 6, 0.25)
    long = indexer_topk(q, w, keys, slots, seq, visible, 6, 0.25)
    assert torch.equal(short, long)


def _pool_inputs(groups: int, ratio: int, series: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(groups * ratio, 3 * series * dim, generator=gen)
    tokens = torch.arange(groups * ratio).view(groups, ratio)
    previous = torch.cat([tokens[:1], tokens[:-1]])
    ape = torch.randn(ratio, series * dim, generator=gen)
    kv, gate = slice(series * dim, 2 * series * dim), slice(2 * series * dim, 3 * series * dim)
    return rows, tokens, previous, torch.arange(groups) > 0, ape, kv, gate


def test_compress_pool_is_a_gated_softmax_over_the_groups_tokens():
    rows, tokens, previous, has_prev, ape, kv, gate = _pool_inputs(3, 4, 1, 8, 2)
    got = compress_pool(rows, tokens, previous, has_prev, ape, kv, gate, 8, 1)
    for g in range(3):
        weights = torch.softmax(rows[tokens[g]][:, gate] + ape, dim=0)
        assert torch.allclose(got[g], (weights * rows[tokens[g]][:, kv]).sum(0), atol=1e-6)


def test_compress_pool_overlaps_the_previous_groups_first_series():
    rows, tokens, previous, has_prev, ape, kv, gate = _pool_inputs(3, 4, 2, 8, 3)
    got = compress_pool(rows, tokens, previous, has_prev, ape, kv, gate, 8, 2)
    for g in range(3):
        own, prev = rows[tokens[g]], rows[previous[g]]
        gates = [own[:, gate][:, 8:] + ape[:, 8:]]
        values = [own[:, kv][:, 8:]]
        if g > 0:
            gates.insert(0, prev[:, gate][:, :8] + ape[:, :8])
            values.insert(0, prev[:, kv][:, :8])
        weights = torch.softmax(torch.cat(gates), dim=0)
        assert torch.allclose(got[g], (weights * torch.cat(values)).sum(0), atol=1e-6)


def test_compress_pool_of_a_group_does_not_depend_on_the_others():
    rows, tokens, previous, has_prev, ape, kv, gate = _pool_inputs(9, 4, 2, 8, 4)
    many = compress_pool(rows, tokens, previous, has_prev, ape, kv, gate, 8, 2)
    one = compress_pool(rows, tokens[5:6], previous[5:6], has_prev[5:6], ape, kv, gate, 8, 2)
    assert torch.equal(one[0], many[5])


def test_invariant_sparse_attention_matches_the_reference_wherever_the_gaps_sit():
    gen = torch.Generator().manual_seed(5)
    cache = _cache(400, 32, 6)
    window_kv, entry_kv = cache[:, :16], cache[:, 16:]
    q, sinks = torch.randn(6, 4, 16, generator=gen), torch.randn(4, generator=gen)
    window = torch.randint(-1, 400, (6, 150), generator=gen)
    entries = torch.randint(-1, 400, (6, 40), generator=gen)
    window[0], entries[0] = -1, -1  # no key: zeros
    op = SplitSparseAttention(RowTiledMatmul())
    got = op(q, window_kv, window, entry_kv, entries, sinks, 0.25)
    want = sparse_attention(q, window_kv, window, entry_kv, entries, sinks, 0.25)
    assert torch.allclose(got, want, atol=1e-5)
    # token 3 alone, its keys behind 50 more -1s and with wider entry lists: the same bits
    wider_window = torch.cat([torch.full((1, 50), -1), window[3:4]], dim=1)
    wider_entries = torch.cat([entries[3:4], torch.full((1, 90), -1)], dim=1)
    alone = op(q[3:4], window_kv, wider_window, entry_kv, wider_entries, sinks, 0.25)
    assert torch.equal(alone, got[3:4])


def test_invariant_indexer_topk_matches_the_reference_and_ignores_upper_bound_widths():
    gen = torch.Generator().manual_seed(3)
    q, w = torch.randn(5, 8, 16, generator=gen), torch.randn(5, 8, generator=gen)
    keys = torch.randn(300, 16, generator=gen)
    slots = torch.randperm(300, generator=gen)[:140].view(2, 70)
    seq, visible = torch.tensor([0, 1, 1, 0, 1]), torch.tensor([0, 3, 20, 64, 70])
    op = TiledIndexer(RowTiledMatmul())
    got = op(q, w, keys, slots, seq, visible, 12, 0.25)
    assert torch.equal(got, indexer_topk(q, w, keys, slots, seq, visible, 12, 0.25))
    wider = torch.cat([slots, torch.zeros(2, 200, dtype=torch.long)], dim=1)
    assert torch.equal(op(q, w, keys, wider, seq, visible, 12, 0.25), got)
