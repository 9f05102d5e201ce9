"""The n-gram (prompt lookup) proposer, on small token lists."""

import numpy as np
import pytest

from deepserve.engine.spec_decode.ngram import NgramProposer


def test_proposes_continuation_of_most_recent_earlier_occurrence():
    tokens = [1, 2, 3, 10, 11, 1, 2, 3, 20, 21, 22, 9, 1, 2, 3]
    assert NgramProposer(2, 3).propose(tokens, 3) == [20, 21, 22]


def test_prefers_longest_ngram_over_more_recent_shorter_one():
    # "7 2 3" occurs once, followed by 40; the bigram "2 3" occurs more recently, followed by 50.
    tokens = [7, 2, 3, 40, 41, 2, 3, 50, 51, 7, 2, 3]
    assert NgramProposer(2, 3).propose(tokens, 2) == [40, 41]
    assert NgramProposer(2, 2).propose(tokens, 2) == [50, 51]


def test_falls_back_to_shorter_ngram():
    tokens = [5, 6, 8, 9, 1, 6]
    assert NgramProposer(1, 3).propose(tokens, 2) == [8, 9]
    assert NgramProposer(2, 3).propose(tokens, 2) == []


def test_continuation_reaching_the_end_repeats_with_its_period():
    assert NgramProposer(2, 2).propose([4, 4, 4, 4], 5) == [4, 4, 4, 4, 4]
    # "1 2" last seen 3 back: the loop 3 1 2 goes on
    assert NgramProposer(2, 2).propose([9, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]


def test_no_proposal_without_repeat_or_when_zero_requested():
    assert NgramProposer(1, 4).propose([1, 2, 3, 4], 3) == []
    assert NgramProposer(1, 4).propose([1, 2, 1, 2], 0) == []
    assert NgramProposer(1, 4).propose([7], 3) == []


def test_max_history_limits_the_lookback():
    tokens = [1, 2, 99] + [0] * 20 + [1, 2]
    assert NgramProposer(2, 2).propose(tokens, 1) == [99]
    assert NgramProposer(2, 2, max_history=10).propose(tokens, 1) == []


def test_matches_a_brute_force_search_on_random_sequences():
    rng = np.random.default_rng(0)
    proposer = NgramProposer(2, 4)
    for _ in range(200):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        assert proposer.propose(tokens, 3) == _brute_force(tokens, 2, 4, 3)


def test_rejects_bad_ngram_bounds():
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def _brute_force(tokens, lo, hi, k):
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                draft = tokens[i + n :]  # up to the end, then the same period again
                while len(draft) < k:
                    draft = draft + draft
                return draft[:k]
    return []
