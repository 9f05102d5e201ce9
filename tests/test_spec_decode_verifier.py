"""Draft acceptance: longest matching prefix for point-mass drafts, exact rejection sampling for
drafts with a distribution (checked against the exact target distribution with a chi-squared bound).
"""

import torch

from deepserve.engine.spec_decode.stats import SpecDecodeStats
from deepserve.engine.spec_decode.verifier import (
    PAD,
    accept_matching_prefix,
    num_matching,
    rejection_sample,
    rejection_sample_seeded,
)


def test_matching_prefix_accepts_until_first_mismatch_and_adds_target_token():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 3, 8]])
    res = accept_matching_prefix(drafts, target)
    assert res.num_accepted.tolist() == [3, 1, 0, 2]
    assert [res.emitted(i) for i in range(4)] == [[5, 6, 7, 8], [5, 6], [5], [5, 6, 3]]
    assert res.output_tokens[1].tolist() == [5, 6, PAD, PAD]


def test_matching_prefix_handles_rows_with_fewer_drafts():
    drafts = torch.tensor([[5, PAD, PAD], [PAD, PAD, PAD]])
    target = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    res = accept_matching_prefix(drafts, target)
    assert res.num_accepted.tolist() == [1, 0]
    assert [res.emitted(0), res.emitted(1)] == [[5, 6], [1]]


def test_rejection_sample_accepts_everything_when_q_equals_p():
    p = torch.softmax(torch.randn(3, 3, 6, generator=torch.Generator().manual_seed(1)), -1)
    drafts = torch.tensor([[0, 1], [2, 3], [4, 5]])
    res = rejection_sample_seeded(
        p, p[:, :2], drafts, torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.long)
    )
    assert res.num_accepted.tolist() == [2, 2, 2]
    assert res.output_tokens[:, :2].tolist() == drafts.tolist()


def test_rejection_sample_never_emits_a_token_the_target_rules_out():
    p = torch.tensor([[[0.0, 0.5, 0.5], [0.0, 0.5, 0.5]]]).expand(500, 2, 3).contiguous()
    q = torch.tensor([[[1.0, 0.0, 0.0]]]).expand(500, 1, 3).contiguous()
    drafts = torch.zeros(500, 1, dtype=torch.long)
    res = rejection_sample_seeded(
        p, q, drafts, torch.arange(500), torch.zeros(500, dtype=torch.long)
    )
    assert (res.num_accepted == 0).all()
    assert set(res.output_tokens[:, 0].tolist()) == {1, 2}


def test_rejection_sample_is_reproducible_for_a_seed():
    p = torch.softmax(torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(2)), -1)
    q = torch.softmax(torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(3)), -1)
    drafts = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0]])
    seeds, pos = torch.tensor([11, 12, 13, 14]), torch.tensor([0, 5, 9, 2])
    a = rejection_sample_seeded(p, q, drafts, seeds, pos)
    b = rejection_sample_seeded(p, q, drafts, seeds, pos)
    assert torch.equal(a.output_tokens, b.output_tokens)


def test_rejection_sampling_preserves_the_target_joint_distribution():
    """Two-token continuations of a Markov chain: target P, drafter Q (a different chain).

    Speculative rounds with k = 2 drafts from Q, repeated until each of N seeded samples has two
    tokens, must give the joint law P(a|s) P(b|a) over the 16 pairs. Chi-squared with 15 degrees of
    freedom stays below 37.7 with probability 0.999 when the law is right; a sampler that accepted
    drafts without the min(1, p/q) test (the law of Q) scores in the thousands (checked below).
    """
    n, vocab, start = 40_000, 4, 0
    gen = torch.Generator().manual_seed(0)
    P = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)
    Q = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)
    seeds = torch.arange(n, dtype=torch.long) * 7919 + 1
    pairs = _speculative_pairs(P, Q, start, seeds, gen)
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).double()
    expected = (P[start].unsqueeze(1) * P).reshape(-1).double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 37.7, chi2
    wrong = (Q[start].unsqueeze(1) * Q).reshape(-1).double() * n
    assert ((counts - wrong) ** 2 / wrong).sum().item() > 37.7


def _speculative_pairs(P, Q, start, seeds, gen):
    n = len(seeds)
    out = [[] for _ in range(n)]
    last = torch.full((n,), start, dtype=torch.long)
    pos = torch.zeros(n, dtype=torch.long)
    while any(len(o) < 2 for o in out):
        d1 = torch.multinomial(Q[last], 1, generator=gen).squeeze(1)
        d2 = torch.multinomial(Q[d1], 1, generator=gen).squeeze(1)
        drafts = torch.stack([d1, d2], 1)
        target = torch.stack([P[last], P[d1], P[d2]], 1)
        q = torch.stack([Q[last], Q[d1]], 1)
        res = rejection_sample_seeded(target, q, drafts, seeds, pos)
        for i in range(n):
            out[i].extend(res.emitted(i))
        pos += res.num_accepted + 1
        last = torch.tensor([o[-1] for o in out])
    return torch.tensor([o[:2] for o in out])


def test_rejection_sample_treats_pad_as_no_draft():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    res = rejection_sample(p, q, torch.tensor([[PAD]]), torch.tensor([[0.0]]), torch.zeros(1, 2, 3))
    assert res.num_accepted.tolist() == [0]
    assert res.emitted(0) == [1]


def test_stats_count_acceptance_by_position_and_mean_length():
    stats = SpecDecodeStats()
    stats.observe(3, 3)
    stats.observe(3, 1)
    stats.observe(2, 0)
    stats.observe(0, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.acceptance_rate == 0.5
    assert stats.acceptance_rate_by_position() == [2 / 3, 1 / 3, 1 / 2]
    assert stats.mean_accepted_length == (4 + 2 + 1) / 3


def test_num_matching_counts_leading_equal_drafts():
    assert num_matching([4, 5, 6], [4, 5, 7, 8]) == 2
    assert num_matching([], [3]) == 0
    assert num_matching([1, 2], [1, 2, 9]) == 2
