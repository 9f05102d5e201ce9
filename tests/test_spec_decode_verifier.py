"""Draft acceptance: the longest prefix of drafts equal to the target's own samples, and the
acceptance counters."""

from deepserve.engine.spec_decode.stats import SpecDecodeStats
from deepserve.engine.spec_decode.verifier import num_matching


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
